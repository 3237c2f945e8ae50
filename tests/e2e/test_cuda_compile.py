"""Every csrc/**/*.cu compiles for every GPU generation setup.py builds (megarl/cuda_archs.py: sm_80, sm_89,
sm_90, sm_100 and PTX) with the machine's nvcc, GPU or not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megarl.cuda_archs import DEFAULT_ARCHS

REPO = Path(__file__).resolve().parents[2]


def _nvcc() -> str | None:
    return os.environ.get("NVCC") or shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed on this machine")
def test_cuda_sources_compile_for_every_generation(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_CUDA_ARCHS"}
    out = subprocess.run(["bash", str(REPO / "tools" / "compile_cuda.sh")], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env=dict(env, OUT_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stdout + out.stderr
    listed = subprocess.run([_nvcc(), "--list-gpu-arch"], capture_output=True, text=True).stdout.split()
    for arch in DEFAULT_ARCHS:  # each one this nvcc can build (an older toolkit lacks sm_100)
        if not listed or f"compute_{arch}" in listed:
            assert f"code=sm_{arch}" in out.stdout, out.stdout
    sources = sorted(REPO.glob("csrc/**/*.cu"))
    objects = sorted(tmp_path.rglob("*.o"))
    assert sources and len(objects) == len(sources), (sources, objects)
    assert all(o.stat().st_size > 0 for o in objects)
