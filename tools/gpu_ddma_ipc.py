"""GPU check 3 + 5: DDMA over CUDA IPC between processes on one GPU, and its bandwidth.

A TP2 trainer (two sender processes holding CUDA parameters) syncs into a TP1 receiver, then into
a TP2 receiver (two processes), both holding CUDA tensors in vLLM's layout; every sync is checked
exactly against a CPU execution of the plan, with checksums on. Device memory must stay flat over
the syncs (after the first two warm-up syncs: memory_allocated equal on every process, and
cudaMemGetInfo's free memory within one bucket). ``--bench``: GB/s of a cuda_ipc sync (the worker's
transfer time over the bytes landed) against a device-to-device copy of the same bytes.

Imports torch and megarl modules that need neither vLLM nor Megatron. Prints one JSON line.
``--cpu-dry``: the same control flow on CPU, with the four CUDA calls done on host memory (the
stand-in below; no GPU proves anything here, it only shows the script's logic and failure exits).
``MEGARL_GPU_CHECK_PLANT=ipc`` corrupts one landed byte on purpose: the check must fail.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, source_rank_layouts  # noqa: E402
from megarl.models.layouts import ModelDims, hf_to_local  # noqa: E402

SMALL = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=1000, rms_norm_eps=1e-5, tie_word_embeddings=False)
# ~100M parameters in bf16 (the CPU bench's model): 12 layers of 768 / 3072, vocab 32000
BENCH = dict(model_type="llama", hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_key_value_heads=4,
             num_hidden_layers=12, vocab_size=32000, rms_norm_eps=1e-5, tie_word_embeddings=False)


class HostIpcStandIn:
    """--cpu-dry only: the transport's four CUDA calls on host memory (shared-memory files)."""

    device_type = "cpu"

    def export(self, storage_bytes):
        from megarl.ddma.zero_copy import share

        e = share(storage_bytes)
        return (os.getpid(), e["fd"], e["size"])

    def open(self, handle, device):
        from megarl.ddma.zero_copy import map_shared

        return map_shared(*handle)

    def synchronize(self, device):
        pass

    def collect(self):
        pass


def _dev(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def _hf(dims: ModelDims, version: int) -> dict[str, torch.Tensor]:
    from megarl.models.layouts import hf_tensor_shapes

    g = torch.Generator().manual_seed(1000 + version)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in hf_tensor_shapes(dims).items()}


def _mem(dry: bool) -> dict:
    if dry:
        return {"allocated": 0, "free": 0}
    torch.cuda.synchronize()
    return {"allocated": torch.cuda.memory_allocated(), "free": torch.cuda.mem_get_info()[0]}


def _setup(dry: bool):
    if dry:
        from megarl.ddma.transport import cuda_ipc

        cuda_ipc.IPC_OPS = HostIpcStandIn()


def _sender(spec, rank, versions, dry, q):
    try:
        from megarl.ddma.sync import DdmaSender

        _setup(dry)
        layouts = source_rank_layouts(spec.dims, spec.src, rank.tp, rank.pp)
        sender, mems = None, []
        for v in versions:
            params = {n: t.to(_dev(dry)) for n, t in hf_to_local(_hf(spec.dims, v).__getitem__, layouts).items()}
            if sender is None:
                sender = DdmaSender(spec, rank, params)
            else:  # in place, as an optimizer step
                for n, t in params.items():
                    sender.params[n].copy_(t)
            del params
            stats = sender.sync(v)
            mems.append(_mem(dry))
            q.put(("sent", str(rank), v, stats))
        q.put(("mem", str(rank), 0, mems))
    except BaseException:  # noqa: BLE001
        q.put(("error", str(rank), 0, traceback.format_exc()))


def _receiver(spec, rank, versions, dry, plant, check, q):
    try:
        from megarl.ddma.plan import execute_plan_ref, plan_sync
        from megarl.ddma.sync import DdmaReceiver

        _setup(dry)
        recv = DdmaReceiver(spec, rank, device=_dev(dry))
        mems, bad = [], []
        plan = plan_sync(spec.dims, spec.src, spec.dst) if check else None
        for v in versions:
            from datetime import timedelta

            # timed from when every sender has published (not while they make new weights)
            recv.store.wait([f"ddma/v{v}/src{recv.group_rank(s)}" for s in recv.src_ranks], timedelta(seconds=600))
            t0 = time.perf_counter()
            landed = {}
            for name, staging in recv.stream(v):
                if plant and v == versions[-1] and not landed:
                    staging.view(-1)[0] += 1  # the planted failure: one wrong value lands
                recv.check_landed(name, staging)
                landed[name] = staging
            if not dry:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            try:
                recv.verify_landed(v)
            except Exception as e:  # noqa: BLE001 - reported, the parent fails the check
                bad.append(f"v{v}: {str(e)[:300]}")
            if check:  # exact against the plan executed on CPU from the same HF tensors
                hf = _hf(spec.dims, v)
                src = {r: hf_to_local(hf.__getitem__, source_rank_layouts(spec.dims, spec.src, r.tp, r.pp))
                       for r in spec.src.ranks()}
                want = {r: {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in plan.dst_shapes[r].items()}
                        for r in plan.dst_shapes}
                execute_plan_ref(plan, src, want)
                for n, w in want[rank].items():
                    if not torch.equal(landed[n].cpu().view(torch.int16), w.view(torch.int16)):
                        bad.append(f"v{v}: {n} differs from the plan's CPU execution")
            nbytes = sum(t.numel() * t.element_size() for t in landed.values())
            del landed
            mems.append(_mem(dry))
            q.put(("got", str(rank), v, {"seconds": elapsed, "bytes": nbytes, "bad": bad[:], **recv.last_stats}))
        q.put(("mem", str(rank), 0, mems))
    except BaseException:  # noqa: BLE001
        q.put(("error", str(rank), 0, traceback.format_exc()))


