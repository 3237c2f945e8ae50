"""Bad data: each case a one-line error naming file:line, before any executor starts; prompts too
long for the model are skipped and counted; a token id outside the vocabulary is refused at submit,
before it reaches a replica."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.data.tasks import DataError, load_tasks

REPO = Path(__file__).resolve().parents[2]
GOOD = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(12)]


def _jsonl(path: Path, rows: list, bad_line: str | None = None, at: int = 3) -> Path:
    lines = [json.dumps(r) for r in rows]
    if bad_line is not None:
        lines.insert(at - 1, bad_line)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("bad,why", [
    ('{"question": "What is 2 + 2?", "answer": "4"', "not valid JSON"),
    ('["What is 2 + 2?", "4"]', "a JSON list, not an object"),
    ('{"prompt": "What is 2 + 2?", "answer": "4"}', "no 'question' key"),
    ('{"question": "What is 2 + 2?"}', "no 'answer' key"),
    ('{"question": "   ", "answer": "4"}', "empty 'question'"),
    ('{"question": "What is 2 + 2?", "answer": ""}', "empty or non-text 'answer'"),
    ('{"question": "What is 2 + 2?", "answer": "2 + 2 ####  "}', "nothing after its last '####'"),
], ids=["malformed", "not-object", "no-question", "no-answer", "empty-prompt", "empty-answer", "empty-gold"])
def test_a_bad_row_is_one_line_naming_file_and_line(tmp_path, bad, why):
    path = _jsonl(tmp_path / "train.jsonl", GOOD, bad, at=3)
    with pytest.raises(DataError) as err:
        load_tasks(str(path))
    msg = str(err.value)
    assert msg.startswith(f"{path}:3: ") and why in msg and "\n" not in msg, msg


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "\xff", "answer": "2"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8"):
        load_tasks(str(path))


def test_good_rows_keep_where_they_came_from(tmp_path):
    path = _jsonl(tmp_path / "train.jsonl", GOOD[:2] + [{"question": "Q", "answer": 7}])
    tasks = load_tasks(str(path))
    assert [(t.answer, t.where) for t in tasks] == [("1", f"{path}:1"), ("2", f"{path}:2"), ("7", f"{path}:3")]


def test_the_config_check_refuses_bad_data_before_anything_starts(tmp_path, tiny_llama_dir):
    """`megarl train` stops in validation (exit 2, one problem line naming the key and file:line):
    no run folder, no trainer, no engine."""
    bad = _jsonl(tmp_path / "train.jsonl", GOOD, '{"question": "What is 2 + 2?", "answer": "4"', at=5)
    out = subprocess.run([sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
                          f"model.path={tiny_llama_dir}", f"data.train_path={bad}", f"logging.out_dir={tmp_path / 'runs'}"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if "data.train_path" in x]
    assert f"data.train_path: {bad}:5: not valid JSON" in line, out.stderr
    assert not (tmp_path / "runs").exists()


def test_too_long_prompts_are_skipped_and_counted(tmp_path, tiny_llama_dir, caplog):
    from megarl.config import load_config
    from megarl.controller.prompts import PromptSource

    long_q = {"question": "What is " + " + ".join(["1"] * 80) + "?", "answer": "80"}
    path = _jsonl(tmp_path / "train.jsonl", GOOD[:6] + [long_q] + GOOD[6:])
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_dir}", f"data.train_path={path}", "data.eval_size=2", "data.max_prompt_tokens=256",
        "generator.max_model_len=96", "generator.max_new_tokens=32"])
    with caplog.at_level(logging.WARNING):
        src = PromptSource(cfg, tiny_llama_dir)
    assert src.max_prompt_tokens == 64 and src.skipped["train"] + src.skipped["held-out"] == 1
    assert len(src.train) + len(src.held) == len(GOOD)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{path}:7" in warning and "generator.max_model_len=96 - generator.max_new_tokens=32" in warning


def test_a_token_outside_the_vocabulary_is_refused_at_submit(tiny_llama_dir):
    """Checked before anything is queued on a replica (an engine given such an id fails inside its
    process); the executor needs no started replica to refuse it."""
    from megarl.config import load_config
    from megarl.generator.executor import GeneratorExecutor

    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [f"model.path={tiny_llama_dir}"])
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    gen = GeneratorExecutor(cfg.generator, tiny_llama_dir)
    for bad in (vocab, vocab + 7, -1):
        with pytest.raises(ValueError, match=rf"prompt 1 has token id\(s\) \[{bad}\] outside the model's "
                                             rf"vocabulary \[0, {vocab}\)"):
            gen.submit([[1, 2, 3], [4, bad, 5]], n_samples=1)
    assert gen._tracks == {} and gen._replicas == []  # nothing was queued
