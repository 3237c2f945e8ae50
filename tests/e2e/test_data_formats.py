"""Data as the seeds' datasets ship: MATH jsonl, verl / DAPO parquet with chat prompts, GSM8K parquet
shards; the row schema recognised without configuration, the reward it names, bad rows by file:row.

Fast (no model): one end-to-end step on such data is in tests/e2e/test_controller.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config
from megarl.data import format_prompt, load_tasks
from megarl.data.sources import DataError, data_files, iter_rows
from megarl.data.tasks import read_tasks

REPO = Path(__file__).resolve().parents[2]
SYSTEM = "You are a careful mathematician. Think, then answer."
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{q}\n\nRemember to put "
               "your answer on its own line after \"Answer:\".")

MATH_ROWS = [
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{3}$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We have $\\frac{1}{2}+\\frac{1}{3} = \\frac{3}{6}+\\frac{2}{6} = \\boxed{\\frac{5}{6}}$."},
    {"problem": "Solve $x^2 = 9$ for $x > 0$.", "level": "Level 2", "type": "Algebra",
     # the gold is the LAST boxed answer, braces balanced
     "solution": "Try $\\boxed{-3}$: negative. So $x = \\boxed{3}$."},
    {"problem": "Simplify $\\sqrt{8}$.", "level": "Level 3", "type": "Algebra",
     "solution": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$"},
]
MATH_GOLD = ["\\frac{5}{6}", "3", "2\\sqrt{2}"]


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def verl_rows(n: int, start: int = 0) -> list[dict]:
    """DAPO-Math-17k's shape: data_source, prompt (chat messages, here with a system turn), ability,
    reward_model {style, ground_truth}, extra_info."""
    return [{"data_source": "math_dapo",
             "prompt": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": DAPO_PROMPT.format(q=f"What is {i} squared plus {i}?")}],
             "ability": "MATH", "reward_model": {"style": "rule", "ground_truth": str(i * i + i)},
             "extra_info": {"index": f"idx-{i}"}} for i in range(start, start + n)]


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2:,}"}
            for i in range(start, start + n)]


# ---------------------------------------------------------------------------------------------
# Each format loads with every row used


def test_math_jsonl_loads_every_row_with_the_last_boxed_answer(tmp_path):
    path = _jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    schema, tasks = read_tasks(str(path))
    assert (schema.name, schema.reward, schema.prompt_key, schema.answer_key) == ("math", "math", "problem", "solution")
    assert schema.eval_answer == "boxed"  # held-out MATH replies are judged on their last \boxed{}
    assert [t.answer for t in tasks] == MATH_GOLD
    assert [t.question for t in tasks] == [r["problem"] for r in MATH_ROWS]
    assert [t.where for t in tasks] == [f"{path}:{i}" for i in (1, 2, 3)]
    # a text prompt gets the schema's instruction (boxed) unless data.instruction says otherwise
    assert format_prompt(tasks[1], None, instruction=schema.instruction) == (
        f"Question: {MATH_ROWS[1]['problem']} Please reason step by step, and put your final answer within "
        f"\\boxed{{}}.\nAnswer:")


def test_verl_parquet_keeps_the_chat_prompt_as_it_is(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    path = _parquet(tmp_path / "dapo.parquet", verl_rows(7))
    schema, tasks = read_tasks(str(path))
    assert (schema.name, schema.reward, schema.answer_key) == ("verl", "dapo", "reward_model.ground_truth")
    assert [t.answer for t in tasks] == [str(i * i + i) for i in range(7)]
    assert [t.where for t in tasks] == [f"{path}:row {i}" for i in range(7)]
    assert tasks[3].messages == (("system", SYSTEM), ("user", DAPO_PROMPT.format(q="What is 3 squared plus 3?")))
    assert tasks[3].question == DAPO_PROMPT.format(q="What is 3 squared plus 3?")  # the user turn
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    text = format_prompt(tasks[3], tok, instruction="Reply with only the final number.", system_prompt="IGNORED")
    # the template's rendering of exactly these two turns: system turn once, no instruction added
    assert text == tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": tasks[3].question}],
                                           tokenize=False, add_generation_prompt=True)
    assert text.count(SYSTEM) == 1 and "Reply with only" not in text and "IGNORED" not in text


def test_gsm8k_over_two_parquet_shards_folder_and_glob(tmp_path):
    shards = tmp_path / "gsm8k"
    shards.mkdir()
    a = _parquet(shards / "train-00000-of-00002.parquet", gsm8k_rows(5))
    b = _parquet(shards / "train-00001-of-00002.parquet", gsm8k_rows(4, start=5))
    for source in (str(shards), str(shards / "train-*.parquet")):
        schema, tasks = read_tasks(source)
        assert schema.name == "gsm8k" and schema.reward == "gsm8k"
        assert [t.answer for t in tasks] == [str(2 * i + 2) for i in range(9)]  # '1,000'-style separators dropped
        assert [t.where for t in tasks] == [f"{a}:row {i}" for i in range(5)] + [f"{b}:row {i}" for i in range(4)]
    assert load_tasks(str(shards), limit=6)[-1].where == f"{b}:row 0"


def test_parquet_is_read_in_batches_of_only_the_needed_columns(tmp_path, monkeypatch):
    """A 500k-row file is never a list of dicts: record batches of the schema's columns."""
    import pyarrow.parquet as pq

    from megarl.data import sources

    path = _parquet(tmp_path / "dapo.parquet", verl_rows(10))
    seen = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("batch_size"), kwargs.get("columns")))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 3)
    rows = iter_rows(str(path), columns=["prompt", "reward_model"])
    first = next(rows)
    assert first[0] == f"{path}:row 0" and set(first[1]) == {"prompt", "reward_model"}
    assert seen == [(3, ["prompt", "reward_model"])]
    assert len(load_tasks(str(path))) == 10 and seen[-1] == (3, ["prompt", "reward_model"])


