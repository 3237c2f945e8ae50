"""Benchmark: DDMA weight sync against gather-to-rank-0 + broadcast and the full-shm push, one run.

A ~100M-parameter Llama-shaped model (bf16, as Megatron holds it for a bf16 engine) is split over
trainer ranks (one process each, TP x PP x DP); generator workers (one process each, no vLLM: the
bench measures moving and laying out the bytes, which is what differs between the methods) end
each sync holding their local tensors in vLLM's layout. Methods, timed side by side, alternating,
``--trials`` times each (best kept; these machines are noisy):

- ``ddma_zero_copy``: receivers read their runs straight out of the senders' memory.
- ``ddma_zero_copy_verify``: the same with the per-slice checksums on both sides.
- ``ddma_p2p``: gloo point-to-point, one message per (destination, parameter).
- ``gather_broadcast``: every trainer rank sends its shards to rank 0, which assembles the full
  HF tensors and sends the whole model to every worker, which narrows it to its shard.
- ``shm_push``: today's path: gather to rank 0, pack the full model into one shared-memory file,
  every worker maps it and narrows.
- ``memcpy``: one process copying the bytes a worker lands, single thread: the ceiling of a
  one-copy transfer on this host.

Every method must land identical bytes (checked). Prints GB/s of bytes landed per worker, the
ratios, and writes ``sync.json`` and ``sync.png`` under ``--out``.

    megarl bench sync [--trainer 2,1,1] [--generator 1,1] [--trials 3] [--out runs/bench]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, source_rank_layouts, vllm_param_layouts
from megarl.ddma.sync import DdmaReceiver, DdmaSender, SyncSpec, gloo_group, host_store
from megarl.models.layouts import ModelDims, hf_tensor_shapes, hf_to_local

METHODS = ("ddma_zero_copy", "ddma_zero_copy_verify", "ddma_p2p", "gather_broadcast", "shm_push")
BENCH_DIMS = dict(model_type="llama", num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=16000,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
QUICK_DIMS = dict(BENCH_DIMS, num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=256, vocab_size=1000)  # --quick: a smoke run in seconds
TIMEOUT_S = 600.0


def _hf_weights(dims: ModelDims) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf_tensor_shapes(dims).items()}


def _specs(dims, src, dst, port):
    base = dict(dims=dims, src=src, dst=dst, store_host="127.0.0.1", store_port=port, timeout_s=TIMEOUT_S)
    return {"ddma_zero_copy": SyncSpec(**base, verify_every=0),
            "ddma_zero_copy_verify": SyncSpec(**base, verify_every=1),
            "ddma_p2p": SyncSpec(**base, transport="p2p", verify_every=0)}


# ---------------------------------------------------------------- the baselines (rank 0 gathers)

def _gather_to_rank0(pg, me: int, src_ranks, params, dims, src) -> dict[str, torch.Tensor] | None:
    """Trainer ranks send every shard to rank 0, which assembles full HF tensors."""
    flat = torch.cat([t.reshape(-1) for t in params.values()])
    if me != 0:
        pg.send([flat], 0, 1).wait()
        return None
    hf = {n: torch.empty(s, dtype=torch.bfloat16) for n, s in hf_tensor_shapes(dims).items()}
    for i, r in enumerate(src_ranks):
        lay = source_rank_layouts(dims, src, r.tp, r.pp)
        if i == 0:
            buf = flat
        else:
            buf = torch.empty(sum(math.prod(l.local_shape) for l in lay.values()), dtype=torch.bfloat16)
            pg.recv([buf], i, 1).wait()
        off = 0
        for name, l in lay.items():
            n = math.prod(l.local_shape)
            local = buf[off:off + n].view(l.local_shape)
            off += n
            for p in l.pieces:
                hf[p.hf_name].narrow(p.dim, p.hf_start, p.length).copy_(local.narrow(p.dim, p.local_start, p.length))
    return hf


def _narrow_into_layout(get_hf, layouts) -> dict[str, torch.Tensor]:
    out = {}
    for name, l in layouts.items():
        t = torch.zeros(l.local_shape, dtype=torch.bfloat16)
        for p in l.pieces:
            t.narrow(p.dim, p.local_start, p.length).copy_(get_hf(p.hf_name).narrow(p.dim, p.hf_start, p.length))
        out[name] = t
    return out


# ---------------------------------------------------------------- processes

def _role_main(role: str, index: int, dims, src, dst, port: int, cmds, out) -> None:
    try:
        torch.set_num_threads(1)
        specs = _specs(dims, src, dst, port)
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        src_ranks, dst_ranks = src.ranks(), dst.ranks()
        src_ranks.sort()
        dst_ranks.sort()
        n_src = len(src_ranks)
        me = index if role == "src" else n_src + index
        sides = {}
        params = None
        if role == "src":
            r = src_ranks[index]
            hf = _hf_weights(dims)
            params = hf_to_local(hf.__getitem__, source_rank_layouts(dims, src, r.tp, r.pp))
            del hf
        else:
            layouts = vllm_param_layouts(dims, dst.tp, dst_ranks[index].tp, dst.vocab_padding)
        pg = gloo_group(store, me, n_src + len(dst_ranks), TIMEOUT_S, prefix="bench/gloo")
        out.put(("ready", role, index, None))
        version = 0
        while True:
            cmd = cmds.get(timeout=TIMEOUT_S)
            if cmd[0] == "exit":
                return
            method = cmd[1]
            version += 1
            store.wait([f"go{version}"], timedelta(seconds=TIMEOUT_S))
            landed: dict[str, torch.Tensor] = {}
            digest_live: dict[str, int] = {}
            nbytes_live, off_clock = 0, 0.0
            info: dict = {}
            if method.startswith("ddma"):
                spec = specs[method]
                if role == "src":
                    key = (method, "s")
                    if key not in sides:
                        sides[key] = DdmaSender(spec, src_ranks[index], params)
                    info = sides[key].sync(version)
                else:
                    key = (method, "r")
                    if key not in sides:
                        sides[key] = DdmaReceiver(spec, dst_ranks[index])
                    # The staging tensor is reused (valid until the next item, like the engine's
                    # loader sees it): digest it on the fly, off the clock.
                    for n, t in sides[key].receive(version):
                        d0 = time.monotonic()
                        digest_live[n] = int(t.view(torch.int16).to(torch.int64).sum())
                        nbytes_live += t.numel() * t.element_size()
                        off_clock += time.monotonic() - d0
                    info = sides[key].last_stats
            elif role == "src":
                hf = _gather_to_rank0(pg, me, src_ranks, params, dims, src)
                if hf is not None and method == "gather_broadcast":
                    flat = torch.cat([hf[n].reshape(-1) for n in sorted(hf)])
                    for j in range(len(dst_ranks)):
                        pg.send([flat], n_src + j, 2).wait()
                elif hf is not None:
                    from megarl.generator.shm_source import pack_to_shm

                    shm = pack_to_shm(sorted(hf.items()))
                    store.set(f"shm{version}", pickle.dumps(shm.source()))
                    store.wait([f"shmdone{version}/{j}" for j in range(len(dst_ranks))], timedelta(seconds=TIMEOUT_S))
                    shm.unlink()
                info = {"rank0_full_model_bytes": sum(t.numel() * 2 for t in hf.values())} if hf else {}
                del hf
            else:
                shapes = hf_tensor_shapes(dims)
                if method == "gather_broadcast":
                    flat = torch.empty(sum(math.prod(s) for s in shapes.values()), dtype=torch.bfloat16)
                    pg.recv([flat], 0, 2).wait()
                    views, off = {}, 0
                    for n in sorted(shapes):
                        k = math.prod(shapes[n])
                        views[n] = flat[off:off + k].view(shapes[n])
                        off += k
                    landed = _narrow_into_layout(views.__getitem__, layouts)
                    del flat, views
                else:
                    from megarl.generator import shm_source  # noqa: F401 - registers "shm"
                    from megarl.generator.weight_source import open_weight_source

                    source = pickle.loads(store.get(f"shm{version}"))
                    views = dict(open_weight_source(source))
                    landed = _narrow_into_layout(views.__getitem__, layouts)
                    del views
                    store.set(f"shmdone{version}/{index}", b"1")
            t_end = time.monotonic() - off_clock
            digest = None
            if role == "dst":
                info["bytes_landed"] = nbytes_live + sum(t.numel() * t.element_size() for t in landed.values())
                digest = digest_live or {n: int(t.view(torch.int16).to(torch.int64).sum()) for n, t in landed.items()}
            out.put(("done", role, index, (t_end, info, digest)))
            del landed
    except BaseException:  # noqa: BLE001
        out.put(("error", role, index, traceback.format_exc()))


def _memcpy_seconds(nbytes: int, trials: int) -> float:
    torch.set_num_threads(1)
    a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8)
    b.copy_(a)  # fault the pages in first: a sync's staging is fresh memory, so this is generous
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return best


def run(args) -> dict:
    dims = ModelDims.from_hf_config(QUICK_DIMS if args.quick else BENCH_DIMS)
    src = TrainerTopology(*args.trainer)
    dst = GeneratorTopology(*args.generator)
    params = sum(math.prod(s) for s in hf_tensor_shapes(dims).values())
    print(f"bench sync: {params / 1e6:.0f}M parameters (bf16), trainer tp x pp x dp = {args.trainer}, "
          f"generator tp x replicas = {args.generator}, {args.trials} trial(s) per method")
    store = host_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    roles = [("src", i) for i in range(len(src.ranks()))] + [("dst", j) for j in range(len(dst.ranks()))]
    cmds = {r: ctx.Queue() for r in roles}
    procs = [ctx.Process(target=_role_main, args=(r[0], r[1], dims, src, dst, store.port, cmds[r], out), daemon=True)
             for r in roles]
    for p in procs:
        p.start()

    def collect(kind):
        got = {}
        for _ in roles:
            k, role, index, payload = out.get(timeout=TIMEOUT_S)
            if k == "error":
                raise RuntimeError(f"{role} {index} failed:\n{payload}")
            got[(role, index)] = payload
        return got

    results: dict[str, list[dict]] = {m: [] for m in METHODS}
    digests: dict[str, dict] = {}
    version = 0
    try:
        collect("ready")
        for trial in range(args.trials):
            for method in METHODS:
                version += 1
                for r in roles:
                    cmds[r].put(("run", method))
                time.sleep(0.2)  # everyone is blocked on the go key
                t0 = time.monotonic()
                store.set(f"go{version}", b"1")
                got = collect("done")
                # a sync is done when every worker holds its bytes (senders may return later: they
                # wait for the workers' done keys)
                seconds = max(t for (role, _), (t, _, _) in got.items() if role == "dst") - t0
                landed = [info["bytes_landed"] for (role, _), (_, info, _) in got.items() if role == "dst"]
                results[method].append({"seconds": seconds, "bytes_landed_per_worker": max(landed),
                                        "infos": {f"{k[0]}{k[1]}": v[1] for k, v in got.items()}})
                digests[method] = {k: v[2] for k, v in got.items() if k[0] == "dst"}
                print(f"  trial {trial + 1} {method:<22} {seconds:7.3f} s")
    finally:
        for r in roles:
            cmds[r].put(("exit",))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    ref = digests[METHODS[0]]
    for m in METHODS[1:]:
        if digests[m] != ref:
            raise SystemExit(f"bench sync: {m} landed other bytes than {METHODS[0]}: a bug, not a speed")
    nbytes = results[METHODS[0]][0]["bytes_landed_per_worker"]
    best = {m: min(r["seconds"] for r in results[m]) for m in METHODS}
    best["memcpy"] = _memcpy_seconds(nbytes, args.trials)
    gbps = {m: nbytes / s / 1e9 for m, s in best.items()}
    summary = {
        "model_parameters": params, "trainer": args.trainer, "generator": args.generator, "trials": args.trials,
        "bytes_landed_per_worker": nbytes, "best_seconds": best, "gb_per_s": gbps,
        "ddma_vs_gather_broadcast": best["gather_broadcast"] / best["ddma_zero_copy"],
        "ddma_vs_shm_push": best["shm_push"] / best["ddma_zero_copy"],
        "ddma_p2p_vs_gather_broadcast": best["gather_broadcast"] / best["ddma_p2p"],
        "zero_copy_fraction_of_memcpy": gbps["ddma_zero_copy"] / gbps["memcpy"],
        "verify_overhead": best["ddma_zero_copy_verify"] / best["ddma_zero_copy"],
        "trials_detail": results, "host_cpus": os.cpu_count(),
    }
    print(f"\n{'method':<24}{'best s':>9}{'GB/s':>9}")
    for m in (*METHODS, "memcpy"):
        print(f"{m:<24}{best[m]:9.3f}{gbps[m]:9.2f}")
    print(f"\nDDMA zero-copy vs gather+broadcast: {summary['ddma_vs_gather_broadcast']:.2f}x | vs shm push: "
          f"{summary['ddma_vs_shm_push']:.2f}x | DDMA p2p vs gather+broadcast: "
          f"{summary['ddma_p2p_vs_gather_broadcast']:.2f}x\nzero-copy at "
          f"{100 * summary['zero_copy_fraction_of_memcpy']:.0f}% of the single-thread memcpy ceiling; "
          f"verification costs {summary['verify_overhead']:.2f}x")
    return summary


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*METHODS, "memcpy"]
    vals = [summary["gb_per_s"][m] for m in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.barh(names, vals, color=["#1f77b4"] * 3 + ["#d62728", "#ff7f0e", "#7f7f7f"])
    ax.bar_label(bars, fmt="%.2f GB/s")
    ax.invert_yaxis()
    ax.set_xlabel("GB/s landed per generator worker (higher is better)")
    ax.set_title(f"weight sync, {summary['model_parameters'] / 1e6:.0f}M params bf16, trainer {summary['trainer']}"
                 f" -> generator {summary['generator']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _topology(text: str, n: int) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != n or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected {n} positive integers separated by commas, got {text!r}")
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", type=lambda t: _topology(t, 3), default=(2, 1, 1), help="tp,pp,dp (default 2,1,1)")
    p.add_argument("--generator", type=lambda t: _topology(t, 2), default=(1, 1), help="tp,replicas (default 1,1)")
    p.add_argument("--trials", type=int, default=3, help="timed trials per method (best kept)")
    p.add_argument("--out", default="runs/bench", help="folder for sync.json and sync.png")
    p.add_argument("--quick", action="store_true", help="a ~1M-parameter model, for a smoke run")
    args = p.parse_args(argv)
    summary = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync.json").write_text(json.dumps(summary, indent=1, default=str))
    _plot(summary, out / "sync.png")
    print(f"wrote {out / 'sync.json'} and {out / 'sync.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
