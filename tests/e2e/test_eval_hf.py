"""tools/eval_hf.py, the check of an exported policy outside megarl: it rebuilds the run's held-out
set exactly, and its fresh problems never repeat a training or held-out question."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_eval_hf_reports_strict_accuracy(tiny_llama_dir, tmp_path):
    import yaml

    from megarl.config import load_config, to_dict
    from megarl.controller.prompts import PromptSource, question_key

    cfg_file = tmp_path / "config.yaml"  # what a run folder holds
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [f"model.path={tiny_llama_dir}", "data.eval_size=6"])
    cfg_file.write_text(yaml.safe_dump(to_dict(cfg)))
    for extra, want_n, source in (([], 6, "run held-out"), (["--fresh", "9", "--seed", "5"], 9, "fresh")):
        out = tmp_path / f"{source}.json"
        done = subprocess.run([sys.executable, "tools/eval_hf.py", "--hf", str(tiny_llama_dir), "--config",
                               str(cfg_file), "--out", str(out), *extra], capture_output=True, text=True,
                              timeout=300, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["eval/n"] == want_n and report["source"] == source
        assert 0 <= report["eval/accuracy"] <= report["eval/format_rate"] <= 1
        assert "strict greedy accuracy" in done.stdout
    prompts = PromptSource(cfg, Path(tiny_llama_dir))
    run_questions = {question_key(t.question) for t, _ in prompts.train + prompts.held}
    held = json.loads((tmp_path / "run held-out.json").read_text())["examples"]
    assert [e["question"] for e in held] == [t.question for t, _ in prompts.held][:len(held)]
    fresh = json.loads((tmp_path / "fresh.json").read_text())["examples"]
    assert fresh and not {question_key(e["question"]) for e in fresh} & run_questions