def test_repeated_prompts_are_kept_once_while_streaming(tmp_path):
    """A file that repeats every prompt (as some published parquets do) keeps its distinct prompts;
    the count and the first repeat are reported. Case and whitespace do not make a prompt new."""
    rows = verl_rows(5) * 3
    rows[12] = {**rows[12], "prompt": [{"role": "system", "content": SYSTEM.upper()},
                                       {"role": "user", "content": "  " + rows[12]["prompt"][1]["content"]}]}
    path = _parquet(tmp_path / "dapo.parquet", rows)
    counts: dict = {}
    _, tasks = read_tasks(str(path), dedupe=True, counts=counts)
    assert [t.answer for t in tasks] == [str(i * i + i) for i in range(5)]
    assert counts == {"duplicates": 10, "first_duplicate": f"{path}:row 5"}
    assert len(load_tasks(str(path))) == 15  # without dedupe every row


def test_json_array_and_plain_schema(tmp_path):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps([{"prompt": "What is 2 + 2?", "answer": 4, "id": 1},
                                {"prompt": "What is 3 + 3?", "answer": "#### 6"}]))
    schema, tasks = read_tasks(str(path))
    assert (schema.name, schema.reward) == ("plain", "arithmetic")
    assert [(t.question, t.answer, t.where) for t in tasks] == [
        ("What is 2 + 2?", "4", f"{path}:row 0"), ("What is 3 + 3?", "6", f"{path}:row 1")]


