"""DDMA at run time between real processes: trainer-rank senders with simulated shards (built from
random HF tensors through the trainer layouts) and generator-worker receivers, over both
transports (zero-copy reads and gloo point-to-point; nccl's code over gloo and cuda_ipc's through a
host-memory double of its CUDA calls are in tests/test_ddma_transport.py), engine-dtype and FP8 wires.

What lands in every worker is compared with an independent vLLM-layout reference built from the
HF tensors (tests/test_ddma_plan.py's ``_expected_vllm``): bitwise for bf16/fp32, and for FP8
equal to the per-row e4m3 round trip of the trainer's row. A corrupted plan must fail
verification naming the tensor.
"""

from __future__ import annotations

import dataclasses
import io
import math
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from megarl.ddma.layouts import GeneratorTopology, SrcRank, TrainerTopology
from megarl.ddma.sync import DdmaReceiver, DdmaSender, DdmaVerifyError, SyncSpec, host_store
from megarl.ddma.transport import choose_transport
from megarl.models.layouts import ModelDims, hf_to_local
from tests.test_ddma_plan import DIMS, _expected_vllm, _random_hf

TIMEOUT_S = 60.0


def _dims(name: str) -> ModelDims:
    cfg = dict(rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.update(DIMS[name])
    return ModelDims.from_hf_config(cfg)


def _hf(dims: ModelDims, version: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: t.to(dtype) for n, t in _random_hf(dims, 1000 + version).items()}


class HostIpcDouble:
    """GPU-boundary double for the cuda_ipc transport (megarl/ddma/transport/cuda_ipc.py CudaIpcOps):
    its four CUDA calls done on host memory, with CudaIpcOps' signatures (tests/test_ddma_transport.py
    checks them). ``export`` puts the storage in shared memory and hands out (pid, fd, size); ``open``
    maps that file (on the host: ``device`` must be the worker's, here the CPU); synchronize records
    the device it was asked to wait for (host copies are done when they return); collect counts calls.
    Everything else in the transport runs as on a GPU."""

    device_type = "cpu"
    collects = 0
    synchronized: list = []

    def export(self, storage_bytes):
        from megarl.ddma.zero_copy import share

        entry = share(storage_bytes)
        return (os.getpid(), entry["fd"], entry["size"])

    def open(self, handle, device):
        from megarl.ddma.zero_copy import map_shared

        assert torch.device(device).type == "cpu", device
        pid, fd, size = handle
        mapped = map_shared(pid, fd, size)
        if mapped is None:
            raise RuntimeError(f"cannot map /proc/{pid}/fd/{fd}")
        return mapped

    def synchronize(self, device):
        HostIpcDouble.synchronized.append(str(device))

    def collect(self):
        HostIpcDouble.collects += 1


class CoalescingGlooDouble:
    """Stand-in for NCCL's c10d ``Backend`` (``ProcessGroupNCCL``) on host memory, over a real gloo
    Backend: the same method signatures (tests/test_ddma_transport.py checks them against the
    installed torch's binding) and NCCL's coalescing contract -- ``supports_coalescing``; between
    ``_start_coalescing()`` and ``_end_coalescing()`` ``send``/``recv`` only queue and return no Work
    (ProcessGroupNCCL::pointToPoint makes none while coalescing); ``_end_coalescing()`` posts the
    batch and returns its one Work. Unlike NCCL it returns that Work completed (gloo's Works have no
    future to chain), which the transport cannot tell apart."""

    supports_coalescing = True

    def __init__(self, store, rank, size, timeout_s, prefix="ddma/nccl-on-gloo"):
        from megarl.ddma.transport.base import gloo_group

        self._pg = gloo_group(store, rank, size, timeout_s, prefix=prefix)
        self._queued = None
        self.batches = 0

    def eager_connect_single_device(self, arg0):
        self._pg.eager_connect_single_device(arg0)

    def _start_coalescing(self):
        if self._queued is not None:
            raise RuntimeError("_start_coalescing() while coalescing")
        self._queued = []

    def _end_coalescing(self):
        import torch._C._distributed_c10d as c10d

        ops, self._queued = self._queued, None
        if ops is None:
            raise RuntimeError("_end_coalescing() without _start_coalescing()")
        for w in [getattr(self._pg, op)(tensors, peer, tag) for op, tensors, peer, tag in ops]:
            w.wait()
        self.batches += 1
        done = torch.futures.Future()
        done.set_result(None)
        return c10d._create_work_from_future(done)

    def _op(self, op, tensors, peer, tag):
        if self._queued is None:
            return getattr(self._pg, op)(tensors, peer, tag)
        self._queued.append((op, list(tensors), peer, tag))
        return None

    def send(self, tensors, dstRank, tag):  # noqa: N803 - the binding's names
        return self._op("send", tensors, dstRank, tag)

    def recv(self, tensors, srcRank, tag):  # noqa: N803 - the binding's names
        return self._op("recv", tensors, srcRank, tag)


def _use_doubles(doubles: tuple[str, ...]) -> None:
    if "host_ipc" in doubles:
        from megarl.ddma.transport import cuda_ipc

        cuda_ipc.IPC_OPS = HostIpcDouble()
    if "coalescing" in doubles:
        from megarl.ddma.transport import nccl

        nccl.HOST_GROUP = CoalescingGlooDouble


def _sender_main(spec: SyncSpec, rank: SrcRank, versions: list[int], dtype: torch.dtype, errq,
                 doubles: tuple[str, ...] = ()) -> None:
    try:
        _use_doubles(doubles)
        from megarl.ddma.layouts import source_rank_layouts

        layouts = source_rank_layouts(spec.dims, spec.src, rank.tp, rank.pp)
        sender = None
        for v in versions:
            hf = _hf(spec.dims, v, dtype)
            params = hf_to_local(hf.__getitem__, layouts)
            if sender is None:
                sender = DdmaSender(spec, rank, params)
            else:  # new weights in place, as an optimizer step does
                for n, t in params.items():
                    sender.params[n].copy_(t)
            stats = sender.sync(v)
            if "host_ipc" in doubles:
                stats["collects"] = HostIpcDouble.collects
                stats["synchronized"] = list(HostIpcDouble.synchronized)
            if "coalescing" in doubles:
                stats["batches"] = sender.transport.pg(torch.device("cpu")).batches
            errq.put(("sent", rank, v, stats))
    except BaseException:  # noqa: BLE001
        errq.put(("error", rank, traceback.format_exc(), None))


def _receiver_main(spec: SyncSpec, rank, versions: list[int], corrupt: bool, outq,
                   doubles: tuple[str, ...] = ()) -> None:
    try:
        _use_doubles(doubles)
        recv = DdmaReceiver(spec, rank)
        if corrupt:  # a wrong landing: swap two copies' destinations in this worker's plan
            name = next(p for p in recv.layouts if "qkv_proj.weight" in p)
            s, copies = recv.incoming[name][0]
            c0 = copies[0]
            recv.incoming[name][0] = (s, [dataclasses.replace(c0, dst_offset=c0.dst_offset + 1)] + copies[1:])
        for v in versions:
            got = {n: t.clone() for n, t in recv.receive(v)}
            buf = io.BytesIO()
            torch.save(got, buf)  # bytes, not shared-memory handles: this process exits next
            stats = dict(recv.last_stats, collects=HostIpcDouble.collects, synchronized=list(HostIpcDouble.synchronized))
            if "coalescing" in doubles:
                stats["batches"] = recv.transport.pg(torch.device("cpu")).batches
            outq.put(("got", rank, v, (buf.getvalue(), stats)))
    except DdmaVerifyError as e:
        outq.put(("verify", rank, str(e), None))
    except BaseException:  # noqa: BLE001
        outq.put(("error", rank, traceback.format_exc(), None))


def _run(dims, src: TrainerTopology, dst: GeneratorTopology, *, transport="zero_copy", wire="engine",
         engine_dtype="bfloat16", trainer_dtype=torch.float32, versions=(1, 2), corrupt=False, via="map",
         coalescing=False, **spec_kw):
    """``coalescing``: nccl's code over CoalescingGlooDouble (NCCL's coalescing branch) instead of gloo."""
    transport = choose_transport(transport, device="cpu", same_host=True)  # "p2p" -> gloo (host memory)
    store = host_store()
    doubles = ("host_ipc",) * (transport == "cuda_ipc") + ("coalescing",) * coalescing  # the GPU-boundary doubles
    spec = SyncSpec(dims, src, dst, "127.0.0.1", store.port, transport=transport, wire=wire,
                    engine_dtype=engine_dtype, timeout_s=TIMEOUT_S, zero_copy_via=via, **spec_kw)
    # forkserver, not fork: a process that already ran OpenMP-parallel torch ops (any earlier test)
    # must not fork (libgomp hangs in the child); the fork server is a fresh process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megarl.ddma.sync", "tests.test_ddma_sync"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_sender_main, args=(spec, r, list(versions), trainer_dtype, q, doubles))
             for r in src.ranks()]
    procs += [ctx.Process(target=_receiver_main, args=(spec, r, list(versions), corrupt, q, doubles))
              for r in dst.ranks()]
    for p in procs:
        p.start()
    results = {}
    try:
        expect = len(procs) * len(versions)  # corrupt: one version, a 'verify' in place of 'got'
        for _ in range(expect):
            kind, rank, a, b = q.get(timeout=TIMEOUT_S * 2)
            if kind == "error":
                raise AssertionError(f"{rank} failed:\n{a}")
            if kind == "got":
                b = (torch.load(io.BytesIO(b[0])), b[1])
            results.setdefault(kind, []).append((rank, a, b))
    finally:
        for p in procs:
            p.join(timeout=5 if not corrupt else 1)
            if p.is_alive():
                p.kill()
    return spec, results


