"""Rewards score the FINAL ANSWER only: adversarial replies that restate, echo or hedge score wrong.

Every case states the exact score it must get. The ``math`` reward runs math-verify in-process here
(main thread, so its signal.alarm timeouts work); one test runs it through the process pool.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megarl.executors.base import ProcessDied
from megarl.reward import (RewardConfig, RewardPool, ScoredSample, get_reward, known_rewards,
                           overlong_penalty, register_reward)
from megarl.reward import answers

REPO = Path(__file__).resolve().parents[2]


def arithmetic(reply, gold, strict=False):
    return get_reward("arithmetic")(reply, gold, strict=strict)


def gsm8k(reply, gold, strict=False):
    return get_reward("gsm8k")(reply, gold, strict=strict)


def math_(reply, gold, strict=False):
    return get_reward("math")(reply, gold, strict=strict)


def dapo(reply, gold, strict=False):
    return get_reward("dapo")(reply, gold, strict=strict)


def score(cfg: RewardConfig, replies, golds, reasons=None, lengths=None, max_new_tokens=100):
    n = len(replies)
    with RewardPool(cfg, max_new_tokens=max_new_tokens) as pool:
        return pool.score_texts(replies, golds, reasons or ["stop"] * n, lengths or [1] * n)


# ---------------------------------------------------------------------------------------------
# The exploit: restating or echoing the question, hedging between candidates


RESTATE = "To find 12 + 7, we need to perform the arithmetic"
ECHO = "What is 12 + 7? Reply with only the final number."


@pytest.mark.parametrize("fn", ["arithmetic", "gsm8k", "math", "dapo"])
@pytest.mark.parametrize("reply", [RESTATE, ECHO, "12 + 7", "17, 18, 19, 20", "19 or 20", "19, no wait, 20"])
def test_restating_echoing_or_hedging_scores_wrong(fn, reply):
    for strict in (False, True):
        assert get_reward(fn)(reply, "19", strict=strict) is False


def test_restatement_scores_the_wrong_reward_in_the_pool():
    (s,) = score(RewardConfig(correct=1.0, wrong=-0.5), [RESTATE], ["19"])
    # The last number (7) was extracted, so the reply is formatted, and wrong.
    assert s == ScoredSample(reward=-0.5, correct=False, formatted=True, truncated=False)


def test_expression_without_result_is_wrong():
    assert arithmetic("3 * 9", "27") is False  # its final number is 9
    assert arithmetic("12-7", "-7") is False  # a subtraction, not a negative 7
    assert arithmetic("12-7", "7") is True  # ... whose last number is 7 (a restatement only wins by luck)


@pytest.mark.parametrize("fn", ["arithmetic", "gsm8k"])
def test_a_degenerate_digit_run_scores_wrong_instead_of_raising(fn):
    long = "7" * 5000  # past Python's 4300-digit conversion limit: Fraction() would raise ValueError
    assert get_reward(fn)(long + " so the answer is 19", "19") is True  # the last number is 19
    assert get_reward(fn)("19, then " + long, "19") is False           # the last number equals no gold
    assert get_reward(fn)(long, "19", strict=True) is False
    assert get_reward(fn)("#### " + long, "19") is False


def test_correct_answer_after_a_restatement_is_flexible_only():
    assert arithmetic("12 + 7 = 19", "19") is True
    assert arithmetic("12 + 7 = 19", "19", strict=True) is False
    assert arithmetic("12 + 7 = 19.", "19") is True


# ---------------------------------------------------------------------------------------------
# Number normalization


@pytest.mark.parametrize("reply,gold,want", [
    ("19", "19", True),
    ("19.", "19", True),                       # trailing period
    ("The answer is 19.", "19", True),
    ("= 19", "19", True),
    ("$19", "19", True),
    ("19.0", "19", True),                      # 19.0 == 19
    ("19.50", "19.5", True),
    ("19.5", "19", False),
    ("0.1", "0.1000001", False),               # exact, no float rounding
    ("The total is 1,234.", "1234", True),     # thousands separator
    ("1234", "1,234", True),
    ("1,234", "234", False),                   # '1,234' is one number, not '1' and '234'
    ("17,18", "18", True),                     # not a thousands group: two numbers, the last counts
    ("\u22125", "-5", True),                   # unicode minus
    ("\u20135", "-5", True),                   # en dash as minus
    ("x = -5", "-5", True),
    ("The answer is -5", "-5", True),
    ("-5", "5", False),
    ("12 - 7 = 5", "5", True),
    ("", "19", False),                          # empty reply
    ("   ", "19", False),
    ("I do not know.", "19", False),            # no number
    ("19", "", False),                          # no gold number
])
def test_number_normalization(reply, gold, want):
    assert arithmetic(reply, gold) is want


@pytest.mark.parametrize("reply,want", [("19", True), (" 19. ", True), ("= 19", True), ("$19", True),
                                        ("\u221219", False), ("19 apples", False), ("12 + 7 = 19", False),
                                        ("Answer: 19", False), ("", False)])
def test_arithmetic_strict_is_the_whole_reply(reply, want):
    assert arithmetic(reply, "19", strict=True) is want


def test_strict_negative():
    assert arithmetic("\u221219.", "-19", strict=True) is True


def test_answer_extraction_values():
    assert answers.last_number("12 + 7 = 19.") == 19
    assert answers.last_number("no number") is None
    assert str(answers.last_number("$1,234.50")) == "2469/2"
    assert answers.numbers("12-7=5") == [12, 7, 5]
    assert answers.hash_answer("so 4\n#### 72\n") == 72
    assert answers.hash_answer("#### none") is None
    assert answers.last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert answers.last_boxed(r"\boxed{1} then \boxed{2") is None  # the last box is unclosed
    assert answers.last_boxed(r"\boxed{5} because", at_end=True) is None
    assert answers.last_boxed(r"$\boxed{5}$.", at_end=True) == "5"


# ---------------------------------------------------------------------------------------------
# gsm8k: strict-match vs flexible-extract


@pytest.mark.parametrize("reply,flexible,strict", [
    ("3 + 4 = 7, so 7 * 2 = 14 #### 14", True, True),
    ("The answer is 14", True, False),          # no '####': flexible falls back to the last number
    ("#### 14\nNext question: what is 3 + 9? 12", True, True),  # the '####' answer wins over later numbers
    ("#### $1,400.", False, False),             # the gold is 14, not 1400
    ("14 #### 15", False, False),
    ("#### the answer is 14", True, False),     # nothing numeric right after '####'
    ("", False, False),
])
def test_gsm8k_strict_and_flexible(reply, flexible, strict):
    assert gsm8k(reply, "14") is flexible
    assert gsm8k(reply, "14", strict=True) is strict


def test_gsm8k_thousands_and_gold_with_marker():
    assert gsm8k("#### $1,400.", "1400", strict=True) is True
    assert gsm8k("#### 72", "Natalia sold 48/2 = 24 clips ... #### 72", strict=True) is True


# ---------------------------------------------------------------------------------------------
# math: the last \boxed{} only, verified by math-verify


@pytest.mark.parametrize("reply,gold,want", [
    ("The answer is 1/2", "1/2", False),                        # no \boxed: wrong, whatever it says
    ("$\\frac{1}{2}$", "0.5", False),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("So the answer is $\\boxed{0.5}$.", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", True),              # a boxed gold
    ("\\boxed{\\frac{1}{2}}", "$0.5$", True),
    ("12 + 7 = 19 so the answer is 19", "19", False),           # free text equal to gold
    ("\\boxed{18} or maybe 19", "19", False),                   # only the last box counts
    ("\\boxed{19} no wait \\boxed{20}", "19", False),
    ("\\boxed{19", "19", False),                                # unclosed
    ("\\boxed{}", "19", False),
    ("\\boxed{(1,2)}", "(1,2)", True),
    ("\\boxed{\\frac{\\sqrt2}{2}}", "\\sqrt{2}/2", True),
])
def test_math_boxed_only(reply, gold, want):
    assert math_(reply, gold) is want


# The question's own arithmetic, boxed, equals a numeric gold: a policy that learns to box it scores
# without solving (each row is a MATH-style question's expression; the audit that found them).
@pytest.mark.parametrize("reply,gold", [
    ("\\boxed{\\dbinom{8}{4}}", "70"),
    ("\\boxed{\\log_2 64}", "6"),
    ("\\boxed{\\frac{1}{2}+\\frac{1}{3}}", "\\frac56"),
    ("\\boxed{\\sum_{k=1}^{100} k}", "5050"),
    ("\\boxed{1234 \\times 5678}", "7006652"),
    ("\\boxed{12+7}", "19"),
    ("\\boxed{2^{10}}", "1024"),
    ("\\boxed{3 \\lor 19}", "19"),                            # a hedge
    ("\\boxed{3 = 19}", "19"),                                # a false equation
])
def test_math_an_expression_for_a_numeric_gold_is_wrong(reply, gold):
    assert math_(reply, gold) is False and math_(reply, gold, strict=True) is False
    assert dapo(f"Answer: {reply}", gold) is False


@pytest.mark.parametrize("reply,gold,want", [
    ("\\boxed{7,006,652}", "7006652", True),                   # the number, written out
    ("\\boxed{\\frac56}", "\\frac{5}{6}", True),                # TeX's \frac56 shorthand
    ("\\boxed{5/6}", "\\frac56", True),
    ("\\boxed{-\\frac{1}{2}}", "-0.5", True),
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{5^\\circ}", "5", True),
    ("\\boxed{19 \\text{ cm}}", "19", True),
    ("\\boxed{\\$18.90}", "\\$18.90", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),                # a symbolic gold: compared symbolically
    # a percent sign counts only when the gold has one: 3% is 3, never also 0.03
    ("\\boxed{3\\%}", "3", True),
    ("\\boxed{3\\%}", "0.03", False),
    ("\\boxed{19\\%}", "\\frac{19}{100}", False),
    ("\\boxed{1900\\%}", "19", False),
    ("\\boxed{25\\%}", "25\\%", True),
])
def test_math_numbers_written_out_and_percent(reply, gold, want):
    assert math_(reply, gold) is want


@pytest.mark.parametrize("fn", ["math", "dapo"])
def test_math_verify_is_loaded_before_a_scoring_process_takes_a_sample(fn):
    # prepare() runs before the process says ready: importing sympy's LaTeX grammar (1-4 s on loaded
    # cores) would otherwise count against the first sample's reward.timeout_s
    code = ("import sys; from megarl.reward.registry import get_reward, reward_meta; "
            f"before = 'math_verify' in sys.modules; reward_meta(get_reward({fn!r}))['prepare'](); "
            "print(before, 'math_verify' in sys.modules, 'latex2sympy2_extended' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.stdout.split() == ["False", "True", "True"], done.stderr


def test_math_strict_requires_the_box_to_end_the_reply():
    assert math_("\\boxed{19} and that is all I can say", "19") is True
    assert math_("\\boxed{19} and that is all I can say", "19", strict=True) is False
    assert math_("Thus $\\boxed{19}$.", "19", strict=True) is True


def test_math_in_the_pool():
    cfg = RewardConfig(fn="math", workers=1, timeout_s=5.0, correct=1.0, wrong=-1.0)
    got = score(cfg, ["\\boxed{\\frac{1}{2}}", "The answer is 1/2", RESTATE, "\\boxed{19}"],
                ["0.5", "1/2", "19", "19"], reasons=["stop", "stop", "stop", "length"])
    assert got == [ScoredSample(1.0, True, True, False), ScoredSample(-1.0, False, False, False),
                   ScoredSample(-1.0, False, False, False), ScoredSample(-1.0, False, False, True)]


# ---------------------------------------------------------------------------------------------
# dapo: DAPO-Math-17k asks for "Answer: ..." on the last line; else the last \boxed{}

# DAPO-Math-17k's instruction, which a policy can echo back.
DAPO_ECHO = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.")


@pytest.mark.parametrize("reply,gold,want", [
    ("12 + 7 = 19.\nAnswer: 19", "19", True),
    ("Work...\n**Answer:** $\\frac{1}{2}$", "0.5", True),        # markdown bold, TeX dollars
    ("Work...\nanswer: \\boxed{34}.", "34", True),                # a box on the answer line, final period
    ("Thus $\\boxed{34}$.", "34", True),                            # no answer line: the last box
    (DAPO_ECHO, "19", False),                                       # the echoed instruction ('$Answer ...')
    (DAPO_ECHO + "\nWhat is 12 + 7?", "19", False),                # echo + restated question
    ("Answer: 19\nActually I am not sure.", "19", False),           # 'Answer:' not on the last line
    ("Answer: 18\nso 19", "19", False),
    ("Answer: 18\nAnswer: 19", "19", True),                        # only the last line counts
    ("Answer: 19\nAnswer: 18", "19", False),
    ("\\boxed{19}\nAnswer: 18", "19", False),                     # the answer line wins over a box
    ("The answer is 19", "19", False),                              # free text
    ("Answer:", "19", False),
    ("Answer: 1", "19", False),                                     # a truncated number
    ("Answer: \\boxed{19", "19", False),                           # an unclosed box
    ("Answer: 48/2 + 48", "72", False),                             # the question's arithmetic, not the number
])
def test_dapo_answer_line_or_last_box(reply, gold, want):
    assert dapo(reply, gold) is want


def test_dapo_strict_reads_only_the_answer_line():
    assert dapo("Thus $\\boxed{34}$.", "34", strict=True) is False
    assert dapo("Thus 34.\nAnswer: 34", "34", strict=True) is True


def test_dapo_in_the_pool_truncation_is_wrong():
    """Scored in the scoring processes (math-verify); a reply cut at max_new_tokens is wrong
    whatever its last line says."""
    cfg = RewardConfig(fn="dapo", workers=1, timeout_s=5.0, correct=1.0, wrong=0.0)
    got = score(cfg, ["So\nAnswer: 19", DAPO_ECHO, "So\nAnswer: 19"], ["19", "19", "19"],
                reasons=["stop", "stop", "length"])
    # the echo's last line is the instruction, not an answer line: unformatted
    assert got == [ScoredSample(1.0, True, True, False), ScoredSample(0.0, False, False, False),
                   ScoredSample(0.0, False, False, True)]


# ---------------------------------------------------------------------------------------------
# Truncation and overlong shaping


def test_truncated_reply_scores_the_truncated_score_whatever_it_says():
    replies, golds = ["19", "19", "20"], ["19"] * 3
    reasons = ["length", "stop", "length"]
    default = score(RewardConfig(), replies, golds, reasons)
    assert [s.reward for s in default] == [0.0, 1.0, 0.0]  # default: the wrong score
    assert [(s.correct, s.formatted, s.truncated) for s in default] == [
        (False, False, True), (True, True, False), (False, False, True)]
    custom = score(RewardConfig(wrong=-0.5, truncated=-1.0), replies, golds, reasons)
    assert [s.reward for s in custom] == [-1.0, 1.0, -1.0]


@pytest.mark.parametrize("length,want", [(0, 0.0), (80, 0.0), (81, 0.05), (85, 0.25), (90, 0.5), (100, 1.0),
                                         (120, 1.0)])
def test_overlong_penalty_ramp(length, want):
    # max_new_tokens M=100, buffer B=20: 0 up to 80 tokens, (L - 80) / 20 after, full at 100.
    # float64 (L - 80) / 20 of small ints: one rounding, <= 1.1e-16; abs since some wants are 0
    assert overlong_penalty(length, 100, 20, 1.0) == pytest.approx(want, abs=1e-12)


def test_overlong_penalty_applies_to_finished_replies_only():
    cfg = RewardConfig(overlong_buffer=20, overlong_penalty=0.5, correct=1.0, wrong=0.0, truncated=-1.0)
    got = score(cfg, ["19", "19", "20", "19", "19"], ["19"] * 5,
                reasons=["stop", "stop", "stop", "stop", "length"], lengths=[50, 90, 95, 100, 100],
                max_new_tokens=100)
    # 1 - 0; 1 - 0.5 * 10/20; 0 - 0.5 * 15/20; 1 - 0.5 * 20/20; truncated: -1, no penalty on top.
    assert [s.reward for s in got] == pytest.approx([1.0, 0.75, -0.375, 0.5, -1.0])


def test_overlong_off_by_default():
    (s,) = score(RewardConfig(), ["19"], ["19"], lengths=[100], max_new_tokens=100)
    assert s.reward == 1.0
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0


def test_score_checks_lengths():
    with RewardPool(RewardConfig(), max_new_tokens=10) as pool:
        with pytest.raises(ValueError, match="2 completions but 1 finish reasons"):
            pool.score_texts(["1", "2"], ["1", "2"], ["stop"], [1, 1])
        assert pool.score_texts([], [], [], []) == []


# ---------------------------------------------------------------------------------------------
# Registry: names, import paths, errors


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A reward module on sys.path (inherited by the pool's spawned workers)."""
    (tmp_path / "my_reward_plugin.py").write_text(textwrap.dedent("""
        def says_yes(completion, gold, *, strict):
            return completion.strip() == ("YES" if strict else "yes")

        def boom(completion, gold, *, strict):
            raise RuntimeError("a buggy reward")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_reward_plugin"
    sys.modules.pop("my_reward_plugin", None)


def test_reward_by_import_path_in_process(plugin):
    fn = get_reward(f"{plugin}:says_yes")
    assert fn("yes", "", strict=False) is True and fn("no", "", strict=False) is False
    assert fn("yes", "", strict=True) is False
    assert RewardConfig(fn=f"{plugin}:says_yes").problems() == []


def test_reward_by_import_path_in_the_pool(plugin):
    cfg = RewardConfig(fn=f"{plugin}:says_yes", workers=1, correct=2.0, wrong=-1.0)
    with RewardPool(cfg, max_new_tokens=10) as pool:
        assert not pool.in_process
        got = pool.score_texts(["yes", "no", "yes"], ["", "", ""], ["stop", "stop", "length"], [1, 1, 10])
    # formatted follows correct for a reward without an extractor.
    assert got == [ScoredSample(2.0, True, True, False), ScoredSample(-1.0, False, False, False),
                   ScoredSample(-1.0, False, False, True)]


def test_health_names_a_dead_scoring_process_and_the_pool_restarts(plugin):
    """The executor protocol: health raises for a dead process, naming it; the next score runs on
    fresh workers."""
    with RewardPool(RewardConfig(fn=f"{plugin}:says_yes", workers=1), max_new_tokens=10) as pool:
        assert pool.score_texts(["yes"], [""], ["stop"], [1])[0].correct  # the worker is up
        (h,) = pool.health()
        assert h["alive"] and h["pid"] in pool.pids
        os.kill(h["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        with pytest.raises(ProcessDied, match=rf"scoring process pid {h['pid']} was killed by signal SIGKILL"):
            while time.monotonic() < deadline:
                pool.health()
                time.sleep(0.05)
        assert pool.score_texts(["yes"], [""], ["stop"], [1])[0].correct
        assert h["pid"] not in pool.pids and all(x["alive"] for x in pool.health())


def test_a_reward_that_raises_scores_wrong(plugin):
    (s,) = score(RewardConfig(fn=f"{plugin}:boom", workers=1, max_error_frac=1.0), ["19"], ["19"])
    assert s.reward == 0.0 and s.correct is False


def test_reward_defined_in_this_module_by_import_path():
    fn = get_reward(f"{__name__}:arithmetic")
    assert fn is arithmetic


def test_unknown_reward_name_lists_the_known_ones():
    assert known_rewards()[:5] == ["arithmetic", "code", "dapo", "gsm8k", "math"]
    with pytest.raises(ValueError, match=r"unknown reward; known: arithmetic, code, dapo, gsm8k, math.*did you mean 'arithmetic'"):
        get_reward("arithmetc")
    with pytest.raises(ValueError) as exc:
        RewardConfig(fn="foo")
    assert str(exc.value) == ("reward.fn='foo': unknown reward; known: arithmetic, code, dapo, gsm8k, math, "
                              "or a 'module:function' path")


def test_bad_import_paths(plugin):
    (msg,) = _raw(fn=f"{plugin}:missing").problems()
    assert msg.startswith(f"reward.fn='{plugin}:missing': module '{plugin}'") and "no top-level 'missing'" in msg
    (msg,) = _raw(fn="no_such_module_xyz:fn").problems()
    assert msg == "reward.fn='no_such_module_xyz:fn': cannot find module 'no_such_module_xyz' (is it on PYTHONPATH?)"
    (msg,) = _raw(fn=":fn").problems()
    assert "package.module:function" in msg
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        get_reward(f"{plugin}:missing")
    with pytest.raises(ValueError, match="cannot import module"):
        get_reward("no_such_module_xyz:fn")


def _raw(**values) -> RewardConfig:
    """A RewardConfig holding ``values`` without running __post_init__'s check."""
    cfg = object.__new__(RewardConfig)
    for name, default in RewardConfig.__dataclass_fields__.items():
        object.__setattr__(cfg, name, values.get(name, default.default))
    return cfg


@pytest.fixture
def unregister():
    """Drops rewards a test registers, so the known names other tests expect stay the built-ins."""
    from megarl.reward.registry import _REWARDS

    before = dict(_REWARDS)
    yield
    _REWARDS.clear()
    _REWARDS.update(before)


def test_register_reward_by_name(unregister):
    @register_reward("test_always_right")
    def always(completion, gold, *, strict):
        return True

    assert get_reward("test_always_right") is always
    assert RewardConfig(fn="test_always_right").problems() == []
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_always_right")(lambda c, g, *, strict: False)
    with pytest.raises(ValueError, match="non-empty string without ':'"):
        register_reward("a:b")


# ---------------------------------------------------------------------------------------------
# Config: knobs, validation (torch-free)


@pytest.mark.parametrize("values,key", [
    ({"timeout_s": 0.0}, "reward.timeout_s=0.0 is out of range"),
    ({"overlong_buffer": -1}, "reward.overlong_buffer=-1 is out of range"),
    ({"overlong_penalty": -0.1}, "reward.overlong_penalty=-0.1 is out of range"),
    ({"correct": 0.0, "wrong": 0.0}, "reward.correct=0.0 must be greater than reward.wrong=0.0"),
])
def test_reward_config_problems(values, key):
    (msg,) = _raw(**values).problems()
    assert msg.startswith(key)


def test_overlong_buffer_must_fit_max_new_tokens():
    assert RewardConfig(overlong_buffer=64).problems(max_new_tokens=64) == []
    (msg,) = RewardConfig(overlong_buffer=65).problems(max_new_tokens=64)
    assert msg.startswith("reward.overlong_buffer=65 exceeds generator.max_new_tokens=64")
    with pytest.raises(ValueError, match="overlong_buffer=65"):
        RewardPool(RewardConfig(overlong_buffer=65), max_new_tokens=64)


def _reward_problems(overrides):
    """The loader's and the validator's reward.* problems for ``overrides`` (other sections' checks
    depend on the machine, so they are left out)."""
    from megarl.config.loader import apply_overrides, build
    from megarl.config.schema import MegaRLConfig
    from megarl.config.validate import check

    cfg, problems = build(MegaRLConfig, apply_overrides({}, overrides))
    if cfg is not None:
        problems = check(cfg)
    return cfg, [p for p in problems if p.startswith("reward")]


def test_config_loading_validates_the_reward_section():
    cfg, problems = _reward_problems(["reward.fn=gsm8k", "reward.strict=true", "reward.truncated=-1",
                                      "reward.overlong_buffer=32"])
    assert problems == []
    assert (cfg.reward.fn, cfg.reward.strict, cfg.reward.truncated, cfg.reward.overlong_buffer) == (
        "gsm8k", True, -1.0, 32)
    _, problems = _reward_problems(["reward.fn=foo"])
    assert problems == ["reward: reward.fn='foo': unknown reward; known: arithmetic, code, dapo, gsm8k, math, "
                        "or a 'module:function' path"]
    _, problems = _reward_problems(["reward.overlong_buffer=100000"])
    assert len(problems) == 1 and problems[0].startswith(
        "reward.overlong_buffer=100000 exceeds generator.max_new_tokens=256")


def test_reward_config_and_scoring_import_no_torch_or_sympy():
    code = ("import sys, json; from megarl.config.schema import MegaRLConfig; "
            "from megarl.config.validate import check; "
            "from megarl.reward import RewardPool, RewardConfig; "
            "check(MegaRLConfig(reward=RewardConfig(fn='math'))); "
            "p = RewardPool(RewardConfig(), 10); s = p.score_texts(['12 + 7 = 19'], ['19'], ['stop'], [3]); "
            "print(json.dumps([s[0].reward, [m for m in ('torch', 'sympy', 'math_verify') if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [1.0, []]


def test_reward_check_refuses_a_multi_turn_environment_and_an_empty_file(tmp_path):
    # `megarl reward check --fn calculator` raised AttributeError (a bug's traceback); an empty cases file
    # printed nothing and exited 0, as if every case had passed
    from megarl.data.sources import DataError
    from megarl.reward.check import check_cases

    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4", "reply": "4"}) + "\n")
    assert [(v["case"], v["score"], v["correct"]) for v in check_cases("arithmetic", str(cases))] == [(1, 1.0, True)]
    with pytest.raises(ValueError, match="'calculator' is a multi-turn environment"):
        list(check_cases("calculator", str(cases)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no cases"):
        list(check_cases("arithmetic", str(empty)))
