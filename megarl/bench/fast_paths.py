"""Benchmark: the paths that should be fast, timed here rather than asserted in tests.

Tests assert behaviour only: a wall-clock bound in a test fails on a loaded machine and proves
nothing on an idle one. What those tests used to bound is timed here, each case ``--trials`` times
(best kept), against the budget it used to have, so a slowdown shows up when someone looks:

- ``layouts_405b``: DDMA source + destination layouts of Llama 3.1 405B, trainer TP8 x PP9 x DP4
  into generator TP16 x 2 (layouts only, no copy plan); budget 2 s.
- ``plan_405b_matching_tp``: the full copy plan 405B TP8 x PP2 x DP2 -> TP8 x 1; budget 30 s.
- ``plan_sync_cli_8b``: ``megarl plan-sync`` projection of Llama 3.1 8B 2x1x2 -> 2x2, a fresh
  process (imports included); budget 20 s.
- ``config_validation_cli``: ``megarl train`` on a config with a bad key, to its exit 2, a fresh
  process; budget 5 s (validation imports no engine, far below the ~40 s vLLM start on 2 cores).

    megarl bench fast_paths [--trials 3] [--out runs/bench]

Writes ``fast_paths.json`` under ``--out``; exit 0 whatever the timings (it reports, it does not gate).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

# Llama 3.1 8B's shape (configs/models/llama-3.1-8b.json's dims), written to a temporary file for the CLI case
LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=32, hidden_size=4096,
                num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16")
LLAMA_405B = dict(model_type="llama", num_hidden_layers=126, hidden_size=16384, num_attention_heads=128,
                  num_key_value_heads=8, head_dim=128, intermediate_size=53248, vocab_size=128256,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)


def _layouts_405b() -> None:
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, destination_layouts, source_layouts
    from megarl.models.layouts import ModelDims

    d = ModelDims.from_hf_config(LLAMA_405B)
    source_layouts(d, TrainerTopology(8, 9, 4))
    destination_layouts(d, GeneratorTopology(16, 2))


def _plan_405b() -> None:
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
    from megarl.ddma.plan import plan_sync
    from megarl.models.layouts import ModelDims

    plan_sync(ModelDims.from_hf_config(LLAMA_405B), TrainerTopology(8, 2, 2), GeneratorTopology(8, 1))


def _cli(*args: str, want_rc: int) -> Callable[[], None]:
    def go() -> None:
        done = subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True, timeout=600)
        if done.returncode != want_rc:
            raise RuntimeError(f"megarl {' '.join(args)}: exit {done.returncode}, expected {want_rc}: "
                               f"{done.stderr[-500:]}")
    return go


def _config_validation(tmp: Path) -> Callable[[], None]:
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                                   "num_key_value_heads": 4, "intermediate_size": 64}))
    cfg = tmp / "c.yaml"
    cfg.write_text(f"model: {{path: {model}}}\n")
    return _cli("train", str(cfg), "trainer.tpp=2", want_rc=2)


def time_best(fn: Callable[[], None], trials: int) -> float:
    """Best wall time of ``trials`` calls (the least disturbed by other load)."""
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="megarl bench fast_paths", description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        llama_8b = Path(tmp) / "llama-3.1-8b.json"
        llama_8b.write_text(json.dumps(LLAMA_8B))
        cases: list[tuple[str, Callable[[], None], float]] = [
            ("layouts_405b", _layouts_405b, 2.0),
            ("plan_405b_matching_tp", _plan_405b, 30.0),
            ("plan_sync_cli_8b", _cli("plan-sync", "--model", str(llama_8b), "--trainer",
                                      "2x1x2", "--generator", "2x2", want_rc=0), 20.0),
            ("config_validation_cli", _config_validation(Path(tmp)), 5.0),
        ]
        results = {}
        for name, fn, budget in cases:
            best = time_best(fn, args.trials)
            results[name] = {"best_s": best, "budget_s": budget, "within": best <= budget}
            print(f"{name:<24} best {best:8.3f} s  budget {budget:5.1f} s  "
                  f"{'ok' if best <= budget else 'OVER BUDGET'}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fast_paths.json").write_text(json.dumps({"trials": args.trials, "cases": results}, indent=2) + "\n")
    print(f"wrote {out / 'fast_paths.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
