"""Benchmark: megarl's training step against a bare megatron step on the same model and batch.

"ours" is ``megarl.trainer.train_step.train_step`` (vocab-parallel logprobs, the policy loss from
the registry, metric reduction, DDP + optimizer + scheduler step). "bare" is what a megatron user
would write for the same work: megatron's pipeline schedule with the model's built-in
cross-entropy on the same tokens, then the same optimizer/scheduler step. Both run on the same
model objects, interleaved (ours, bare, ours, bare, ...) so machine noise hits both alike; the
ratio of tokens/s at each kind's fastest repeat (target >= 0.9; on a shared machine the fastest
repeat is the least disturbed one) is printed with the median-based ratio beside it, and written
to a JSON (and a PNG when matplotlib is installed).

    megarl bench trainer [--world 1] [--tp 1] [--pp 1] [--threads 1] \\
        [--layers 4 --hidden 256 --heads 4 --kv-heads 2 --vocab 8192] [--batch 8 --seq 256] \\
        [--micro-batch 4] [--repeats 5] [--out runs/bench]

``--quick`` is a smoke run (2 layers, hidden 64, vocab 512, 2 x 32 tokens, 2 repeats: seconds on
CPU) that checks the bench end to end; its ratio means little. ``--model DIR`` takes the model
shape from an HF folder's config.json instead of the --layers/--hidden/... flags.
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


QUICK = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, batch=2, seq=32, micro_batch=2,
             repeats=2)


def _dims(a: argparse.Namespace):
    from megarl.models.layouts import ModelDims
    if a.model:
        from megarl.trainer.model import read_hf_config
        return ModelDims.from_hf_config(read_hf_config(a.model))
    return llama_dims(a, max_positions=max(a.seq, 64), tied=False)


def _rollout_batch(a: argparse.Namespace):
    """Full-length rows (prompt = first quarter, response = the rest) so both steps see the same
    B x S tokens."""
    from megarl.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(a.vocab, _dims(a).vocab_size), (a.batch, a.seq), generator=g)
    prompt = max(1, a.seq // 4)
    mask = [[0.0] * prompt + [1.0] * (a.seq - prompt)] * a.batch
    behav = (-torch.rand(a.batch, a.seq, generator=g) * 3).tolist()
    adv = (torch.randn(a.batch, generator=g)).tolist()
    return RolloutBatch.from_sequences(tokens.tolist(), mask, behav_logprobs=behav, advantages=adv,
                                       versions=[[0] * a.seq] * a.batch)


def _bare_step(objs, batch, micro_batch_size: int) -> None:
    """Megatron as-is: schedule + GPTModel's own cross-entropy (labels) + optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.trainer.optimizer import optimizer_step
    from megarl.trainer.train_step import dp_share

    micro = dp_share(batch).micro_batches(micro_batch_size)

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        labels = torch.roll(mb.input_ids, -1, dims=1)  # next token (the last wraps: timing only)
        out = model(**mb.model_inputs(), labels=labels)

        def loss_func(per_token):
            return (per_token.float() * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1), {}
        return out, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=objs.model,
        num_microbatches=len(micro), seq_length=batch.input_ids.shape[1],
        micro_batch_size=micro_batch_size, forward_only=False)
    optimizer_step(objs)