def test_dotted_keys_read_any_layout(tmp_path):
    rows = [{"meta": {"q": "What is 5 * 5?"}, "labels": {"final": "25"}, "junk": [1, 2]},
            {"meta": {"q": "What is 6 * 5?"}, "labels": {"final": "30"}, "junk": None}]
    path = _parquet(tmp_path / "odd.parquet", rows)
    with pytest.raises(DataError, match=rf"^{path}:row 0: no known row schema"):
        read_tasks(str(path))
    schema, tasks = read_tasks(str(path), prompt_key="meta.q", answer_key="labels.final")
    assert schema.name == "custom" and [(t.question, t.answer) for t in tasks] == [
        ("What is 5 * 5?", "25"), ("What is 6 * 5?", "30")]
    # a key replaces one of a known schema's: GSM8K rows whose prompt is in another column
    path = _jsonl(tmp_path / "g.jsonl", [{"q2": "Q?", "question": "", "answer": "#### 7"}])
    assert [t.question for t in load_tasks(str(path), prompt_key="q2")] == ["Q?"]


# ---------------------------------------------------------------------------------------------
# Bad rows: one line naming file:row


@pytest.mark.parametrize("bad,why", [
    ({"prompt": None}, "no 'prompt' key"),
    ({"prompt": [{"role": "system", "content": SYSTEM}]}, "neither text nor a list of chat messages"),
    ({"prompt": [{"role": "robot", "content": "hi"}]}, "neither text nor a list of chat messages"),
    ({"reward_model": {"style": "rule", "ground_truth": "  "}}, "empty or non-text 'reward_model.ground_truth'"),
    ({"reward_model": {"style": "rule", "ground_truth": None}}, "no 'reward_model.ground_truth' key"),
], ids=["no-prompt", "no-user-turn", "bad-role", "empty-gold", "no-gold"])
def test_a_bad_parquet_row_names_file_and_row(tmp_path, bad, why):
    """In parquet a missing value is a null: the same one-line error as a missing key."""
    shards = tmp_path / "d"
    shards.mkdir()
    _parquet(shards / "train-00000-of-00002.parquet", verl_rows(4))
    rows = verl_rows(4, start=4)
    rows[2] = {**rows[2], **bad}
    second = _parquet(shards / "train-00001-of-00002.parquet", rows)
    with pytest.raises(DataError) as err:
        load_tasks(str(shards))
    msg = str(err.value)
    assert msg.startswith(f"{second}:row 2: ") and why in msg and "\n" not in msg, msg


def test_math_row_without_boxed_answer_and_split_mixing(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", MATH_ROWS + [{"problem": "P", "solution": "The answer is 4."}])
    with pytest.raises(DataError, match=rf"^{path}:4: 'solution' has no closed, non-empty \\boxed"):
        load_tasks(str(path))
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _parquet(mixed / "train-00000-of-00001.parquet", gsm8k_rows(2))
    _parquet(mixed / "test-00000-of-00001.parquet", gsm8k_rows(2))
    with pytest.raises(DataError, match=r"several splits \(test, train\); name one with a glob"):
        data_files(str(mixed))
    with pytest.raises(DataError, match=r"not a readable parquet file"):
        (tmp_path / "x.parquet").write_text("not parquet")
        load_tasks(str(tmp_path / "x.parquet"))


# ---------------------------------------------------------------------------------------------
# The config: the reward follows the data, an explicit one wins, the choice is written down


def _cfg(tmp_path, train, *overrides):
    return load_config(REPO / "configs" / "tiny_test.yaml", [f"data.train_path={train}", *overrides])


def test_the_reward_follows_the_data_unless_set(tmp_path):
    math_path = _jsonl(tmp_path / "math.jsonl", MATH_ROWS)
    dapo = _parquet(tmp_path / "dapo.parquet", verl_rows(3))
    shards = tmp_path / "gsm8k"
    shards.mkdir()
    _parquet(shards / "train-00000-of-00002.parquet", gsm8k_rows(3))
    _parquet(shards / "train-00001-of-00002.parquet", gsm8k_rows(3, start=3))
    for train, reward, schema in ((math_path, "math", "MATH rows"), (dapo, "dapo", "verl rows"),
                                  (shards, "gsm8k", "GSM8K rows"), ("builtin:arithmetic", "arithmetic", "builtin")):
        cfg = _cfg(tmp_path, train)
        assert cfg.reward.fn == reward, cfg.data.choice
        assert schema in cfg.data.choice and f"reward.fn={reward} (auto" in cfg.data.choice
    cfg = _cfg(tmp_path, dapo, "reward.fn=math")
    assert cfg.reward.fn == "math" and "reward.fn=math (set in the config)" in cfg.data.choice
    assert "'prompt'" in cfg.data.choice and "'reward_model.ground_truth'" in cfg.data.choice
    assert f"recognised from {dapo}:row 0" in cfg.data.choice


def test_the_config_refuses_bad_data_naming_key_file_and_row(tmp_path):
    rows = verl_rows(5)
    rows[3]["reward_model"] = {"style": "rule", "ground_truth": ""}
    bad = _parquet(tmp_path / "dapo.parquet", rows)
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, bad)
    (problem,) = err.value.problems
    assert problem.startswith(f"data.train_path: {bad}:row 3: empty or non-text 'reward_model.ground_truth'")
    with pytest.raises(ConfigError, match=r"data.eval_path='[^']*nope': no such file or folder"):
        _cfg(tmp_path, "builtin:arithmetic", f"data.eval_path={tmp_path / 'nope'}")


