"""Benchmark: DDMA weight sync against gather-to-rank-0 + broadcast and the full-shm push, on equal work.

A ~100M-parameter Llama-shaped model (bf16, as Megatron holds it for a bf16 engine) is split over
trainer ranks (one process each, TP x PP x DP); generator workers (one process each, no vLLM: the
bench measures moving and laying out the bytes, which is what differs between the methods) end
each sync holding their engine tensors in vLLM's layout (fused qkv / gate_up, vocab-parallel
embeddings: ``megarl.ddma.layouts.vllm_param_layouts``).

Equal work, for every method:

- **Same destination**: a sync is done when every worker's bytes are in its *engine tensors* (one
  tensor per vLLM parameter, local layout), checked byte for byte against an independent reference
  (``hf_to_local`` of the same HF weights) after every timed sync, off the clock. A DDMA worker lands
  through ``DdmaReceiver.receive_into``: zero_copy writes each planned run straight into the engine
  tensor (an engine whose parameters are plain; vLLM-CPU repacks its own, so there it streams staging
  tensors to the loader); gloo / nccl copy each staging tensor in; the baselines narrow into it.
- **Same buffer state** (``--buffers``): ``warm``: the engine tensors are allocated once and reused by
  every method and trial (as a running engine's parameters are), and so are the buffers the
  baselines keep (rank 0's assembly and receive buffers, each worker's full-model receive buffer);
  ``cold``: all of those are allocated inside the timed sync. DDMA's per-parameter staging (gloo /
  nccl) and the shm push's file are allocated each sync in both, as their production code does.
- **Same checksums**: ``off`` for every method, or ``on`` for every method: each trainer rank computes
  DDMA's position-weighted checksums of the shard bytes it owns for each worker (the same code as a
  DDMA sender), publishes them in the store, and each worker checksums its engine tensors as they
  landed and compares (``DdmaReceiver.check_landed`` / ``verify_landed``), on the clock; the zero_copy
  worker digests each run in the copy that lands it (the same digest of the same bytes, one pass).

Methods (timed side by side in one run: every (method, checksums, buffers) variant once per round,
rounds interleaved, the order rotated each round, after one untimed warm-up round; best and median
of ``--trials`` rounds, ratios against gather+broadcast of the same variant):

- ``ddma_zero_copy``: receivers copy their runs straight out of the senders' shared memory.
- ``ddma_gloo``: gloo point-to-point in buckets of planned runs (``sync.bucket_mb``; ``p2p`` on CPU).
- ``ddma_nccl_gloo``: the nccl transport's rounds (the same bucket schedule, batched per round) over gloo.
- ``gather_broadcast``: every trainer rank sends its shards to rank 0, which assembles the full HF
  tensors in one buffer and sends it whole to every worker, which narrows it into its engine tensors.
- ``shm_push``: the path before DDMA: gather to rank 0, pack the full model into one shared-memory
  file (``pack_to_shm``), every worker maps it and narrows.
- ``memcpy`` (reference line): one process copying the bytes a worker lands, single thread, once per
  timed round (after that round's syncs: the same machine noise); beside it the checksum alone over
  the same bytes (one thread); best of the rounds.

Prints the table and writes ``sync.json`` and ``sync.png`` under ``--out``.

    megarl bench sync [--trainer 2,1,1] [--generator 1,1] [--trials 3] [--buffers warm,cold] [--out runs/bench]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
import traceback
import zlib
from datetime import timedelta
from pathlib import Path

import torch

from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, source_rank_layouts, vllm_param_layouts
from megarl.ddma.sync import DdmaReceiver, DdmaSender, SyncSpec, gloo_group, host_store
from megarl.models.layouts import ModelDims, hf_tensor_shapes, hf_to_local
from megarl.bench.sync_landing import landing_figures, print_landing  # noqa: F401 - the landing figure

DDMA_METHODS = {"ddma_zero_copy": "zero_copy", "ddma_gloo": "gloo", "ddma_nccl_gloo": "nccl"}
METHODS = (*DDMA_METHODS, "gather_broadcast", "shm_push")
BASELINE = "gather_broadcast"
CHECKS = (False, True)
BUFFERS = ("warm", "cold")
LABELS = {"ddma_zero_copy": "DDMA zero-copy", "ddma_gloo": "DDMA gloo (p2p)", "ddma_nccl_gloo": "DDMA nccl over gloo",
          "gather_broadcast": "gather+broadcast", "shm_push": "full-model shm push"}
BENCH_DIMS = dict(model_type="llama", num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=16000,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)
QUICK_DIMS = dict(BENCH_DIMS, num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=256, vocab_size=1000)  # --quick: a smoke run in seconds
TIMEOUT_S = 600.0


def variant(method: str, checks: bool, buffers: str) -> str:
    return f"{method}/checksums_{'on' if checks else 'off'}/{buffers}"


def _hf_weights(dims: ModelDims) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf_tensor_shapes(dims).items()}


BUCKET_MB = int(os.environ.get("MEGARL_BENCH_BUCKET_MB", "0"))  # set by --bucket-mb (0: sync.bucket_mb's default)


def _spec(dims, src, dst, ports, method: str, checks: bool) -> SyncSpec:
    """Each DDMA (method, checksums) pair has a rendezvous store of its own, as a job would: its
    transport's process group is created once per store."""
    bucket = {"bucket_bytes": BUCKET_MB << 20} if BUCKET_MB else {}
    return SyncSpec(dims=dims, src=src, dst=dst, store_host="127.0.0.1", store_port=ports[(method, checks)],
                    timeout_s=TIMEOUT_S, transport=DDMA_METHODS[method], verify_every=1 if checks else 0, **bucket)


