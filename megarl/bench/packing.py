"""Benchmark: sequence packing and token-budget micro-batches against right-padded rows, through the
logprob pass and a training step; one run, the modes interleaved on the same model objects.

The ``long-tail`` batch is what packing is for: ``--batch`` replies of lognormal length (median
``--median`` tokens, sigma ``--sigma``, clipped to 16..1024) after a 32-token prompt. Modes:

- ``padded``: micro-batches of ``--micro-batch`` consecutive rows, right-padded to their longest;
- ``packed``: the same micro-batches packed (first-fit decreasing into rows of the micro-batch's
  longest sequence, block-diagonal causal mask: ``trainer.packing``);
- ``packed_budget``: packed, micro-batches formed by length within ``--budget`` tokens
  (``trainer.max_tokens_per_micro_batch``).

Per mode: tokens/s (real tokens over the median time) of ``compute_logprobs`` and of a training
step (``train_step``, grpo, one update), and ``tokens_per_s`` over both together; the largest
per-token logprob difference against ``padded`` at fp32 (the same weights: every logprob pass runs
before any step). The ``quickstart`` shape (configs/quickstart.yaml's batch: 64 rows, a ~48-token
prompt and short replies of 4..24 tokens) is reported beside it as is (not tuned to).

    megarl bench packing [--out runs/bench] [--batch 32] [--micro-batch 8] [--budget 2048] [--quick]

Writes ``OUT/packing.json`` (``padded_tokens_per_s``, ``packed_tokens_per_s``,
``max_abs_logprob_diff`` at the top level for the long-tail batch) and ``OUT/packing.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from megarl.bench.shape import add_shape_args, llama_dims
from megarl.utils.dist import run_multiprocess
from megarl.utils.paths import portable_args

MODES = ("padded", "packed", "packed_budget")
QUICK = dict(layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=512, batch=8, repeats=1)


def _dims(a: argparse.Namespace):
    return llama_dims(a)


def _lengths(a: argparse.Namespace, shape: str) -> tuple[list[int], int]:
    """(row lengths, prompt length) of a shape, from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    if shape == "quickstart":
        return (48 + torch.randint(4, 25, (64,), generator=g)).tolist(), 48
    reply = torch.exp(torch.randn(a.batch, generator=g) * a.sigma + float(torch.tensor(a.median).log()))
    return (32 + reply.clamp(16, 1024).long()).tolist(), 32


def _batch(lengths: list[int], prompt: int, vocab: int):
    from megarl.batch import RolloutBatch

    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    batch = RolloutBatch.from_sequences(
        tokens, [[0.0] * prompt + [1.0] * (n - prompt) for n in lengths],
        behav_logprobs=[[0.0] * prompt + (-torch.rand(n - prompt, generator=g) * 3).tolist() for n in lengths],
        advantages=torch.randn(len(lengths), generator=g).tolist())
    batch.group_ids = torch.arange(len(lengths)) // 4
    return batch


def _computed_tokens(lengths: list[int], micro_batch: int, budget: int) -> dict[str, int]:
    """Token positions the model runs per mode (rows x row width over the micro-batches): the
    linear layers' work, the bound on a mode's speedup before attention's per-row L^2."""
    from megarl.trainer.packing import first_fit_decreasing, token_budget_groups

    consecutive = [lengths[j:j + micro_batch] for j in range(0, len(lengths), micro_batch)]
    by_budget = [[lengths[i] for i in g] for g in token_budget_groups(lengths, budget)]

    def packed(groups):
        return sum(len(first_fit_decreasing(g, max(g))) * max(g) for g in groups)
    return {"padded": sum(len(g) * max(g) for g in consecutive), "packed": packed(consecutive),
            "packed_budget": packed(by_budget)}