def _worker(rank: int, world: int, a: argparse.Namespace) -> dict:
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.model import build_gpt_model
    from megarl.trainer.optimizer import build_training, params_dtype
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    torch.set_num_threads(a.threads)
    cfg = TrainerConfig(tp=a.tp, pp=a.pp, dp=world // (a.tp * a.pp), lr=1e-5,
                        micro_batch_size=a.micro_batch, params_dtype=a.dtype,
                        use_distributed_optimizer=world // (a.tp * a.pp) > 1)
    init_model_parallel(cfg.tp, cfg.pp, seed=0)
    model = build_gpt_model(_dims(a), params_dtype=params_dtype(cfg))
    objs = build_training(cfg, model, total_steps=10 * a.repeats)
    batch = _rollout_batch(a)

    def ours():
        train_step(objs, batch, loss_name=a.loss, loss_params={}, micro_batch_size=a.micro_batch,
                   current_version=0)

    def bare():
        _bare_step(objs, batch, a.micro_batch)

    times: dict[str, list[float]] = {"ours": [], "bare": []}
    for i in range(a.repeats + 1):  # the first round is warm-up
        kinds = (("ours", ours), ("bare", bare)) if i % 2 == 0 else (("bare", bare), ("ours", ours))
        for name, fn in kinds if not a.no_bare else (("ours", ours),):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            torch.distributed.barrier()
            if i:
                times[name].append(time.perf_counter() - t0)
    return times


def _plot(result: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the trainer bench")
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar(["megarl train_step", "bare megatron"],
            [result["ours_tokens_per_s"], result["bare_tokens_per_s"]], color=["C0", "C7"])
    ax1.set_ylabel("tokens / s (fastest repeat)")
    ax1.set_title(f"ratio {result['ratio']:.3f} (target >= 0.9)")
    for name, color in (("ours", "C0"), ("bare", "C7")):
        ax2.plot(result["times_s"][name], "o-", color=color, label=name)
    ax2.set_xlabel("repeat")
    ax2.set_ylabel("step time (s)")
    ax2.legend()
    save(fig, path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="megarl bench trainer", description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=1, help="trainer ranks (processes)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (1 = stable "
                   "numbers on a shared machine; 2 OpenMP threads on 2 busy cores spin and skew "
                   "whichever step runs beside a burst of load)")
    add_shape_args(p, layers=4, hidden=256, ffn=0, heads=4, kv_heads=2, vocab=8192, ffn_help="0 = 4 * hidden")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--loss", default="aipo")
    p.add_argument("--repeats", type=int, default=8, help="timed steps of each kind")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole run")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--model", default="", help="HF folder whose config.json gives the model shape")
    p.add_argument("--no-bare", action="store_true", help="time megarl's step only (a calibration constant for "
                   "`megarl simulate --calibrate`: tokens/s on --threads cores), no bare-megatron ratio")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model and batch, 2 repeats "
                   f"({', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in QUICK.items())}); "
                   "explicit flags still win")
    if "--quick" in __import__("sys").argv[1:]:
        p.set_defaults(**QUICK)
    a = p.parse_args()

    results = run_multiprocess(_worker, a.world, a, timeout_s=a.timeout)
    times = results[0]
    tokens = a.batch * a.seq
    ours_tps = tokens / min(times["ours"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.no_bare:
        result = {"bench": "trainer_step", "config": portable_args(a), "tokens_per_step": tokens, "ours_tokens_per_s": ours_tps,
                  "ours_tokens_per_s_median": tokens / statistics.median(times["ours"]), "times_s": times}
        (out / "bench_trainer.json").write_text(json.dumps(result, indent=1))
        print(f"train_step: megarl {ours_tps:.0f} tok/s (fastest of {a.repeats}), "
              f"{result['ours_tokens_per_s_median']:.0f} tok/s median, {a.threads} thread(s); "
              f"wrote {out / 'bench_trainer.json'}")
        return
    bare_tps = tokens / min(times["bare"])
    ratio_median = statistics.median(times["bare"]) / statistics.median(times["ours"])
    result = {"bench": "trainer_step", "config": portable_args(a), "tokens_per_step": tokens,
              "ours_tokens_per_s": ours_tps, "bare_tokens_per_s": bare_tps,
              "ratio": ours_tps / bare_tps, "ratio_median": ratio_median, "times_s": times}
    (out / "bench_trainer.json").write_text(json.dumps(result, indent=1))
    print(f"train_step: megarl {ours_tps:.0f} tok/s vs bare megatron {bare_tps:.0f} tok/s "
          f"(fastest of {a.repeats}) -> ratio {result['ratio']:.3f} (target >= 0.9; median-based "
          f"{ratio_median:.3f}); wrote {out / 'bench_trainer.json'}")
    _plot(result, out / "bench_trainer.png")


if __name__ == "__main__":
    import sys

    from megarl.utils.errors import run_main

    sys.exit(run_main(main, "megarl bench trainer"))  # a failure: one line, the exit code of its class