def _shapes(dims, src, rank):
    from megarl.ddma.layouts import source_rank_layouts

    return {n: l.local_shape for n, l in source_rank_layouts(dims, src, rank.tp, rank.pp).items()}


def _expected(dims, dst, version, trainer_dtype, engine_dtype):
    hf = _hf(dims, version, trainer_dtype)
    return {t: {n: w.to(engine_dtype) for n, w in _expected_vllm(hf, dims, dst.tp, t).items()} for t in range(dst.tp)}


CASES = [
    # (model, trainer tp, pp, dp, generator tp, replicas, transport)
    ("llama_kv2_tied", 2, 2, 1, 4, 1, "zero_copy"),  # KV replicated on the generator, tied, padded vocab
    ("qwen2_kv2", 1, 1, 2, 2, 2, "p2p"),            # DP senders share, 2 replicas, biases
    ("llama_kv4_untied", 2, 1, 1, 1, 1, "p2p"),
    ("qwen2_mha_tied", 1, 2, 1, 2, 1, "zero_copy"),
    ("qwen2_kv2", 2, 1, 1, 4, 1, "zero_copy_read"),  # process_vm_readv instead of mapping shared memory
]


@pytest.mark.parametrize("name,ttp,pp,dp,gtp,reps,transport", CASES, ids=str)
def test_sync_lands_exact_shards(name, ttp, pp, dp, gtp, reps, transport):
    dims = _dims(name)
    src, dst = TrainerTopology(ttp, pp, dp), GeneratorTopology(gtp, reps)
    via = "read" if transport == "zero_copy_read" else "map"
    bucket = 4096  # p2p: a budget below the model's size, so groups and rounds are many
    _, res = _run(dims, src, dst, transport=transport.removesuffix("_read"), via=via, bucket_bytes=bucket)
    assert len(res["got"]) == len(dst.ranks()) * 2
    for rank, v, (got, stats) in res["got"]:
        want = _expected(dims, dst, v, torch.float32, torch.bfloat16)[rank.tp]
        assert set(got) == set(want)
        for n in want:  # bitwise: the wire is the engine dtype, converted once on the sender
            assert torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)), (rank, v, n)
        largest = max(t.numel() * 2 for t in want.values())
        if transport == "p2p":  # one group's staging (<= the budget unless one parameter is larger) + the
            # rounds in flight (<= the budget per sender): never the model (transport/buckets.py)
            assert 0 < stats["peak_extra_bytes"] <= max(bucket, largest) + len(src.ranks()) * bucket
        else:  # one staging buffer (the largest local parameter) + at most one message of that size
            assert 0 < stats["peak_extra_bytes"] <= 2 * largest
    for rank, v, stats in res["sent"]:
        assert stats["bytes_sent"] > 0 or dp > 1
        # a sender holds at most a converted copy of its own shard (fp32 trainer -> bf16 engine) plus
        # its p2p window of messages (each at most one destination parameter's slice)
        shard = sum(math.prod(s) for s in _shapes(dims, src, rank).values())
        assert stats["peak_extra_bytes"] <= 2 * shard + 4 * 2 * largest


