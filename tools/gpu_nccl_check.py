"""GPU check: the nccl transport's call pattern on a real ProcessGroupNCCL (one rank, one GPU).

NCCL needs one GPU per rank, so two ranks cannot run on the lent machine; one rank can still take the
exact calls ``megarl/ddma/transport/nccl.py`` makes: ``ProcessGroupNCCL(PrefixStore, rank, size,
Options)`` under a per-group prefix, ``eager_connect_single_device``, then ``NcclTransport._round``
(``supports_coalescing``, ``_start_coalescing()``, a self send and recv that return no Work, the batch's
Work from ``_end_coalescing()``, ``wait()``) and ``NcclTransport._complete`` (the stream synchronized).
The received bytes must equal the sent ones. A second group on the same store must build too (its own
prefix).

``device_copies``: the transport's CUDA packing and landing (strided copies of folded blocks in the widest
word, ``BucketedTransport._pack`` / ``_land_chunk``) of one worker's sync at Llama-3.2-1B's shape, trainer
TP2 -> TP1 (every row of o_proj and down_proj a run), chunk by chunk through one device buffer: the staging
bytes must equal the host path's (one C++ memcpy per run), and the copies made (packing and landing) are reported
beside the runs (each planned run is packed once and landed once) and timed. Prints one JSON line; exit 1 on failure. ``MEGARL_GPU_CHECK_PLANT=nccl`` corrupts the
received bytes (the check must fail). ``--cpu-dry``: no NCCL on CPU; checks that the calls exist, and runs
``device_copies`` on host tensors at a small shape.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


SMALL = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
             num_hidden_layers=4, vocab_size=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA_1B = dict(SMALL, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                num_hidden_layers=16, vocab_size=128256)


def device_copies(device: torch.device, cfg: dict, plant: bool) -> dict:
    """One worker's nccl sync (trainer TP2 -> TP1, engine wire, bf16, the default bucket) packed and landed
    on ``device`` by the transport's device path, against its host path on the CPU (see the docstring)."""
    import time
    import types

    from megarl.ddma.bucket_model import DEFAULT_BUCKET_BYTES, chunk_bytes
    from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, vllm_param_layouts
    from megarl.ddma.plan import plan_sync
    from megarl.ddma.transport.buckets import BucketedTransport, _bytes, pair_streams, param_groups
    from megarl.models.layouts import ModelDims

    dims, spec = ModelDims.from_hf_config(cfg), types.SimpleNamespace(engine_dtype="bfloat16", wire="engine",
                                                                      bucket_bytes=DEFAULT_BUCKET_BYTES)
    dst = GeneratorTopology(1, 1)
    plan = plan_sync(dims, TrainerTopology(2, 1, 1), dst)
    d = sorted(plan.dst_shapes)[0]
    layouts = vllm_param_layouts(dims, dst.tp, d.tp, dst.vocab_padding)
    groups, chunk = param_groups(layouts, 2, spec.bucket_bytes), chunk_bytes(spec.bucket_bytes)
    g = torch.Generator(device).manual_seed(46)  # made on the device: 2.5 GB of host randoms take long
    wires = {s: {n: torch.randint(-30000, 30000, shape, generator=g, dtype=torch.int16, device=device)
                 .view(torch.bfloat16) for n, shape in plan.src_shapes[s].items()} for s in sorted(plan.src_shapes)}

    def transport(host_memcpy: bool) -> BucketedTransport:
        t = BucketedTransport.__new__(BucketedTransport)  # its copy logic only: no side, no group
        t.spec, t._pool, t._runs, t.copies, t.host_memcpy = spec, {}, {}, 0, host_memcpy
        t.streams = lambda s, d_: pair_streams(plan, spec, s, d_, groups)
        return t

    def sync(dev: torch.device, host_memcpy: bool) -> tuple[dict, int, int, float]:
        t, runs = transport(host_memcpy), 0
        staging = {p: torch.zeros(layouts[p].local_shape, dtype=torch.bfloat16, device=dev) for p in layouts}
        src = {s: {("wire", n): _bytes(w.to(dev).reshape(-1)) for n, w in ws.items()} for s, ws in wires.items()}
        t0 = time.perf_counter()
        for s in src:
            for gi, segs in enumerate(pair_streams(plan, spec, s, d, groups)):
                for j in range(-(-sum(x.nbytes for x in segs) // chunk)):
                    out = t._chunk_runs(s, d, gi, j, "src")
                    buf = t._pack(out, src[s], dev, d, 0)  # what the sender posts
                    into = t._chunk_runs(s, d, gi, j, "dst")
                    t._land_chunk(into, buf, staging, s, {}, {})  # what the worker lands
                    runs += len(out.n) + len(into.n)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return staging, t.copies, runs, time.perf_counter() - t0

    host, _, runs, host_s = sync(torch.device("cpu"), True)
    sync(device, False)  # warm-up (allocator, kernels)
    got, copies, _, device_s = sync(device, False)
    if plant:
        next(iter(got.values())).view(-1).view(torch.int16)[0] ^= 1
    exact = all(torch.equal(got[p].cpu().view(torch.int16), host[p].view(torch.int16)) for p in layouts)
    nbytes = sum(t.numel() * 2 for t in host.values())
    return {"ok": exact and 0 < copies < runs, "exact": exact, "bytes": nbytes, "runs": runs, "copies": copies,
            "device_s": device_s, "host_memcpy_s": host_s, "device": str(device)}


def main() -> int:
    dry = "--cpu-dry" in sys.argv
    plant = os.environ.get("MEGARL_GPU_CHECK_PLANT") == "nccl"
    from megarl.ddma.transport.base import group_prefix
    from megarl.ddma.transport.nccl import NcclTransport

    if dry:
        import torch._C._distributed_c10d as c10d

        ok = all(hasattr(c10d.Backend, n) for n in ("_start_coalescing", "_end_coalescing",
                                                    "eager_connect_single_device", "supports_coalescing"))
        copies = device_copies(torch.device("cpu"), SMALL, plant)
        print(json.dumps({"nccl_pattern": {"ok": ok, "dry": "no NCCL on CPU: the Backend calls exist"},
                          "device_copies": copies}))
        return 0 if ok and copies["ok"] else 1
    out: dict = {}
    try:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        groups = []
        for _ in range(2):  # a second group on the same store: its own prefix, a fresh NCCL id
            opts = ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=60)
            prefix = group_prefix(store, "ddma/nccl", 0)
            pg = ProcessGroupNCCL(torch.distributed.PrefixStore(prefix, store), 0, 1, opts)
            pg.eager_connect_single_device(device)
            groups.append((prefix, pg))
        out["prefixes"] = [p for p, _ in groups]
        out["supports_coalescing"] = bool(groups[0][1].supports_coalescing)
        for i, (_, pg) in enumerate(groups):
            src = torch.arange(1 << 20, dtype=torch.int32, device=device) * (i + 3)
            dst = torch.zeros_like(src)
            NcclTransport._round(pg, [("send", src, 0), ("recv", dst, 0)])
            NcclTransport._complete(device)
            if plant and i == 0:
                dst[0] += 1
            out[f"group{i}_exact"] = bool(torch.equal(src, dst))
        out["ok"] = out["supports_coalescing"] and all(out[f"group{i}_exact"] for i in range(2)) \
            and len(set(out["prefixes"])) == 2
    except Exception:  # noqa: BLE001 - reported in the JSON
        out.update(ok=False, error=traceback.format_exc()[-2000:])
    try:
        copies = device_copies(torch.device("cuda", 0), LLAMA_1B, plant)
    except Exception:  # noqa: BLE001 - reported in the JSON
        copies = {"ok": False, "error": traceback.format_exc()[-2000:]}
    print(json.dumps({"nccl_pattern": out, "device_copies": copies}))
    return 0 if out["ok"] and copies["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
