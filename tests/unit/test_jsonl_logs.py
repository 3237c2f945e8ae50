"""The run's JSONL logs across a crash (megarl/utils/metrics.py): appends are fsync'd rows, and a
resume's rewind keeps the rows up to the checkpoint's step and drops a line a crash cut, instead of
raising JSONDecodeError on every rerun (found by an audit: one torn line made a run unresumable)."""

from __future__ import annotations

import json
import logging

from megarl.utils.metrics import append_jsonl, rewind_jsonl


def test_a_rewind_keeps_the_rows_up_to_the_step_and_drops_a_torn_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    with path.open("a") as fh:
        for step in (1, 2, 3):
            append_jsonl(fh, {"step": step, "loss": 0.5})
    with path.open("a") as fh:  # a node crash mid-append: half a row, then a page of zeros
        fh.write('{"step": 4, "lo')
        fh.write("\n" + "\0" * 64 + "\n")
    with caplog.at_level(logging.WARNING, logger="megarl.utils.metrics"):
        rewind_jsonl(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert "2 line(s) that do not parse" in caplog.text and str(path) in caplog.text
    assert not list(tmp_path.glob(".*.tmp"))  # written through a temp file, renamed into place
    rewind_jsonl(tmp_path / "absent.jsonl", 2)  # a log the run never wrote: nothing to do
    assert not (tmp_path / "absent.jsonl").exists()


def test_rows_without_a_step_are_kept_and_a_rewind_to_0_empties_the_log(tmp_path):
    path = tmp_path / "dynamic_sampling.jsonl"
    path.write_text('{"step": 1, "dropped": 2}\n{"note": "no step"}\n[1, 2]\n')
    rewind_jsonl(path, 0)
    assert path.read_text() == '{"note": "no step"}\n'  # step 0 by default; a non-object row is torn