@pytest.mark.parametrize("transport", ["zero_copy", "zero_copy_read", "p2p"])
def test_sync_fp8_before_send(transport):
    dims = _dims("llama_kv4_untied")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(2, 1)
    via = "read" if transport == "zero_copy_read" else "map"
    _, res = _run(dims, src, dst, transport=transport.removesuffix("_read"), wire="fp8", versions=(1,), via=via)
    for rank, v, (got, _) in res["got"]:
        want = _expected(dims, dst, v, torch.float32, torch.bfloat16)[rank.tp]
        for n, w in want.items():
            if w.dim() == 1:
                assert torch.equal(got[n], w), n
                continue
            # Each landed row is the e4m3 round trip of the trainer's row (megarl/ddma/quantize.py
            # docstring): half a code step, 2^-4 relative for normal codes (3 stored mantissa bits),
            # plus the final bf16 rounding (2^-8 relative); in e4m3's subnormal range half a step is
            # 2^-10 * scale with scale <= amax / 448; the last term allows 16x that.
            err = (got[n].float() - w.float()).abs()
            bound = w.float().abs() * (2 ** -4 + 2 ** -8) + w.float().abs().amax() * 2 ** -9 / 448 * 8
            assert bool((err <= bound + 1e-30).all()), (n, float((err - bound).max()))


