"""data.eval_paths: several held-out sets in one run, each named, each kept disjoint from training and
scored in its own way; data.eval_answer; their config errors. Tokenizer only (no engines): the sets
logged under their names in a real run are checked by the LlamaRL recipe's scaled-down run
(tests/e2e/test_recipes_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sets(tmp_path: Path) -> tuple[Path, Path, Path]:
    math = [{"problem": f"Compute {i} times {i + 1}.", "solution": f"So \\boxed{{{i * (i + 1)}}}."} for i in range(12)]
    gsm = [{"question": f"Tom has {i} apples and buys {i + 2}. How many now?", "answer": f"{i}+{i + 2}\n#### {2 * i + 2}"}
           for i in range(6)]
    train = _jsonl(tmp_path / "train.jsonl", math)
    return train, _jsonl(tmp_path / "math500.jsonl", math[:3]), _jsonl(tmp_path / "gsm8k.jsonl", gsm)


def _cfg(tmp_path: Path, model: Path, *overrides: str):
    return load_config(str(REPO / "configs" / "tiny_test.yaml"),
                       [f"model.path={model}", f"logging.out_dir={tmp_path}", *overrides])


def test_each_held_out_set_is_named_disjoint_and_scored_its_own_way(tmp_path, tiny_llama_dir):
    from megarl.controller.prompts import PromptSource

    train, math500, gsm8k = _sets(tmp_path)
    cfg = _cfg(tmp_path, tiny_llama_dir, f"data.train_path={train}", f"data.eval_paths=[math500={math500}, {gsm8k}]",
               "data.eval_size=4")
    assert "data.eval_paths math500: MATH rows" in cfg.data.choice and "data.eval_paths gsm8k: GSM8K rows" in cfg.data.choice
    src = PromptSource(cfg, tiny_llama_dir)
    sets = src.eval_sets()
    # named as written, and by the file name for a bare path; each capped at data.eval_size; each its schema's style
    assert [(name, len(tasks), style) for name, tasks, _, style in sets] == [("math500", 3, "boxed"), ("gsm8k", 4, "number")]
    # the three MATH questions held out in math500 are not trained on (12 - 3); the headline is the first set
    assert len(src.train) == 9 and src.eval_set()[0] == sets[0][1] and src.eval_answer == "boxed"
    # each set's prompt carries its own schema's instruction (data.instruction auto)
    assert "\\boxed{}" in src.decode(sets[0][2][0]) and "Reply with only the final number." in src.decode(sets[1][2][0])
    # data.eval_answer=boxed scores every set by its last \boxed{} (a GSM8K set prompted for \boxed{})
    src = PromptSource(_cfg(tmp_path, tiny_llama_dir, f"data.train_path={train}", f"data.eval_paths=[{gsm8k}]",
                            "data.eval_answer=boxed"), tiny_llama_dir)
    assert [style for *_, style in src.eval_sets()] == ["boxed"]
    # the single eval_path keeps working: one unnamed set, logged as eval/*
    src = PromptSource(_cfg(tmp_path, tiny_llama_dir, f"data.train_path={train}", f"data.eval_path={math500}"),
                       tiny_llama_dir)
    assert [(name, len(tasks)) for name, tasks, _, _ in src.eval_sets()] == [("", 3)]


@pytest.mark.parametrize("overrides, want", [
    (["data.eval_paths=[{m}, {m}]"], "data.eval_paths: two held-out sets are named 'math500' (metrics "
                                     "eval/math500/...); name them, e.g. 'math500={m}'"),
    (["data.eval_paths=[{m}]", "data.eval_path={m}"], "data.eval_paths and data.eval_path="),
    (["data.eval_paths=[{d}/*.jsonl]"], "data.eval_paths: '{d}/*.jsonl' gives no usable name or path; write "
                                        "'NAME=PATH'"),
    (["data.eval_paths=[x={m}.missing]"], "data.eval_paths x='{m}.missing': no such file"),
])
def test_eval_paths_errors_name_the_knob(tmp_path, tiny_llama_dir, overrides, want):
    train, math500, _ = _sets(tmp_path)
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, tiny_llama_dir, f"data.train_path={train}", *[o.format(m=math500, d=tmp_path) for o in overrides])
    assert any(p.startswith(want.format(m=math500, d=tmp_path)) and "\n" not in p for p in e.value.problems), e.value.problems