def _worker(rank: int, world: int, a: argparse.Namespace) -> dict:
    from megarl.algorithms.config import AlgorithmConfig
    from megarl.algorithms.policy_loss import loss_params
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.logprobs import compute_logprobs, valid_token_mask
    from megarl.trainer.model import build_gpt_model
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    torch.set_num_threads(a.threads)
    init_model_parallel(1, 1, seed=0)
    model = build_gpt_model(_dims(a))
    objs = build_training(TrainerConfig(lr=1e-6), model, total_steps=1000)
    algo = AlgorithmConfig(loss="grpo")
    kw = {"padded": dict(packing=False), "packed": dict(packing=True),
          "packed_budget": dict(packing=True, max_tokens_per_micro_batch=a.budget)}
    out: dict = {}
    for shape in ("long-tail", "quickstart"):
        lengths, prompt = _lengths(a, shape)
        batch = _batch(lengths, prompt, a.vocab)
        valid = valid_token_mask(batch)
        lp = {m: compute_logprobs(model, batch, micro_batch_size=a.micro_batch, **kw[m]).logprobs for m in MODES}
        diff = {m: float(((lp[m] - lp["padded"]).abs() * valid).max()) for m in MODES}
        times: dict[str, dict[str, list[float]]] = {m: {"logprobs": [], "step": []} for m in MODES}
        for i in range(a.repeats + 1):  # round 0 warms up; later rounds alternate the order
            for m in (MODES if i % 2 == 0 else tuple(reversed(MODES))):
                t0 = time.perf_counter()
                compute_logprobs(model, batch, micro_batch_size=a.micro_batch, **kw[m])
                t1 = time.perf_counter()
                train_step(objs, batch, loss_name=algo.loss, loss_params=loss_params(algo),
                           micro_batch_size=a.micro_batch, current_version=0, **kw[m])
                t2 = time.perf_counter()
                if i:
                    times[m]["logprobs"].append(t1 - t0)
                    times[m]["step"].append(t2 - t1)
        tokens = sum(lengths)
        computed = _computed_tokens(lengths, a.micro_batch, a.budget)
        modes = {}
        for m in MODES:
            lp_s, step_s = statistics.median(times[m]["logprobs"]), statistics.median(times[m]["step"])
            modes[m] = {"logprobs_s": lp_s, "step_s": step_s, "logprobs_tokens_per_s": tokens / lp_s,
                        "step_tokens_per_s": tokens / step_s, "tokens_per_s": tokens / (lp_s + step_s),
                        "max_abs_logprob_diff": diff[m], "computed_tokens": computed[m], "times_s": times[m]}
        out[shape] = {"rows": len(lengths), "tokens": tokens, "padded_tokens": computed["padded"],
                      "longest": max(lengths), "median_length": statistics.median(lengths), "modes": modes,
                      "packed_speedup": modes["packed"]["tokens_per_s"] / modes["padded"]["tokens_per_s"],
                      "packed_budget_speedup": modes["packed_budget"]["tokens_per_s"] / modes["padded"]["tokens_per_s"]}
    return out


def _plot(result: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the packing bench")
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, (shape, r) in zip(axes, result["shapes"].items()):
        for j, part in enumerate(("logprobs_tokens_per_s", "step_tokens_per_s", "tokens_per_s")):
            ax.bar([i + (j - 1) * 0.27 for i in range(len(MODES))], [r["modes"][m][part] for m in MODES], 0.27,
                   label=part.replace("_tokens_per_s", "").replace("tokens_per_s", "logprobs + step"), color=f"C{j}")
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_ylabel("real tokens / s (median)")
        ax.set_title(f"{shape}: {r['rows']} rows, {r['tokens']} tokens (computed padded {r['padded_tokens']}, "
                     f"packed {r['modes']['packed']['computed_tokens']}); packed {r['packed_speedup']:.2f}x", fontsize=9)
        ax.legend(fontsize=8)
    save(fig, path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="megarl bench packing", description=__doc__.split("\n")[0])
    add_shape_args(p, layers=2, hidden=256, ffn=688, heads=4, kv_heads=2, vocab=8192,
                   layers_help="transformer layers of the tiny model",
                   vocab_help="vocab (the logits [tokens, vocab] of a padded 1024-long micro-batch must fit in memory)")
    p.add_argument("--batch", type=int, default=32, help="rows of the long-tail batch")
    p.add_argument("--median", type=float, default=128.0, help="median reply length (tokens)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the reply lengths")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch (padded and packed)")
    p.add_argument("--budget", type=int, default=2048, help="tokens per micro-batch of packed_budget")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds (after one warm-up round)")
    p.add_argument("--timeout", type=float, default=3000.0, help="seconds for the whole run")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--quick", action="store_true", help="smoke run: a 1-layer width-64 model, 8 rows, 1 repeat")
    if "--quick" in __import__("sys").argv[1:]:
        p.set_defaults(**QUICK)
    a = p.parse_args()
    shapes = run_multiprocess(_worker, 1, a, timeout_s=a.timeout)[0]
    tail = shapes["long-tail"]["modes"]
    result = {"bench": "packing", "config": portable_args(a),
              "padded_tokens_per_s": tail["padded"]["tokens_per_s"],
              "packed_tokens_per_s": tail["packed"]["tokens_per_s"],
              "packed_budget_tokens_per_s": tail["packed_budget"]["tokens_per_s"],
              "max_abs_logprob_diff": max(tail["packed"]["max_abs_logprob_diff"],
                                          tail["packed_budget"]["max_abs_logprob_diff"]),
              "shapes": shapes}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps(result, indent=1))
    for shape, r in shapes.items():
        figures = ", ".join(f"{m} {r['modes'][m]['tokens_per_s']:.0f} tok/s (logprobs {r['modes'][m]['logprobs_s']:.2f} s, "
                            f"step {r['modes'][m]['step_s']:.2f} s, diff {r['modes'][m]['max_abs_logprob_diff']:.2g})"
                            for m in MODES)
        computed = ", ".join(f"{m} {r['modes'][m]['computed_tokens']}" for m in MODES)
        print(f"{shape} ({r['rows']} rows, {r['tokens']} tokens; computed: {computed}): {figures}; "
              f"packed {r['packed_speedup']:.2f}x, packed+budget {r['packed_budget_speedup']:.2f}x")
    print(f"wrote {out / 'packing.json'}")
    _plot(result, out / "packing.png")


if __name__ == "__main__":
    main()