def test_wrong_landing_fails_verification_naming_the_tensor():
    dims = _dims("llama_kv4_untied")
    src, dst = TrainerTopology(1, 1, 1), GeneratorTopology(1, 1)
    _, res = _run(dims, src, dst, transport="zero_copy", versions=(1,), corrupt=True)
    msgs = [m for _, m, _ in res.get("verify", [])]
    assert msgs, res
    assert "ddma verification failed" in msgs[0] and "model.layers." in msgs[0] and "_proj.weight" in msgs[0]
    assert "trainer rank(s)" in msgs[0] and "bytes [" in msgs[0]



def test_landing_check_names_missing_and_unsent_engine_weights():
    """What the engine holds is checked, not what was staged: an engine weight that never landed,
    or one no DDMA layout sends (a model variant DDMA does not know), fails the sync by name."""
    from megarl.ddma.layouts import DstRank

    dims = _dims("qwen2_kv2")
    store = host_store()
    spec = SyncSpec(dims, TrainerTopology(1, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", store.port,
                    engine_dtype="float32", timeout_s=TIMEOUT_S)
    recv = DdmaReceiver(spec, DstRank(0, 0))
    tables = {SrcRank(0, 0, 0): {"sums": {}}}
    recv.begin_landing(tables)
    with pytest.raises(DdmaVerifyError, match=r"never landed in the engine after weights v3.*model\.embed_tokens"):
        recv.verify_landed(3)
    recv.begin_landing(tables)
    for name, layout in recv.layouts.items():
        recv.check_landed(name, torch.zeros(layout.local_shape))
    recv.check_landed("model.layers.0.self_attn.o_proj.bias", torch.zeros(dims.hidden_size))
    recv.check_landed("model.layers.0.self_attn.qkv_proj.weight_scale", torch.ones(1))  # the engine's own
    with pytest.raises(DdmaVerifyError, match=r"no DDMA layout sends.*o_proj\.bias"):
        recv.verify_landed(3)
    with pytest.raises(DdmaVerifyError, match="landed as torch.bfloat16"):
        recv.check_landed("model.norm.weight", torch.zeros(dims.hidden_size, dtype=torch.bfloat16))
