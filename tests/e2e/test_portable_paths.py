"""Committed files name no folder of the machine that wrote them (benchmark JSONs go through
megarl/utils/paths.py portable_path), and portable_path itself against hand cases."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from megarl.utils.paths import DATA_DIR_ENV, data_dir, portable_args, portable_path

REPO = Path(__file__).resolve().parents[2]


def test_portable_path_drops_this_machines_folders():
    assert portable_path(REPO / "configs" / "tiny_test.yaml") == "configs/tiny_test.yaml"
    assert portable_path(data_dir() / "models" / "m") == f"${DATA_DIR_ENV}/models/m"
    assert portable_path(Path(tempfile.gettempdir()) / "run" / "x") == "<tmp>/run/x"
    assert portable_path("/elsewhere/deep/model") == "model"

    args = argparse.Namespace(out=str(Path(tempfile.gettempdir()) / "o"), steps=3, name="n")
    assert portable_args(args) == {"out": "<tmp>/o", "steps": 3, "name": "n"}


def test_no_tracked_file_names_this_checkout_home_or_temp_runs():
    # what a benchmark run here would have written: the checkout's absolute path, the data dir (under
    # home by default), pytest's and the soak's temp folders
    needles = [str(REPO) + "/", str(data_dir()) + "/", "/pytest-of-", "/megarl-soak-"]
    for needle in needles:
        out = subprocess.run(["git", "grep", "-I", "-l", "-F", needle], cwd=REPO, capture_output=True, text=True)
        assert out.returncode in (0, 1), out.stderr  # 1: no match; anything else: git searched nothing
        hits = [f for f in out.stdout.splitlines() if f != "tests/e2e/test_portable_paths.py"]
        assert not hits, (needle, hits)