def test_only_the_controller_scans_every_row(tmp_path, monkeypatch):
    """A launched job's trainer and generator tasks validate the config too, but only the controller
    reads the data: they check its schema (the first rows), not every row again (megarl/cluster/rank.py)."""
    from megarl.config import load_config

    rows = verl_rows(5)
    rows[3]["reward_model"] = {"style": "rule", "ground_truth": ""}  # a bad row past the first
    bad = _parquet(tmp_path / "dapo.parquet", rows)
    overrides = [f"data.train_path={bad}"]
    assert load_config(REPO / "configs" / "tiny_test.yaml", overrides, scan_data=False).reward.fn == "dapo"
    with pytest.raises(ConfigError, match="row 3"):
        load_config(REPO / "configs" / "tiny_test.yaml", overrides)


def test_prompt_knobs_reach_the_prompts(tmp_path, tiny_llama_dir, caplog):
    """data.instruction auto = the schema's; data.system_prompt adds a system turn to text prompts;
    the run's first lines name the schema, its keys and the reward."""
    import logging

    from megarl.controller.prompts import PromptSource

    rows = MATH_ROWS * 3 + [{"problem": f"What is {i} + {i}?", "solution": f"\\boxed{{{2 * i}}}"} for i in range(8)]
    path = _jsonl(tmp_path / "math.jsonl", rows[:3] + rows[9:])
    with caplog.at_level(logging.INFO, logger="megarl"):
        src = PromptSource(_cfg(tmp_path, path, "data.eval_size=2"), tiny_llama_dir)
    assert len(src.train) + len(src.held) == 11 and src.eval_answer == "boxed"
    text = src.decode(src.train[0][1])
    assert "put your final answer within \\boxed{}" in text and "Reply with only" not in text
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data: ")]
    assert "MATH rows (prompt 'problem', gold answer its last \\boxed{} of 'solution')" in line and \
        "reward.fn=math (auto" in line
    src = PromptSource(_cfg(tmp_path, path, "data.eval_size=2", "data.instruction=", "data.system_prompt=Be brief."),
                       tiny_llama_dir)
    texts = [src.decode(ids) for _, ids in src.train]
    assert all("Be brief." in t and "boxed{}" not in t for t in texts)
    assert src.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": src.train[0][0].question}],
        tokenize=False, add_generation_prompt=True) == src.tokenizer.decode(src.train[0][1])


# ---------------------------------------------------------------------------------------------
# End to end: one step on DAPO-style chat prompts from two parquet shards (the one slow test here)