def run_sync(dims: ModelDims, gen_tp: int, syncs: int, dry: bool, plant: bool, check: bool, timeout: float = 240):
    from megarl.ddma.sync import SyncSpec, host_store

    store = host_store()
    spec = SyncSpec(dims, TrainerTopology(2, 1, 1), GeneratorTopology(gen_tp, 1), "127.0.0.1", store.port,
                    transport="cuda_ipc", engine_dtype="bfloat16", verify_every=1, timeout_s=timeout,
                    bucket_bytes=64 << 20)
    ctx = mp.get_context("spawn")  # CUDA in children: never fork
    q = ctx.Queue()
    versions = list(range(1, syncs + 1))
    procs = [ctx.Process(target=_sender, args=(spec, r, versions, dry, q)) for r in spec.src.ranks()]
    procs += [ctx.Process(target=_receiver, args=(spec, r, versions, dry, plant, check, q)) for r in spec.dst.ranks()]
    for p in procs:
        p.start()
    out: dict = {"got": [], "sent": [], "mem": {}, "errors": []}
    try:
        for _ in range(len(procs) * (syncs + 1)):
            kind, rank, v, payload = q.get(timeout=timeout * 2)
            if kind == "error":
                out["errors"].append(f"{rank}: {payload[-2000:]}")
                break
            if kind == "mem":
                out["mem"][rank] = payload
            else:
                out[kind].append((rank, v, payload))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


def check_flat(mem: dict, slack: int) -> list[str]:
    """After two warm-up syncs, every process's allocated device memory is unchanged and the device's
    free memory moves by at most ``slack`` bytes (one bucket: allocator rounding)."""
    bad = []
    for rank, series in mem.items():
        if len(series) < 3:
            continue
        if series[-1]["allocated"] != series[1]["allocated"]:
            bad.append(f"{rank}: allocated {series[1]['allocated']} -> {series[-1]['allocated']} bytes")
        if series[1]["free"] - series[-1]["free"] > slack:
            bad.append(f"{rank}: free device memory fell by {series[1]['free'] - series[-1]['free']} bytes")
    return bad


def bench(dry: bool, trials: int) -> dict:
    dims = ModelDims.from_hf_config(BENCH)
    res = run_sync(dims, 1, trials + 1, dry, False, False, timeout=300)
    if res["errors"]:
        return {"ok": False, "errors": res["errors"]}
    got = [p for _, v, p in res["got"] if v > 1]  # the first sync opens handles: not timed
    # a worker's whole sync after the senders published: copies, checksums, a final synchronize
    best = min(got, key=lambda p: p["seconds"])
    nbytes = best["bytes"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=_dev(dry))
    dst = torch.empty_like(src)
    times = []
    for _ in range(max(trials, 3)):
        if not dry:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if not dry:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    sync_gbps, copy_gbps = nbytes / best["seconds"] / 1e9, nbytes / min(times) / 1e9
    return {"ok": True, "bytes": nbytes, "sync_seconds": best["seconds"], "sync_GBps": sync_gbps,
            "d2d_copy_GBps": copy_gbps, "ratio": sync_gbps / copy_gbps, "goal_ratio": 0.5,
            "meets_goal": sync_gbps / copy_gbps >= 0.5,
            "transfer_s": best["transfer_s"], "verify_s": best["verify_s"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--cpu-dry", action="store_true")
    args = ap.parse_args()
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT") == "ipc"
    if args.bench:
        result = bench(args.cpu_dry, args.trials)
        print(json.dumps({"bench_cuda_ipc": result}))
        return 0 if result["ok"] else 1
    dims = ModelDims.from_hf_config(SMALL)
    report, ok = {}, True
    for gen_tp in (1, 2):
        res = run_sync(dims, gen_tp, args.syncs, args.cpu_dry, plant, True)
        bad = [b for _, _, p in res["got"] for b in p["bad"]] + res["errors"]
        flat = check_flat(res["mem"], 64 << 20) if not args.cpu_dry else []
        n_got = len(res["got"])
        case_ok = not bad and not flat and n_got == gen_tp * args.syncs
        ok &= case_ok
        report[f"tp2_to_tp{gen_tp}"] = {"ok": case_ok, "syncs": args.syncs, "landed": n_got, "problems": bad[:5],
                                        "memory_not_flat": flat, "memory": res["mem"]}
    print(json.dumps({"cuda_ipc_sync": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
