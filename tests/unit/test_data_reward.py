"""Prompt sources, and the rewards on the data's own gold answers (adversarial reward cases: test_rewards.py)."""

from __future__ import annotations

from pathlib import Path


from megarl.data import format_prompt, load_tasks, split_train_eval
from megarl.data.tasks import gold_answer
from megarl.reward import get_reward

# The first 50 rows of GSM8K train (MIT), vendored so these tests run in every clone (tests/data/gsm8k/)
GSM8K = Path(__file__).resolve().parents[1] / "data" / "gsm8k" / "train_head50.jsonl"


def test_gold_answer_parsing():
    assert gold_answer("48+24 = <<48+24=72>>72 clips\n#### 72") == "72"
    assert gold_answer("... #### 1,200") == "1200"


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


def test_arithmetic_reward_on_builtin_tasks():
    """The gold answer is right, strictly; the restated question is wrong unless its last operand
    happens to be the answer (e.g. 'What is 5 * 1?')."""
    arithmetic = get_reward("arithmetic")
    tasks = load_tasks("builtin:arithmetic", limit=200, seed=5)
    for t in tasks:
        assert arithmetic(t.answer, t.answer, strict=True) is True
        assert arithmetic(f"{t.question.removeprefix('What is ').removesuffix('?')} = {t.answer}", t.answer) is True
        last_operand = t.question.removesuffix("?").split()[-1]
        assert arithmetic(t.question, t.answer) is (int(last_operand) == int(t.answer))
        assert arithmetic(format_prompt(t, None), t.answer) is (int(last_operand) == int(t.answer))
    assert sum(arithmetic(t.question, t.answer) for t in tasks) < 20


def test_gsm8k_reward_on_gsm8k_solutions():
    """A GSM8K reference solution ('... #### 72') scores right against its own gold, strictly."""
    import json

    gsm8k = get_reward("gsm8k")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:50]]
    tasks = load_tasks(str(GSM8K), limit=50)
    assert all(gsm8k(row["answer"], t.answer, strict=True) for row, t in zip(rows, tasks))
    assert not any(gsm8k(row["question"], t.answer, strict=True) for row, t in zip(rows, tasks))
