"""Benchmark: LoRA (trainer.lora_rank > 0) against full fine-tuning on the same model: the trainer step,
and the DDMA weight sync (bytes and seconds); one run, the two side by side, rounds interleaved.

One trainer process holds two models of the same dims and weights: ``full`` (every weight trains; its
sender sends every tensor each sync) and ``lora`` (adapters of rank ``--rank`` on linear_qkv/proj/fc1/fc2,
base frozen; its sender, megarl/trainer/ddma.py ``LoraMergedSender``, merges ``W + alpha/r B A`` shard
by shard and, after its first sync, sends only the merged targets: embeddings and norms stay as the
engine holds them). One generator worker process (no vLLM: the bench measures the trainer and the bytes
moved; the landing into vLLM is the same per byte) lands every sync through
``DdmaReceiver.receive_into`` into engine tensors in vLLM's layout (zero_copy transport, engine bf16).

Per round (after one untimed warm-up round, which holds the LoRA sender's one full sync), in alternating
order: a trainer step of each model on the same batch (``train_step``: the forward/backward and the
optimizer update), then a sync of each (the sender's whole ``sync``: merge, convert to the wire dtype,
checksums, transfer, the worker's acknowledgement). Medians of ``--repeats`` rounds; ratios full / lora.

The model is SmolLM2-135M's width (hidden 576, 9 heads, 3 KV heads, ffn 1536, vocab 49152, tied
embeddings) with ``--layers`` layers. The share of the bytes a LoRA sync skips is the embedding's and
the norms' (28M of the 2-layer model's 44M elements; at 30 layers 28M of 135M), so it shrinks with depth:
the JSON gives both counts and the bytes of the same model at 30 layers from the plan.

With ``--vllm``, the same update in a vLLM engine (this CPU build serves LoRA adapters): landed merged
through the engine's layerwise reload (the targets' tensors, as a LoRA DDMA sync lands them) against
written as peft files and loaded as an adapter (``LoRARequest`` of a new id), and decode tokens/s of
the merged engine against the engine serving the adapter (punica LoRA kernels on every token).

    megarl bench lora [--layers 2] [--rank 16] [--repeats 3] [--vllm] [--out runs/bench] [--quick]

Writes ``OUT/bench_lora.json`` and ``OUT/bench_lora.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import torch

from megarl.bench.shape import add_shape_args, llama_dims

QUICK = dict(layers=1, hidden=64, heads=2, kv_heads=1, vocab=512, ffn=128, repeats=1, seq=32)
MODES = ("full", "lora")


def _dims(a: argparse.Namespace, layers: int | None = None):
    return llama_dims(a, layers=layers, max_positions=max(a.seq, 64))


def _spec(a: argparse.Namespace, port: int):
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
    from megarl.ddma.sync import SyncSpec

    return SyncSpec(_dims(a), TrainerTopology(1, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", port,
                    transport="zero_copy", engine_dtype="bfloat16", verify_every=1)


def _batch(a: argparse.Namespace):
    from megarl.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    b, s, p = a.batch, a.seq, a.seq // 4
    tokens = torch.randint(0, a.vocab, (b, s), generator=g).tolist()
    return RolloutBatch.from_sequences(tokens, [[0.0] * p + [1.0] * (s - p)] * b,
                                       behav_logprobs=(-torch.rand(b, s, generator=g) * 3).tolist(),
                                       advantages=torch.randn(b, generator=g).tolist(), versions=[[0] * s] * b)


def _receiver(a: argparse.Namespace, port: int, versions: int, out) -> None:
    """The generator worker: lands every sync into engine tensors (vLLM layout), in version order."""
    from megarl.ddma.layouts import DstRank
    from megarl.ddma.sync import DdmaReceiver

    torch.set_num_threads(1)
    spec = _spec(a, port)
    r = DdmaReceiver(spec, DstRank(0, 0))
    dest = {n: torch.zeros(lay.local_shape, dtype=torch.bfloat16) for n, lay in r.layouts.items()}
    for v in range(1, versions + 1):
        t0 = time.perf_counter()
        r.receive_into(v, dest)
        out.put((v, time.perf_counter() - t0))
    out.put(("done", None))


def _worker(rank: int, world: int, a: argparse.Namespace, port: int) -> dict:
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.ddma import make_sender
    from megarl.trainer.lora import param_counts
    from megarl.trainer.model import build_gpt_model
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    torch.set_num_threads(a.threads)
    init_model_parallel(1, 1, seed=0)
    batch = _batch(a)
    objs, senders, counts = {}, {}, {}
    for mode in MODES:
        torch.manual_seed(0)  # the same base weights in both
        model = build_gpt_model(_dims(a))
        cfg = TrainerConfig(lr=1e-4, micro_batch_size=a.micro_batch,
                            **({"lora_rank": a.rank, "lora_alpha": 2.0 * a.rank} if mode == "lora" else {}))
        objs[mode] = build_training(cfg, model, total_steps=100)
        senders[mode] = make_sender(model, _spec(a, port))
        counts[mode] = param_counts(model)
    times = {f"{k}_{m}": [] for k in ("step", "sync") for m in MODES}
    sent = {m: [] for m in MODES}
    version = 0
    for i in range(a.repeats + 1):  # round 0 warms up (and holds the LoRA sender's one full sync)
        order = MODES if i % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            t0 = time.perf_counter()
            train_step(objs[mode], batch, loss_name="aipo", loss_params={"rho": 4.0},
                       micro_batch_size=a.micro_batch, current_version=version)
            if i:
                times[f"step_{mode}"].append(time.perf_counter() - t0)
        for mode in order:
            version += 1
            t0 = time.perf_counter()
            stats = senders[mode].sync(version)
            if i:
                times[f"sync_{mode}"].append(time.perf_counter() - t0)
            sent[mode].append(stats["bytes_sent"])
    return {"times_s": times, "bytes_sent": sent, "counts": counts, "versions": version}


def _plan_bytes(a: argparse.Namespace, layers: int) -> dict:
    """Bytes of a full sync and of a LoRA sync after its first (bf16 engine), from the plan alone."""
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
    from megarl.ddma.plan import plan_sync
    from megarl.trainer.config import LORA_TARGETS
    from megarl.trainer.ddma import frozen_skip

    plan = plan_sync(_dims(a, layers), TrainerTopology(1, 1, 1), GeneratorTopology(1, 1))
    skip = frozen_skip(plan, LORA_TARGETS)
    full = sum(c.numel for cs in plan.pairs.values() for c in cs)
    lora = sum(c.numel for cs in plan.pairs.values() for c in cs if c.hf_name not in skip)
    return {"layers": layers, "full_bytes": 2 * full, "lora_bytes": 2 * lora, "full_over_lora": full / lora}


def run(a: argparse.Namespace) -> dict:
    from megarl.ddma.sync import host_store
    from megarl.utils.dist import run_multiprocess

    store = host_store()
    versions = 2 * (a.repeats + 1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    recv = ctx.Process(target=_receiver, args=(a, store.port, versions, q), daemon=True)
    recv.start()
    try:
        res = run_multiprocess(_worker, 1, a, store.port, timeout_s=a.timeout)[0]
        landed = {}
        while True:
            v, s = q.get(timeout=a.timeout)
            if v == "done":
                break
            landed[v] = s
    finally:
        recv.join(timeout=30)
        if recv.is_alive():
            recv.kill()
    med = {k: statistics.median(v) for k, v in res["times_s"].items()}
    return {"bench": "lora", "config": vars(a), "times_s": res["times_s"], "median_s": med,
            "receiver_s": landed, "bytes_sent": res["bytes_sent"], "counts": res["counts"],
            "step_full_over_lora": med["step_full"] / med["step_lora"],
            "sync_s_full_over_lora": med["sync_full"] / med["sync_lora"],
            "sync_bytes_full_over_lora": res["bytes_sent"]["full"][-1] / res["bytes_sent"]["lora"][-1],
            "plan_bytes": [_plan_bytes(a, a.layers), _plan_bytes(a, 30)]}


ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def _engine(base: Path, lora_rank: int):
    from vllm import LLM

    from megarl.generator.weights import WORKER_EXTENSION

    kw = dict(enable_lora=True, max_lora_rank=lora_rank, max_loras=1) if lora_rank else {}
    return LLM(model=str(base), dtype="bfloat16", max_model_len=256, enforce_eager=True,
               worker_extension_cls=WORKER_EXTENSION, **kw)


def _vllm(a: argparse.Namespace, tmp: Path) -> dict:
    """In vLLM (this CPU build): a LoRA sync landed merged (the targets' HF tensors through the engine's
    layerwise reload, the path a DDMA sync lands by) against the same update as a LoRA adapter (peft files
    written, then ``LoRARequest`` of a new id: vLLM loads it at the next request); and decode tokens/s of
    the merged engine against the engine serving the adapter."""
    import os

    from safetensors.torch import load_file, save_file
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from megarl.generator.shm_source import pack_to_shm
    from megarl.models.tiny import make_tiny_hf_checkpoint

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default 4 on a loaded 2-core box gets OOM-killed
    base = make_tiny_hf_checkpoint(tmp / "base", "llama", num_layers=a.layers, hidden_size=a.hidden,
                                   num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                                   intermediate_size=a.ffn, tie_word_embeddings=True, seed=0, dtype="bfloat16")
    weights = load_file(str(next(base.glob("*.safetensors"))))
    targets = {k: v for k, v in weights.items() if k.rsplit(".", 2)[-2] in ATTN + MLP}
    prompts = [{"prompt_token_ids": [1 + i, 504, 3180, 314]} for i in range(8)]
    one, decode = SamplingParams(temperature=0.0, max_tokens=1), SamplingParams(temperature=0.0, max_tokens=64,
                                                                               ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    out: dict = {"merged_land_s": [], "adapter_load_s": [], "target_bytes": sum(t.numel() * 2 for t in targets.values())}

    def tokens_per_s(llm, **kw) -> float:
        t0 = time.perf_counter()
        res = llm.generate(prompts, decode, use_tqdm=False, **kw)
        return sum(len(o.outputs[0].token_ids) for o in res) / (time.perf_counter() - t0)

    llm = _engine(base, 0)
    for i in range(a.repeats + 1):
        moved = [(k, v + 1e-3 * torch.randn(v.shape, generator=g).to(v.dtype)) for k, v in targets.items()]
        shm = pack_to_shm(moved)
        t0 = time.perf_counter()
        llm.collective_rpc("megarl_reload_weights", args=(shm.source(),))
        if i:
            out["merged_land_s"].append(time.perf_counter() - t0)
        shm.unlink()
    llm.generate(prompts, one, use_tqdm=False)
    out["merged_tokens_per_s"] = tokens_per_s(llm)
    del llm
    import gc

    gc.collect()
    llm = _engine(base, a.rank)
    llm.generate(prompts, one, use_tqdm=False)
    for i in range(a.repeats + 1):
        d = tmp / f"adapter{i}"
        d.mkdir()
        ad = {}
        for k, v in targets.items():
            m = "base_model.model." + k.removesuffix(".weight")
            ad[f"{m}.lora_A.weight"] = torch.randn(a.rank, v.shape[1], generator=g) * 0.01
            ad[f"{m}.lora_B.weight"] = torch.randn(v.shape[0], a.rank, generator=g) * 0.01
        t0 = time.perf_counter()  # the sync's work: write the adapter, then vLLM loads it at the next request
        save_file(ad, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM",
                                                           "r": a.rank, "lora_alpha": 2.0 * a.rank,
                                                           "target_modules": list(ATTN + MLP), "lora_dropout": 0.0,
                                                           "bias": "none", "base_model_name_or_path": str(base)}))
        llm.generate(prompts[:1], one, use_tqdm=False, lora_request=LoRARequest(f"v{i}", i + 1, str(d)))
        t1 = time.perf_counter()
        llm.generate(prompts[:1], one, use_tqdm=False, lora_request=LoRARequest(f"v{i}", i + 1, str(d)))
        t2 = time.perf_counter()  # the same request again, adapter resident: the request's own cost
        if i:
            out["adapter_load_s"].append((t1 - t0) - (t2 - t1))
    out["adapter_tokens_per_s"] = tokens_per_s(llm, lora_request=LoRARequest(f"v{a.repeats}", a.repeats + 1,
                                                                             str(tmp / f"adapter{a.repeats}")))
    del llm
    med = {k: statistics.median(out[k]) for k in ("merged_land_s", "adapter_load_s")}
    return {**out, "median_s": med, "decode_merged_over_adapter": out["merged_tokens_per_s"] / out["adapter_tokens_per_s"]}


def _vllm_main(a: argparse.Namespace, q) -> None:
    import tempfile
    import traceback

    try:
        with tempfile.TemporaryDirectory() as tmp:
            q.put(_vllm(a, Path(tmp)))
    except BaseException:  # noqa: BLE001 - reported in the JSON: this build's vLLM LoRA did not run
        q.put({"error": traceback.format_exc()[-2000:]})


def _plot(r: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the lora bench")
    if plt is None:
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(12, 3.6))
    med = r["median_s"]
    for ax, key, title in ((ax1, "step", "trainer step"), (ax2, "sync", "DDMA sync (sender, whole)")):
        vals = [med[f"{key}_{m}"] for m in MODES]
        ax.bar(MODES, vals, color=["C3", "C0"])
        ax.set_ylabel("seconds (median)")
        ax.set_title(title)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    vals = [r["bytes_sent"][m][-1] / 2 ** 20 for m in MODES]
    ax3.bar(MODES, vals, color=["C3", "C0"])
    ax3.set_ylabel("MiB a sync sends")
    ax3.set_title(f"sync bytes (after the first), {r['config']['layers']} layers")
    for i, v in enumerate(vals):
        ax3.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"LoRA rank {r['config']['rank']} vs full fine-tuning, full / lora: step time "
                 f"{r['step_full_over_lora']:.2f}x, sync time {r['sync_s_full_over_lora']:.2f}x, sync bytes "
                 f"{r['sync_bytes_full_over_lora']:.2f}x", fontsize=10)
    save(fig, path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(prog="megarl bench lora", description=__doc__.split("\n")[0])
    add_shape_args(p, layers=2, hidden=576, ffn=1536, heads=9, kv_heads=3, vocab=49152,
                   layers_help="transformer layers (SmolLM2-135M has 30)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--seq", type=int, default=128, help="tokens a sequence (the last 3/4 trained)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--timeout", type=float, default=3000.0, help="seconds for the whole run")
    p.add_argument("--vllm", action="store_true", help="also in vLLM: a LoRA update landed merged vs loaded as "
                   "an adapter (LoRARequest), and decode tokens/s of each (two engine starts, minutes)")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--quick", action="store_true", help="smoke run: a 1-layer width-64 model, 1 repeat; its "
                   "ratios mean little")
    if "--quick" in __import__("sys").argv[1:]:
        p.set_defaults(**QUICK)
    a = p.parse_args()
    r = run(a)
    if a.vllm:
        q = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(target=_vllm_main, args=(a, q))
        proc.start()
        r["vllm"] = q.get(timeout=a.timeout)
        proc.join(timeout=60)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_lora.json").write_text(json.dumps(r, indent=1))
    med = r["median_s"]
    print(f"trainer step: full {med['step_full']:.3f} s, lora {med['step_lora']:.3f} s "
          f"({r['step_full_over_lora']:.2f}x); trainable {r['counts']['full']['train/trainable_params']} vs "
          f"{r['counts']['lora']['train/trainable_params']}")
    print(f"sync: full {med['sync_full']:.3f} s {r['bytes_sent']['full'][-1]} B, lora {med['sync_lora']:.3f} s "
          f"{r['bytes_sent']['lora'][-1]} B (first lora sync {r['bytes_sent']['lora'][0]} B): "
          f"{r['sync_s_full_over_lora']:.2f}x time, {r['sync_bytes_full_over_lora']:.2f}x bytes")
    for pb in r["plan_bytes"]:
        print(f"plan, {pb['layers']} layers: full {pb['full_bytes']} B, lora {pb['lora_bytes']} B "
              f"({pb['full_over_lora']:.2f}x)")
    v = r.get("vllm")
    if v and "error" not in v:
        print(f"vLLM: a LoRA update landed merged (reload of the targets, {v['target_bytes']} B) "
              f"{v['median_s']['merged_land_s']:.3f} s vs as an adapter (write + load) {v['median_s']['adapter_load_s']:.3f} s; "
              f"decode {v['merged_tokens_per_s']:.0f} tok/s merged vs {v['adapter_tokens_per_s']:.0f} with the adapter "
              f"({v['decode_merged_over_adapter']:.2f}x)")
    elif v:
        print(f"vLLM LoRA did not run: {v['error'].strip().splitlines()[-1]}")
    print(f"wrote {out / 'bench_lora.json'}")
    _plot(r, out / "bench_lora.png")


if __name__ == "__main__":
    main()
