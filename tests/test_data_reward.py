"""Prompt sources and the math-verify reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.data import format_prompt, load_tasks, split_train_eval
from megarl.data.tasks import gold_answer
from megarl.reward import MathReward, score_one

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"


def test_gold_answer_parsing():
    assert gold_answer("48+24 = <<48+24=72>>72 clips\n#### 72") == "72"
    assert gold_answer("... #### 1,200") == "1200"


@pytest.mark.skipif(not GSM8K.is_file(), reason="GSM8K copy not present beside the repo")
def test_gsm8k_loads():
    tasks = load_tasks(str(GSM8K), limit=3)
    assert tasks[0].answer == "72" and tasks[0].question.startswith("Natalia")
    assert tasks[1].answer == "10"


def test_arithmetic_is_seeded_and_correct():
    a, b = load_tasks("builtin:arithmetic", limit=50, seed=3), load_tasks("builtin:arithmetic", limit=50, seed=3)
    assert a == b and len({t.question for t in a}) == 50
    for t in a:
        x, op, y = t.question.removeprefix("What is ").removesuffix("?").split()
        assert int(t.answer) == eval(f"{x}{op}{y}")


def test_split_is_disjoint():
    train, held = split_train_eval(load_tasks("builtin:arithmetic", limit=200), 20)
    assert len(held) == 20 and len(train) == 180
    assert not {t.question for t in train} & {t.question for t in held}


def test_format_prompt_plain():
    (task,) = load_tasks("builtin:arithmetic", limit=1)
    assert format_prompt(task, None) == f"Question: {task.question} Reply with only the final number.\nAnswer:"


def test_score_one():
    assert score_one("The answer is 72.", "72")
    assert score_one("$\\frac{1}{2}$", "0.5")
    assert not score_one("71", "72")
    assert not score_one("", "72")


def test_math_reward_pool():
    with MathReward(workers=2, timeout_s=5, correct=1.0, wrong=-0.5) as reward:
        assert reward.score(["72", "so 5", "no idea"], ["72", "5", "3"]) == [1.0, 1.0, -0.5]
    with pytest.raises(ValueError, match="gold"):
        MathReward().score(["1"], [])