def test_one_train_step_on_verl_parquet_shards(tmp_path, tiny_llama_dir):
    """`megarl train` on a glob of two verl/DAPO parquet shards (chat prompts with a system turn):
    every row is used (train + held-out), the run's first lines say which schema and reward were
    picked from which keys, the step trains on the dapo reward."""
    shards = tmp_path / "dapo"
    shards.mkdir()
    _parquet(shards / "train-00000-of-00002.parquet", verl_rows(7))
    _parquet(shards / "train-00001-of-00002.parquet", verl_rows(5, start=7))
    log, choice = _train_one_step(tmp_path, tiny_llama_dir, shards / "train-*.parquet", eval_every=1)
    assert ("verl rows (prompt 'prompt', gold answer as it is of 'reward_model.ground_truth')" in choice
            and f"recognised from {shards / 'train-00000-of-00002.parquet'}:row 0" in choice
            and "reward.fn=dapo (auto: the verl schema's reward)" in choice), choice
    assert "prompts: 8 train, 4 held-out" in log, log[-4000:]  # all 12 rows of both shards
    base, row = [json.loads(ln) for ln in (tmp_path / "runs" / "tiny-test" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["gen/samples"] == 8 and row["train/tokens"] > 0 and row["train/grad_norm"] > 0
    assert base["step"] == 0 and base["eval/n"] == 4 == row["eval/n"]  # the 4 held-out chat prompts, scored
    config = (tmp_path / "runs" / "tiny-test" / "config.yaml").read_text()
    assert "fn: dapo" in config


def _math_rows(n: int) -> list[dict]:
    return [{"problem": f"What is ${i} + {i + 1}$?", "level": "Level 1", "type": "Prealgebra",
             "solution": f"${i} + {i + 1} = \\boxed{{{2 * i + 1}}}$."} for i in range(n)]


@pytest.mark.parametrize("fmt", ["math_jsonl", "gsm8k_shards"])
def test_one_train_step_on_math_jsonl_and_gsm8k_shards(fmt, tmp_path, tiny_llama_dir):
    """The other two formats the seeds ship, each through `megarl train` for one step: a MATH-format
    jsonl (gold = the last \\boxed{}, the math reward) and GSM8K rows over two parquet shards (the
    gsm8k reward). Every row is used: 8 train + 4 held-out of 12."""

    if fmt == "math_jsonl":
        source = _jsonl(tmp_path / "math.jsonl", _math_rows(12))
        schema, reward, first = "MATH rows", "reward.fn=math (auto: the MATH schema's reward)", f"{source}:1"
    else:
        shards = tmp_path / "gsm8k"
        shards.mkdir()
        _parquet(shards / "train-00000-of-00002.parquet", gsm8k_rows(7))
        _parquet(shards / "train-00001-of-00002.parquet", gsm8k_rows(5, start=7))
        source = shards
        schema, reward = "GSM8K rows", "reward.fn=gsm8k (auto: the GSM8K schema's reward)"
        first = f"{shards / 'train-00000-of-00002.parquet'}:row 0"
    log, choice = _train_one_step(tmp_path, tiny_llama_dir, source, eval_every=0)
    assert schema in choice and f"recognised from {first}" in choice and reward in choice, choice
    assert "prompts: 8 train, 4 held-out" in log, log[-4000:]  # all 12 rows
    (row,) = [json.loads(ln) for ln in (tmp_path / "runs" / "tiny-test" / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["gen/samples"] == 8 and row["train/tokens"] > 0 and row["train/grad_norm"] > 0


def _train_one_step(tmp_path: Path, model_dir: Path, source, *, eval_every: int) -> tuple[str, str]:
    """`megarl train` for one step on the tiny model with ``data.train_path=source`` (4 held out);
    returns its log and the run's 'data:' line (which schema and reward the data picked)."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"), f"model.path={model_dir}",
         f"logging.out_dir={tmp_path / 'runs'}", f"data.train_path={source}", "data.eval_size=4",
         "controller.steps=1", f"controller.eval_every={eval_every}", "algorithm.entropy_coef=0.01",
         "reward.workers=1"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    (choice,) = [ln for ln in log.splitlines() if "data: data.train_path:" in ln]
    return log, choice