def _digest(tensors: dict[str, torch.Tensor]) -> int:
    """CRC32 of the engine tensors' bytes, in layout order (off the clock)."""
    c = 0
    for t in tensors.values():
        c = zlib.crc32(t.contiguous().view(torch.uint8).numpy(), c)
    return c


def _padded(layout) -> bool:
    """Whether some of the tensor is vocab padding (rows no HF tensor covers: zero in the engine)."""
    covered = sum(math.prod(layout.local_shape) // layout.local_shape[p.dim] * p.length for p in layout.pieces)
    return covered < math.prod(layout.local_shape)


def _land_from_hf(dest: dict[str, torch.Tensor], get_hf, layouts, padded: set[str], on_landed=None) -> None:
    """The baselines' landing: narrow full HF tensors into the engine tensors (padding rows zeroed)."""
    for name, l in layouts.items():
        t = dest[name]
        if name in padded:
            t.zero_()
        for p in l.pieces:
            t.narrow(p.dim, p.local_start, p.length).copy_(get_hf(p.hf_name).narrow(p.dim, p.hf_start, p.length))
        if on_landed is not None:
            on_landed(name, t)


# ---------------------------------------------------------------- processes

class _Trainer:
    """One trainer rank: its shards, its DDMA senders, and the baselines' sending side."""

    def __init__(self, index, dims, src, dst, ports, store, pg):
        self.index, self.dims, self.src, self.dst, self.ports, self.store, self.pg = index, dims, src, dst, ports, store, pg
        self.src_ranks, self.n_dst = sorted(src.ranks()), len(dst.ranks())
        self.rank = self.src_ranks[index]
        hf = _hf_weights(dims)
        self.params = hf_to_local(hf.__getitem__, source_rank_layouts(dims, src, self.rank.tp, self.rank.pp))
        del hf
        self.senders: dict = {}
        self.warm: dict = {}  # the baselines' kept buffers (warm mode)
        self.lays = [source_rank_layouts(dims, src, r.tp, r.pp) for r in self.src_ranks]
        self.shapes = hf_tensor_shapes(dims)
        self.order = sorted(self.shapes)

    def sender(self, method: str, checks: bool) -> DdmaSender:
        key = (method, checks)
        if key not in self.senders:
            self.senders[key] = DdmaSender(_spec(self.dims, self.src, self.dst, self.ports, method, checks), self.rank,
                                           self.params)
        return self.senders[key]

    def _buf(self, warm: bool, key, make):
        if not warm:
            return make()
        if key not in self.warm:
            self.warm[key] = make()
        return self.warm[key]

    def sync(self, method: str, checks: bool, warm: bool, version: int) -> dict:
        if method in DDMA_METHODS:
            return self.sender(method, checks).sync(version)
        if checks:  # the same checksums a DDMA sender computes and publishes, of this rank's own shard
            s = self.sender("ddma_zero_copy", True)
            sums = s._checksums(s._wire_tensors()[0], {})
            self.store.set(f"bench/v{version}/sums{self.index}", pickle.dumps(sums))
        numel = sum(t.numel() for t in self.params.values())
        flat = self._buf(warm, "send", lambda: torch.empty(numel, dtype=torch.bfloat16))
        torch.cat([t.reshape(-1) for t in self.params.values()], out=flat)
        if self.index != 0:
            self.pg.send([flat], 0, 1).wait()
            return {}
        # rank 0: assemble the full HF tensors in one buffer (the broadcast sends it without a copy)
        total = sum(math.prod(s) for s in self.shapes.values())
        full = self._buf(warm, "full", lambda: torch.empty(total, dtype=torch.bfloat16))
        hf, off = {}, 0
        for n in self.order:
            k = math.prod(self.shapes[n])
            hf[n] = full[off:off + k].view(self.shapes[n])
            off += k
        for i, lay in enumerate(self.lays):
            if i == 0:
                buf = flat
            else:
                size = sum(math.prod(l.local_shape) for l in lay.values())
                buf = self._buf(warm, ("recv", i), lambda: torch.empty(size, dtype=torch.bfloat16))
                self.pg.recv([buf], i, 1).wait()
            off = 0
            for l in lay.values():
                n = math.prod(l.local_shape)
                local = buf[off:off + n].view(l.local_shape)
                off += n
                for p in l.pieces:
                    hf[p.hf_name].narrow(p.dim, p.hf_start, p.length).copy_(local.narrow(p.dim, p.local_start, p.length))
        n_src = len(self.src_ranks)
        if method == "gather_broadcast":
            works = [self.pg.send([full], n_src + j, 2) for j in range(self.n_dst)]
            for w in works:
                w.wait()
        else:
            from megarl.generator.shm_source import pack_to_shm

            shm = pack_to_shm([(n, hf[n]) for n in self.order])
            self.store.set(f"bench/v{version}/shm", pickle.dumps(shm.source()))
            self.store.wait([f"bench/v{version}/shmdone{j}" for j in range(self.n_dst)], timedelta(seconds=TIMEOUT_S))
            shm.unlink()
        return {"rank0_full_model_bytes": 2 * total}


class _Worker:
    """One generator worker: its engine tensors, its DDMA receivers, the baselines' receiving side."""

    def __init__(self, index, dims, src, dst, ports, store, pg):
        self.index, self.dims, self.src, self.dst, self.ports, self.store, self.pg = index, dims, src, dst, ports, store, pg
        self.n_src = len(src.ranks())
        self.rank = sorted(dst.ranks())[index]
        self.layouts = vllm_param_layouts(dims, dst.tp, self.rank.tp, dst.vocab_padding)
        self.padded = {n for n, l in self.layouts.items() if _padded(l)}
        hf = _hf_weights(dims)
        self.reference = _digest(hf_to_local(hf.__getitem__, self.layouts))  # independent of every method
        del hf
        self.engine = self.alloc()
        for t in self.engine.values():
            t.zero_()  # fault the pages in: a running engine's parameters
        self.receivers: dict = {}
        self.warm: dict = {}
        self.shapes = hf_tensor_shapes(dims)
        self.order = sorted(self.shapes)

    def alloc(self) -> dict[str, torch.Tensor]:
        return {n: torch.empty(l.local_shape, dtype=torch.bfloat16) for n, l in self.layouts.items()}

    def receiver(self, method: str, checks: bool) -> DdmaReceiver:
        key = (method, checks)
        if key not in self.receivers:
            self.receivers[key] = DdmaReceiver(_spec(self.dims, self.src, self.dst, self.ports, method, checks),
                                               self.rank)
        return self.receivers[key]

    def poison(self) -> None:
        """Before a warm sync, off the clock: every engine byte the method must write is 0xFF (NaN)."""
        for t in self.engine.values():
            t.view(torch.int16).fill_(-1)

    def sync(self, method: str, checks: bool, warm: bool, version: int) -> tuple[dict, dict]:
        dest = self.engine if warm else self.alloc()
        if method in DDMA_METHODS:
            r = self.receiver(method, checks)
            # into the engine tensors (plain, as a bf16 engine's on GPU): zero_copy lands the runs there
            # (digested as copied); gloo / nccl copy each staging tensor in, then checksum it as it landed
            r.receive_into(version, dest)
            return dest, dict(r.last_stats)
        chk = self.receiver("ddma_zero_copy", True) if checks else None
        if checks:
            keys = [f"bench/v{version}/sums{i}" for i in range(self.n_src)]
            self.store.wait(keys, timedelta(seconds=TIMEOUT_S))
            chk.begin_landing({s: {"sums": pickle.loads(self.store.get(k))} for s, k in zip(chk.src_ranks, keys)})
        on_landed = chk.check_landed if checks else None
        if method == "gather_broadcast":
            total = sum(math.prod(s) for s in self.shapes.values())
            if not warm or "full" not in self.warm:
                self.warm["full"] = torch.empty(total, dtype=torch.bfloat16)
            full = self.warm["full"]
            self.pg.recv([full], 0, 2).wait()
            views, off = {}, 0
            for n in self.order:
                k = math.prod(self.shapes[n])
                views[n] = full[off:off + k].view(self.shapes[n])
                off += k
            _land_from_hf(dest, views.__getitem__, self.layouts, self.padded, on_landed)
        else:
            from megarl.generator import shm_source  # noqa: F401 - registers "shm"
            from megarl.generator.weight_source import open_weight_source

            self.store.wait([f"bench/v{version}/shm"], timedelta(seconds=TIMEOUT_S))
            views = dict(open_weight_source(pickle.loads(self.store.get(f"bench/v{version}/shm"))))
            _land_from_hf(dest, views.__getitem__, self.layouts, self.padded, on_landed)
            del views
            self.store.set(f"bench/v{version}/shmdone{self.index}", b"1")
        if checks:
            chk.verify_landed(version)
        return dest, {}


def _role_main(role: str, index: int, dims, src, dst, port: int, ports: dict, cmds, out) -> None:
    try:
        torch.set_num_threads(1)
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        n_src = len(src.ranks())
        me = index if role == "src" else n_src + index
        pg = gloo_group(store, me, n_src + len(dst.ranks()), TIMEOUT_S, prefix="bench/gloo")
        side = (_Trainer if role == "src" else _Worker)(index, dims, src, dst, ports, store, pg)
        out.put(("ready", role, index, getattr(side, "reference", None)))
        while True:
            cmd = cmds.get(timeout=TIMEOUT_S)
            if cmd[0] == "exit":
                return
            _, method, checks, buffers, version = cmd
            warm = buffers == "warm"
            if role == "dst" and warm:
                side.poison()
            out.put(("armed", role, index, None))
            store.wait([f"bench/go{version}"], timedelta(seconds=TIMEOUT_S))
            if role == "src":
                info = side.sync(method, checks, warm, version)
                out.put(("done", role, index, (time.monotonic(), info, None)))
                continue
            dest, info = side.sync(method, checks, warm, version)
            t_end = time.monotonic()
            info["bytes_landed"] = sum(t.numel() * t.element_size() for t in dest.values())
            out.put(("done", role, index, (t_end, info, _digest(dest))))
            del dest
    except BaseException:  # noqa: BLE001
        out.put(("error", role, index, traceback.format_exc()))


def _memcpy_seconds(nbytes: int, trials: int) -> float:
    torch.set_num_threads(1)
    a = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    b = torch.empty(nbytes, dtype=torch.uint8)
    b.copy_(a)  # warm destination, like the engine tensors
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return best


def _checksum_seconds(nbytes: int, trials: int) -> float:
    """DDMA's verification checksum alone (``checksum_segments``: the C++ kernel when built) over
    ``nbytes`` of bf16, one segment, one thread, best of ``trials``: the line beside memcpy."""
    from megarl.ddma.verify import checksum_segments

    torch.set_num_threads(1)
    flat = torch.empty(nbytes // 2, dtype=torch.int16).random_().view(torch.bfloat16)
    segs = (torch.tensor([0]), torch.tensor([flat.numel()]), torch.tensor([0]))
    checksum_segments(flat, segs)  # warm: pages in, kernel chosen
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        checksum_segments(flat, segs)
        best = min(best, time.perf_counter() - t)
    return best


def run(args) -> dict:
    dims = ModelDims.from_hf_config(QUICK_DIMS if args.quick else BENCH_DIMS)
    src = TrainerTopology(*args.trainer)
    dst = GeneratorTopology(*args.generator)
    params = sum(math.prod(s) for s in hf_tensor_shapes(dims).values())
    variants = [(m, c, b) for b in args.buffers for c in CHECKS for m in METHODS]
    print(f"bench sync: {params / 1e6:.0f}M parameters (bf16), trainer tp x pp x dp = {args.trainer}, "
          f"generator tp x replicas = {args.generator}; {len(variants)} variants (method x checksums off/on x "
          f"buffers {'/'.join(args.buffers)}), 1 warm-up + {args.trials} interleaved round(s)")
    store = host_store()
    ddma_stores = {(m, c): host_store() for m in DDMA_METHODS for c in CHECKS}
    ports = {k: st.port for k, st in ddma_stores.items()}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    roles = [("src", i) for i in range(len(src.ranks()))] + [("dst", j) for j in range(len(dst.ranks()))]
    cmds = {r: ctx.Queue() for r in roles}
    procs = [ctx.Process(target=_role_main, args=(r[0], r[1], dims, src, dst, store.port, ports, cmds[r], out), daemon=True)
             for r in roles]
    for p in procs:
        p.start()

    def collect(kind):
        got = {}
        for _ in roles:
            k, role, index, payload = out.get(timeout=TIMEOUT_S)
            if k == "error":
                raise RuntimeError(f"{role} {index} failed:\n{payload}")
            if k != kind:
                raise RuntimeError(f"{role} {index}: expected {kind!r}, got {k!r}")
            got[(role, index)] = payload
        return got

    results: dict[str, dict] = {variant(*v): {"method": v[0], "checksums": v[1], "buffers": v[2], "seconds": [],
                                              "digests": None} for v in variants}
    version = 0
    memcpy_rounds: list[float] = []
    checksum_rounds: list[float] = []
    try:
        reference = {k[1]: d for k, d in collect("ready").items() if k[0] == "dst"}
        for rnd in range(args.trials + 1):  # round 0: warm-up (plans, groups, shared memory, maps), untimed
            shift = rnd % len(variants)
            for v in variants[shift:] + variants[:shift]:
                version += 1
                for r in roles:
                    cmds[r].put(("run", *v, version))
                collect("armed")  # every rank waits on the go key; the workers' engine tensors are poisoned
                t0 = time.monotonic()
                store.set(f"bench/go{version}", b"1")
                got = collect("done")
                # done when every worker holds its bytes in its engine tensors (DDMA senders may
                # return later: they wait for the workers' acks)
                seconds = max(t for (role, _), (t, _, _) in got.items() if role == "dst") - t0
                digests = {k[1]: d for k, (_, _, d) in got.items() if k[0] == "dst"}
                name = variant(*v)
                if digests != reference:
                    bad = [j for j in reference if digests[j] != reference[j]]
                    raise SystemExit(f"bench sync: {name} landed other bytes than the reference on worker(s) {bad}: "
                                     "a bug, not a speed")
                res = results[name]
                res["digests"] = digests
                res["bytes_landed_per_worker"] = max(i["bytes_landed"] for (role, _), (_, i, _) in got.items()
                                                     if role == "dst")
                if rnd == 0:
                    continue
                res["seconds"].append(seconds)
                res.setdefault("infos", []).append({f"{k[0]}{k[1]}": val[1] for k, val in got.items()})
                print(f"  round {rnd} {name:<40} {seconds:7.3f} s")
            if rnd:  # the reference lines in the same rounds, under the same machine noise as the syncs
                nb = results[variant(*variants[0])]["bytes_landed_per_worker"]
                memcpy_rounds.append(_memcpy_seconds(nb, 1))
                checksum_rounds.append(_checksum_seconds(nb, 1))
    finally:
        for r in roles:
            cmds[r].put(("exit",))
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    nbytes = results[variant(*variants[0])]["bytes_landed_per_worker"]
    for res in results.values():
        res["best_s"], res["median_s"] = min(res["seconds"]), statistics.median(res["seconds"])
        res["gb_per_s_best"] = nbytes / res["best_s"] / 1e9
    for name, res in results.items():
        base = results[variant(BASELINE, res["checksums"], res["buffers"])]
        res["vs_gather_broadcast_best"] = base["best_s"] / res["best_s"]
        res["vs_gather_broadcast_median"] = base["median_s"] / res["median_s"]
        # per round, side by side: the baseline's time in that round over this method's
        res["vs_gather_broadcast_per_round"] = [b / s for b, s in zip(base["seconds"], res["seconds"])]
    memcpy, checksum = min(memcpy_rounds), min(checksum_rounds)  # best of the rounds, as the syncs' best
    # flat view (older readers: megarl/sim/micro.py reads best_seconds.ddma_zero_copy_verify)
    best_seconds = {}
    for res in results.values():
        k = res["method"] + ("_verify" if res["checksums"] else "") + ("" if res["buffers"] == "warm" else "_cold")
        best_seconds[k] = res["best_s"]
    best_seconds["memcpy"] = memcpy
    summary = {
        "model_parameters": params, "trainer": args.trainer, "generator": args.generator, "trials": args.trials,
        "buffers": list(args.buffers), "host_cpus": os.cpu_count(), "bytes_landed_per_worker": nbytes,
        "equal_work": ("every method lands every worker's bytes in its vLLM-layout engine tensors, checked against "
                       "an independent reference after each sync; warm = engine tensors (and the baselines' kept "
                       "buffers) allocated once and reused by every method, cold = allocated inside the timed sync; "
                       "checksums on = trainer ranks checksum their shards and workers their engine tensors, "
                       "for every method"),
        "variants": results, "best_seconds": best_seconds, "memcpy_s": memcpy,
        "memcpy_gb_per_s": nbytes / memcpy / 1e9, "checksum_s": checksum,
        "checksum_gb_per_s": nbytes / checksum / 1e9,
        "zero_copy_verify_vs_memcpy": memcpy / results[variant("ddma_zero_copy", True, args.buffers[0])]["best_s"],
    }
    print(f"\n{'method':<22}{'checksums':>10}{'buffers':>8}{'best s':>9}{'median s':>10}{'GB/s':>7}"
          f"{'vs g+b best':>13}{'median':>8}")
    for res in results.values():
        print(f"{res['method']:<22}{'on' if res['checksums'] else 'off':>10}{res['buffers']:>8}{res['best_s']:9.3f}"
              f"{res['median_s']:10.3f}{res['gb_per_s_best']:7.2f}{res['vs_gather_broadcast_best']:12.1f}x"
              f"{res['vs_gather_broadcast_median']:7.1f}x")
    print(f"{'memcpy (1 thread)':<40}{memcpy:9.3f}{'':>10}{summary['memcpy_gb_per_s']:7.2f}")
    print(f"{'checksum alone (1 thread)':<40}{checksum:9.3f}{'':>10}{summary['checksum_gb_per_s']:7.2f}")
    print(f"zero-copy with checksums on ({args.buffers[0]}): {100 * summary['zero_copy_verify_vs_memcpy']:.0f}% of memcpy")
    summary["landing"] = landing_figures(dims, src, dst, args.trials)
    print_landing(summary["landing"])
    return summary


def _plot(summary: dict, path: Path) -> None:
    from megarl.utils.plots import pyplot, save

    plt = pyplot("the sync bench")
    if plt is None:
        return
    buffers = summary["buffers"]
    fig, axes = plt.subplots(1, len(buffers), figsize=(7 * len(buffers), 4.2), squeeze=False)
    for ax, buf in zip(axes[0], buffers):
        y = range(len(METHODS))
        for k, checks in enumerate(CHECKS):
            rows = [summary["variants"][variant(m, checks, buf)] for m in METHODS]
            med = [r["median_s"] for r in rows]
            bars = ax.barh([i + (k - 0.5) * 0.4 for i in y], med, height=0.38,
                           color="#ff7f0e" if checks else "#1f77b4", label=f"checksums {'on' if checks else 'off'}")
            ax.bar_label(bars, labels=[f"{r['median_s']:.3f} s ({r['vs_gather_broadcast_median']:.1f}x)"
                                       for r in rows], fontsize=7, padding=2)
            ax.plot([r["best_s"] for r in rows], [i + (k - 0.5) * 0.4 for i in y], "k|", markersize=8)
        ax.set_yticks(list(y), [LABELS[m] for m in METHODS])
        ax.invert_yaxis()
        ax.margins(x=0.35)  # room for the labels
        ax.set_xlabel("seconds per sync, median (bar) and best (|); (x) = vs gather+broadcast")
        ax.set_title(f"{buf} engine tensors")
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"weight sync, {summary['model_parameters'] / 1e6:.0f}M params bf16, trainer {summary['trainer']}"
                 f" -> generator {summary['generator']}, landed in vLLM-layout tensors")
    save(fig, path, dpi=100)


def _topology(text: str, n: int) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != n or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected {n} positive integers separated by commas, got {text!r}")
    return parts


def _buffers(text: str) -> tuple[str, ...]:
    parts = tuple(x.strip() for x in text.split(",") if x.strip())
    if not parts or any(p not in BUFFERS for p in parts):
        raise argparse.ArgumentTypeError(f"expected warm, cold or warm,cold, got {text!r}")
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="megarl bench sync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", type=lambda t: _topology(t, 3), default=(2, 1, 1), help="tp,pp,dp (default 2,1,1)")
    p.add_argument("--generator", type=lambda t: _topology(t, 2), default=(1, 1), help="tp,replicas (default 1,1)")
    p.add_argument("--trials", type=int, default=3, help="timed rounds (each variant once per round; best and median)")
    p.add_argument("--buffers", type=_buffers, default=BUFFERS, help="warm, cold or warm,cold (default both)")
    p.add_argument("--out", default="runs/bench", help="folder for sync.json and sync.png")
    p.add_argument("--quick", action="store_true", help="a ~1M-parameter model, for a smoke run")
    p.add_argument("--landing-only", action="store_true",
                   help="only the landing figure (index bytes, landing time before/after issue 46), into "
                        "sync_landing.json")
    p.add_argument("--bucket-mb", type=int, default=0,
                   help="sync.bucket_mb of the DDMA methods (MiB; default 0 = the config default)")
    args = p.parse_args(argv)
    if args.bucket_mb:  # the role processes are spawned: they read it from the environment
        global BUCKET_MB
        BUCKET_MB = args.bucket_mb
        os.environ["MEGARL_BENCH_BUCKET_MB"] = str(args.bucket_mb)
    if args.trials < 1:
        p.error("--trials must be >= 1")
    if args.landing_only:
        dims = ModelDims.from_hf_config(QUICK_DIMS if args.quick else BENCH_DIMS)
        fig = landing_figures(dims, TrainerTopology(*args.trainer), GeneratorTopology(*args.generator), args.trials)
        fig.update(model_parameters=sum(math.prod(s) for s in hf_tensor_shapes(dims).values()),
                   trainer=args.trainer, generator=args.generator, host_cpus=os.cpu_count())
        print_landing(fig)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sync_landing.json").write_text(json.dumps(fig, indent=1))
        print(f"wrote {out / 'sync_landing.json'}")
        return 0
    summary = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync.json").write_text(json.dumps(summary, indent=1, default=str))
    _plot(summary, out / "sync.png")
    print(f"wrote {out / 'sync.json'} and {out / 'sync.png'}")
    return 0


if __name__ == "__main__":
    from megarl.utils.errors import run_main

    sys.exit(run_main(main, "megarl bench sync"))  # a failure: one line, the exit code of its class
