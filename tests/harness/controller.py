"""`megarl train` on a tiny model, as tests run it: the command, its metrics rows, the HF export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


# fp32 engine vs fp32 trainer on the same weights: the two differ only in summation order, a few
# fp32 ulps (2^-23 relative) per op over two layers, i.e. ~1e-6 nats; a weight sync that missed an
# update moves logprobs by the update itself (lr 1e-5 x Adam's unit step over every weight: > 1e-4).
FP32_MISMATCH_BOUND = 1e-4


def _train(model_dir: Path, out_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megarl", "train", str(REPO / "configs" / "tiny_test.yaml"),
           f"model.path={model_dir}", f"logging.out_dir={out_dir}", "controller.eval_every=2",
           "data.eval_size=4", "trainer.checkpoint_interval=1",
           # The random tiny model never earns a reward (every advantage is 0, so the policy gradient
           # is exactly 0): a small entropy bonus gives the step a gradient to prove it trains.
           "algorithm.entropy_coef=0.01", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _export(mcore: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    done = subprocess.run([sys.executable, "-m", "megarl", "convert", "mcore-to-hf", "--mcore", str(mcore),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
