"""Benchmark: A-3PO's approximated proximal policy against decoupled PPO's recompute forward, and the
training step each makes, beside a synchronous (coupled) step; one run, interleaved repeats.

A-3PO (arXiv 2512.06547, section 4.2) reports 0.0012 s for its approximation against 4-8 s for the
recompute, and 1.1-1.8x end-to-end speed. Here, per batch shape, on the same model objects:

- ``prox_approx_s``: a3po's interpolation over the batch's [B, S] tensors (alpha from the tokens'
  staleness, log prox = log mu + alpha (log pi - log mu)), the only work it adds;
- ``prox_recompute_s``: the no-grad forward of the policy over the batch (``compute_logprobs``),
  what decoupled_ppo runs before the step's first update;
- ``step_s``: a whole trainer step (the no-grad passes the loss needs, then trainer.minibatches
  updates) for ``a3po`` (samples 2 versions stale), ``decoupled_ppo`` (the same samples) and ``sync``
  (``grpo``, the coupled loss on fresh samples: the synchronous baseline's step).

Shapes: ``quickstart`` is configs/quickstart.yaml's batch (16 prompts x 4 samples, a ~48-token
arithmetic prompt and 24 reply tokens); ``long`` is A-3PO's setup 1 reply length (1024 tokens) on 8
sequences (4 prompts x 2 samples, so 4 minibatches of whole groups). The model is SmolLM2-135M's width (hidden 576, 9 heads, 3 KV heads, vocab 49152) with
``--layers`` layers (30 in the real model; fewer keeps a CPU run to minutes: the step ratio depends
on the forward / step cost, which the layer count scales alike). The step excludes generation, so
its ratio is the trainer's share of the paper's end-to-end figure, not that figure.

    megarl bench prox [--layers 2] [--minibatches 4] [--repeats 3] [--out docs] [--quick]

Writes ``OUT/bench_prox.json`` and ``OUT/bench_prox.png``.
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

SHAPES = {"quickstart": dict(batch=64, samples=4, prompt=48, reply=24),
          "long": dict(batch=8, samples=2, prompt=64, reply=1024)}
QUICK = dict(layers=1, hidden=64, heads=4, kv_heads=2, vocab=512, repeats=1)
LOSSES = ("a3po", "decoupled_ppo", "sync")


def _dims(a: argparse.Namespace, seq: int):
    return llama_dims(a, max_positions=max(seq, 64))


def _batch(shape: dict, vocab: int, version: int):
    """Full-length rows in prompt groups of ``samples``, every reply token ``version``."""
    from megarl.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    b, p, r = shape["batch"], shape["prompt"], shape["reply"]
    tokens = torch.randint(0, vocab, (b, p + r), generator=g).tolist()
    batch = RolloutBatch.from_sequences(
        tokens, [[0.0] * p + [1.0] * r] * b, behav_logprobs=(-torch.rand(b, p + r, generator=g) * 3).tolist(),
        advantages=torch.randn(b, generator=g).tolist(), versions=[[-1] * p + [version] * r] * b)
    batch.group_ids = torch.arange(b) // shape["samples"]
    return batch


def _approximation(batch, current_version: int) -> torch.Tensor:
    """What a3po adds: alpha from staleness and the log-linear prox (megarl.algorithms.losses)."""
    from megarl.algorithms.losses import a3po_alpha

    mask = batch.loss_mask.bool()
    staleness = torch.where(mask, current_version - batch.versions, torch.zeros_like(batch.versions))
    alpha = a3po_alpha(staleness)
    log_pi = batch.behav_logprobs + 0.01  # stands in for the forward's own log pi (already computed)
    return batch.behav_logprobs + (1.0 - alpha) * (log_pi - batch.behav_logprobs)


def _worker(rank: int, world: int, a: argparse.Namespace) -> dict:
    from megarl.algorithms.config import AlgorithmConfig
    from megarl.algorithms.policy_loss import loss_params
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.logprobs import compute_logprobs
    from megarl.trainer.model import build_gpt_model
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.train_step import prepare_batch, train_step
    from megarl.utils.dist import init_model_parallel

    torch.set_num_threads(a.threads)
    out: dict = {}
    for name, shape in SHAPES.items():
        seq = shape["prompt"] + shape["reply"]
        cfg = TrainerConfig(lr=1e-6, micro_batch_size=a.micro_batch, minibatches=a.minibatches)
        init_model_parallel(1, 1, seed=0)
        model = build_gpt_model(_dims(a, seq))
        objs = build_training(cfg, model, total_steps=100)
        version = 2  # a3po and decoupled_ppo train samples 2 versions stale: alpha = 1/2
        stale, fresh = _batch(shape, a.vocab, version=0), _batch(shape, a.vocab, version=version)
        algos = {"a3po": AlgorithmConfig(loss="a3po"), "decoupled_ppo": AlgorithmConfig(loss="decoupled_ppo"),
                 "sync": AlgorithmConfig(loss="grpo")}

        def step(loss: str) -> None:
            algo = algos[loss]
            batch, _ = prepare_batch(objs, None, fresh if loss == "sync" else stale, algo, cfg.micro_batch_size)
            train_step(objs, batch, loss_name=algo.loss, loss_params=loss_params(algo),
                       micro_batch_size=cfg.micro_batch_size, current_version=version, minibatches=cfg.minibatches)

        times: dict[str, list[float]] = {k: [] for k in ("prox_approx", "prox_recompute", *LOSSES)}
        work = {"prox_approx": lambda: _approximation(stale, version),
                "prox_recompute": lambda: compute_logprobs(model, stale, micro_batch_size=cfg.micro_batch_size),
                **{loss: (lambda loss=loss: step(loss)) for loss in LOSSES}}
        for i in range(a.repeats + 1):  # round 0 warms up; later rounds alternate the order
            for key in (list(work) if i % 2 == 0 else list(reversed(work))):
                t0 = time.perf_counter()
                work[key]()
                if i:
                    times[key].append(time.perf_counter() - t0)
        out[name] = {"shape": shape, "tokens": shape["batch"] * seq, "times_s": times}
    return out


def _summary(result: dict) -> dict:
    med = {k: statistics.median(v) for k, v in result["times_s"].items()}
    return {"prox_approx_s": med["prox_approx"], "prox_recompute_s": med["prox_recompute"],
            "recompute_over_approx": med["prox_recompute"] / max(med["prox_approx"], 1e-9),
            "step_s": {loss: med[loss] for loss in LOSSES},
            "decoupled_ppo_over_a3po_step": med["decoupled_ppo"] / med["a3po"],
            "sync_over_a3po_step": med["sync"] / med["a3po"]}


def _plot(result: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the prox bench")
    if plt is None:
        return
    names = list(result["shapes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(names))
    approx = [result["shapes"][n]["prox_approx_s"] for n in names]
    recompute = [result["shapes"][n]["prox_recompute_s"] for n in names]
    ax1.bar([i - 0.2 for i in x], approx, 0.4, label="a3po approximation", color="C0")
    ax1.bar([i + 0.2 for i in x], recompute, 0.4, label="recompute forward", color="C3")
    ax1.set_yscale("log")
    ax1.set_ylim(top=max(recompute) * 50)  # room above the bars for the legend
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("seconds (median)")
    ax1.set_title("proximal logprobs")
    ax1.legend(fontsize=8)
    for j, loss in enumerate(LOSSES):
        ax2.bar([i + (j - 1) * 0.27 for i in x], [result["shapes"][n]["step_s"][loss] for n in names], 0.27,
                label=loss, color=f"C{j}")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("trainer step (s, median)")
    ax2.set_title(f"{result['config']['minibatches']} updates a step")
    ax2.legend(fontsize=8)
    save(fig, path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="megarl bench prox", description=__doc__.split("\n")[0])
    add_shape_args(p, layers=2, hidden=576, ffn=1536, heads=9, kv_heads=3, vocab=49152,
                   layers_help="transformer layers (SmolLM2-135M has 30)")
    p.add_argument("--minibatches", type=int, default=4, help="optimizer updates a step (A-3PO's recipes: 4)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--timeout", type=float, default=3000.0, help="seconds for the whole run")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--quick", action="store_true", help="smoke run: a 1-layer width-64 model, 1 repeat; its "
                   "ratios mean little")
    if "--quick" in __import__("sys").argv[1:]:
        p.set_defaults(**QUICK, ffn=128)
    a = p.parse_args()
    shapes = run_multiprocess(_worker, 1, a, timeout_s=a.timeout)[0]
    result = {"bench": "prox", "config": portable_args(a),
              "shapes": {n: {**r, **_summary(r)} for n, r in shapes.items()}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_prox.json").write_text(json.dumps(result, indent=1))
    for n, r in result["shapes"].items():
        print(f"{n} ({r['tokens']} tokens): prox approximation {r['prox_approx_s'] * 1e3:.2f} ms vs recompute "
              f"{r['prox_recompute_s']:.2f} s ({r['recompute_over_approx']:.0f}x); step a3po "
              f"{r['step_s']['a3po']:.2f} s, decoupled_ppo {r['step_s']['decoupled_ppo']:.2f} s "
              f"({r['decoupled_ppo_over_a3po_step']:.2f}x a3po), sync {r['step_s']['sync']:.2f} s "
              f"({r['sync_over_a3po_step']:.2f}x a3po)")
    print(f"wrote {out / 'bench_prox.json'}")
    _plot(result, out / "bench_prox.png")


if __name__ == "__main__":
    main()
