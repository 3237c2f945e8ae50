"""The strict held-out scorer (independent of the training reward), the reward-hacking warning,
content-disjoint held-out sets, and advantages grouped by group id."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest

from megarl.controller.evaluation import hacking_warning, last_number, score_replies, strict_correct


@pytest.mark.parametrize("reply, gold, finish, want", [
    ("19", "19", "stop", (True, True)),
    ("12 + 7 = 19", "19", "stop", (True, True)),             # the answer after a restatement
    ("The answer is 1,234.", "1234", "stop", (True, True)),  # thousands separator, trailing period
    ("\u22125", "-5", "stop", (True, True)),                 # unicode minus
    ("19.0", "19", "stop", (True, True)),
    ("To find 12 + 7, we need to perform the arithmetic", "19", "stop", (False, True)),  # restating: ends in 7
    ("3 * 9", "27", "stop", (False, True)),                  # an expression is never evaluated
    ("What is 12 + 7? Reply with only the final number.", "19", "stop", (False, True)),  # echo
    ("17, 18, 19, 20", "19", "stop", (False, True)),         # candidates: the last one counts
    ("19", "19", "length", (False, False)),                  # truncated: wrong whatever it says
    ("", "19", "stop", (False, False)),
    ("nineteen", "19", "stop", (False, False)),
    ("12-7 = 5", "5", "stop", (True, True)),                 # subtraction, not a negative seven
])
def test_strict_scorer(reply, gold, finish, want):
    assert strict_correct(reply, gold, finish) == want


@pytest.mark.parametrize("reply, gold, finish, want", [
    ("So $\\boxed{\\frac{5}{6}}$.", "\\frac{5}{6}", "stop", (True, True)),
    ("\\boxed{0.5}", "\\dfrac{1}{2}", "stop", (True, True)),        # the same number
    ("\\boxed{6}", "\\frac{5}{6}", "stop", (False, True)),          # the last-number scorer would say 6 == 6
    ("\\boxed{2\\sqrt{2}}", "2\\sqrt{2}", "stop", (True, True)),
    ("\\boxed{2}", "2\\sqrt{2}", "stop", (False, True)),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", "stop", (True, True)),
    ("Try $\\boxed{-3}$: no. So $x = \\boxed{3}$", "3", "stop", (True, True)),  # the last box counts
    ("\\boxed{3} no wait \\boxed{4}", "3", "stop", (False, True)),
    ("The answer is 3", "3", "stop", (False, False)),                # no box: unformatted, wrong
    ("Solve $x^2 = 9$ for $x > 0$.", "3", "stop", (False, False)),   # restating the question
    # A numeric gold needs a number: equivalence (sympy, math-verify, LlamaRL's score) would take 12+7 = 19,
    # and a policy learns to box the question's own arithmetic. Planted: dropping the _literal guard
    # in strict_boxed_correct makes these two rows correct.
    ("\\boxed{12+7}", "19", "stop", (False, True)),
    ("\\boxed{2 \\cdot 3}", "6", "stop", (False, True)),
    ("\\boxed{3}", "3", "length", (False, False)),                  # truncated
    ("\\boxed{3", "3", "stop", (False, False)),                     # unclosed
    ("\\boxed{}", "3", "stop", (False, False)),
])
def test_strict_scorer_on_boxed_data(reply, gold, finish, want):
    """MATH-style held-out data: the last \\boxed{} of a finished reply against the gold."""
    assert strict_correct(reply, gold, finish, style="boxed") == want


@pytest.mark.parametrize("reply, gold, question, want", [
    # equivalent forms the exact-text scorer missed, now equal by math-verify (as the math reward and
    # LlamaRL arXiv 2505.24034 sec. 8 score them). Planted: returning exact_a == exact_g / text equality
    # instead of _equivalent fails these rows.
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", "What is $\\sqrt{2}\\cdot 3$?", True),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", "Find $\\sin 45^\\circ$.", True),
    ("\\boxed{\\$18}", "18", "How many dollars?", True),                      # currency aside
    ("\\boxed{18 \\text{ dollars}}", "18", "How many dollars?", True),        # a unit aside
    ("\\boxed{x = 3}", "3", "Solve $2x = 6$.", True),
    ("\\boxed{\\frac{12}{24}}", "0.5", "Halve 1.", True),                       # a fraction is a number
    ("\\boxed{2x+1}", "2x + 1", "Simplify $(x+1)^2 - x^2$.", True),
    # echo: the question's own expression, equivalent to the gold but not an answer. Planted: dropping
    # the echo guard makes this row correct.
    ("\\boxed{(x+1)^2 - x^2}", "2x+1", "Simplify $(x+1)^2 - x^2$.", False),
    ("\\boxed{\\sqrt{18}}", "3\\sqrt{2}", "Simplify $\\sqrt{18}$.", False),
    # the gold's own text in the question is still the answer
    ("\\boxed{\\pi}", "\\pi", "Is the area of a unit circle $\\pi$ or $2\\pi$?", True),
    ("\\boxed{x^2}", "2x", "Differentiate $x^2$.", False),                     # echo, and not equal anyway
    ("\\boxed{12+7}", "19", "", False),                                          # no question: the number guard
])
def test_boxed_scoring_is_equivalence_with_guards(reply, gold, question, want):
    assert strict_correct(reply, gold, "stop", style="boxed", question=question) == (want, True)


def test_last_number_is_exact():
    assert last_number("a 0.1 b 0.2") == Fraction(1, 5)
    assert last_number("x = -3") == -3
    assert last_number("no digits") is None


def test_a_degenerate_digit_run_scores_wrong_instead_of_stopping_the_evaluation():
    # past Python's 4300-digit conversion limit: Fraction() would raise ValueError
    long = "1" * 5000
    assert last_number(long) is None and last_number(long + " so 19") == 19
    assert strict_correct(long, "19", "stop") == (False, False)
    assert strict_correct(long + " so 19", "19", "stop") == (True, True)
    assert strict_correct(f"\\boxed{{{long}}}", "19", "stop", style="boxed") == (False, True)
    assert strict_correct(f"\\boxed{{\\frac{{{long}}}{{2}}}}", "\\frac{1}{2}", "stop", style="boxed") == (False, True)


def test_score_replies_summary():
    result, correct = score_replies(["19", "7", "19", "..."], ["19", "19", "19", "1"],
                                    ["stop", "stop", "length", "stop"], [2, 2, 24, 3])
    assert correct == [True, False, False, False]
    assert (result.accuracy, result.format_rate, result.truncated_frac, result.n) == (0.25, 0.5, 0.25, 4)
    assert result.mean_length == pytest.approx(31 / 4)
    assert set(result.metrics()) >= {"eval/accuracy", "eval/format_rate", "eval/truncated_frac"}


def test_hacking_warning_fires_only_beyond_eval_noise():
    # the quickstart's hack: reward 0.13 -> 0.95 while accuracy 0.10 -> 0.0 on 200 prompts
    assert "reward hacking" in hacking_warning(0.13, 0.95, 0.10, 0.0, 200)
    # a drop within two standard errors of the difference (64 prompts at p ~ 0.3: ~0.16) is noise
    assert hacking_warning(0.2, 0.6, 0.31, 0.25, 64) is None
    # accuracy rising with the reward: learning, no warning
    assert hacking_warning(0.2, 0.6, 0.1, 0.4, 64) is None
    # reward flat: no warning even if accuracy falls
    assert hacking_warning(0.5, 0.5, 0.5, 0.1, 64) is None


def test_run_folder_warns_when_reward_rises_and_accuracy_falls(tmp_path, caplog):
    from megarl.config.schema import MegaRLConfig
    from megarl.controller.run import RunFolder

    cfg = MegaRLConfig()
    cfg.logging.out_dir, cfg.logging.tensorboard = str(tmp_path), False
    with RunFolder(cfg, n_eval=200) as run, caplog.at_level("WARNING", logger="megarl"):
        run.log_eval(0, 4, {"eval/accuracy": 0.10, "eval/format_rate": 1.0, "eval/truncated_frac": 0.0})
        for step, r in ((1, 0.1), (2, 0.2)):
            run.log(step, 4, {"reward/mean": r})
        run.log(2, 4, {"eval/accuracy": 0.10})
        assert not caplog.records
        for step, r in ((3, 0.9), (4, 0.95)):
            run.log(step, 4, {"reward/mean": r})
        run.log(4, 4, {"eval/accuracy": 0.0})
    assert any("reward hacking" in rec.getMessage() for rec in caplog.records)


def test_held_out_set_is_disjoint_by_content():
    from megarl.config import ConfigError
    from megarl.controller.prompts import check_disjoint
    from megarl.data.tasks import Task, arithmetic_tasks, split_train_eval

    train, held = split_train_eval(arithmetic_tasks(2000, seed=3), 100, seed=3)
    check_disjoint(train, held)  # the built-in split
    with pytest.raises(ConfigError, match="also appear in the training data"):
        # the same question, other case and spacing
        check_disjoint(train, [Task(train[0].question.upper().replace(" ", "  "), train[0].answer)])


def test_advantages_follow_group_ids_not_order():
    from megarl.config.schema import MegaRLConfig
    from megarl.controller.loop import group_advantages

    cfg = MegaRLConfig()
    # two groups of two, interleaved as an async collector may return them
    samples = [SimpleNamespace(group_id=g) for g in (7, 3, 7, 3)]
    adv = group_advantages(cfg, samples, [1.0, 0.0, 0.0, 0.0])
    # group 7 = rewards (1, 0): +-1/sqrt(2) after GRPO std normalisation (unbiased std = 1/sqrt(2));
    # group 3 = (0, 0): no signal
    # rel 1e-5: GRPO adds eps = 1e-6 to the std (0.707), shifting the value by ~1.4e-6 relative
    assert adv[0] == pytest.approx(2 ** -0.5, rel=1e-5) and adv[2] == pytest.approx(-(2 ** -0.5), rel=1e-5)
    assert adv[1] == 0.0 and adv[3] == 0.0
