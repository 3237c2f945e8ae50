"""DDMA test machinery: random HF tensors, an independent vLLM-layout reference, and real sender/receiver
processes (with host-memory doubles of the CUDA and NCCL calls)."""

from __future__ import annotations

import dataclasses
import io
import multiprocessing as mp
import os
import traceback

import torch

from megarl.ddma.layouts import GeneratorTopology, SrcRank, TrainerTopology
from megarl.ddma.sync import DdmaReceiver, DdmaSender, DdmaVerifyError, SyncSpec, host_store
from megarl.ddma.transport import choose_transport
from megarl.models.layouts import ModelDims, hf_tensor_shapes, hf_to_local


DIMS = {
    # vocab 300: padded by both Megatron (128*tp) and vLLM (64)
    "llama_kv4_untied": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=8, intermediate_size=96, vocab_size=300),
    # GQA kv=2 < generator tp 4: vLLM replicates KV heads; tied embeddings
    "llama_kv2_tied": dict(model_type="llama", num_hidden_layers=4, hidden_size=64, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=250,
                           tie_word_embeddings=True),
    # qwen2: qkv biases; kv=2 (replicated at generator tp 4); untied
    "qwen2_kv2": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=200),
    # MHA, vocab a multiple of 64 (no vLLM padding), tied, qwen2 biases
    "qwen2_mha_tied": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=32, intermediate_size=96, vocab_size=320,
                           tie_word_embeddings=True),
}


def _vocab_shard(w, tp, t):
    v = w.shape[0]
    padded = -(-v // 64) * 64
    full = torch.zeros((padded, *w.shape[1:]), dtype=w.dtype)
    full[:v] = w
    return full.chunk(tp, 0)[t].clone()


def _kv_shard(w, kvh, tp, t):
    if tp <= kvh:
        return w.chunk(tp, 0)[t]
    head = t // (tp // kvh)  # vLLM: tp_rank // num_kv_head_replicas
    return w.unflatten(0, (kvh, -1))[head]


def _expected_vllm(hf, d, tp, t):
    out = {"model.embed_tokens.weight": _vocab_shard(hf["model.embed_tokens.weight"], tp, t)}
    for i in range(d.num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out[f"{p}.input_layernorm.weight"] = hf[f"{p}.input_layernorm.weight"].clone()
        for suffix in ("weight", "bias") if d.qkv_bias else ("weight",):
            out[f"{a}.qkv_proj.{suffix}"] = torch.cat([
                hf[f"{a}.q_proj.{suffix}"].chunk(tp, 0)[t],
                _kv_shard(hf[f"{a}.k_proj.{suffix}"], d.num_kv_heads, tp, t),
                _kv_shard(hf[f"{a}.v_proj.{suffix}"], d.num_kv_heads, tp, t)], 0)
        out[f"{a}.o_proj.weight"] = hf[f"{a}.o_proj.weight"].chunk(tp, 1)[t].contiguous()
        out[f"{p}.post_attention_layernorm.weight"] = hf[f"{p}.post_attention_layernorm.weight"].clone()
        out[f"{p}.mlp.gate_up_proj.weight"] = torch.cat([
            hf[f"{p}.mlp.gate_proj.weight"].chunk(tp, 0)[t], hf[f"{p}.mlp.up_proj.weight"].chunk(tp, 0)[t]], 0)
        out[f"{p}.mlp.down_proj.weight"] = hf[f"{p}.mlp.down_proj.weight"].chunk(tp, 1)[t].contiguous()
    out["model.norm.weight"] = hf["model.norm.weight"].clone()
    if not d.tie_word_embeddings:
        out["lm_head.weight"] = _vocab_shard(hf["lm_head.weight"], tp, t)
    return out


def _random_hf(d, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf_tensor_shapes(d).items()}


TIMEOUT_S = 60.0


def _dims(name: str) -> ModelDims:
    cfg = dict(rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.update(DIMS[name])
    return ModelDims.from_hf_config(cfg)


def _hf(dims: ModelDims, version: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: t.to(dtype) for n, t in _random_hf(dims, 1000 + version).items()}


class HostIpcDouble:
    """GPU-boundary double for the cuda_ipc transport (megarl/ddma/transport/cuda_ipc.py CudaIpcOps):
    its four CUDA calls done on host memory, with CudaIpcOps' signatures (tests/e2e/test_cuda_api_drift.py
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
    Backend: the same method signatures (tests/e2e/test_cuda_api_drift.py checks them against the
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
    if "device_copies" in doubles:  # the CUDA path's strided block copies, on host tensors
        from megarl.ddma.transport.buckets import BucketedTransport

        BucketedTransport.host_memcpy = False


def _sender_main(spec: SyncSpec, rank: SrcRank, versions: list[int], dtype: torch.dtype, errq,
                 doubles: tuple[str, ...] = (), realloc: bool = False) -> None:
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
                if realloc:  # conversion buckets freed and allocated anew: new storages, re-exported
                    sender._bufs = None
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
         coalescing=False, realloc=False, device_copies=False, **spec_kw):
    """``coalescing``: nccl's code over CoalescingGlooDouble (NCCL's coalescing branch) instead of gloo;
    ``realloc``: the senders allocate their conversion buckets anew before every sync after the first;
    ``device_copies``: nccl / gloo pack and land as on CUDA (strided block copies, not host memcpy)."""
    transport = choose_transport(transport, device="cpu", same_host=True)  # "p2p" -> gloo (host memory)
    store = host_store()
    doubles = (("host_ipc",) * (transport == "cuda_ipc") + ("coalescing",) * coalescing  # the GPU-boundary doubles
               + ("device_copies",) * device_copies)
    spec = SyncSpec(dims, src, dst, "127.0.0.1", store.port, transport=transport, wire=wire,
                    engine_dtype=engine_dtype, timeout_s=TIMEOUT_S, zero_copy_via=via, **spec_kw)
    # forkserver, not fork: a process that already ran OpenMP-parallel torch ops (any earlier test)
    # must not fork (libgomp hangs in the child); the fork server is a fresh process.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megarl.ddma.sync", "tests.harness.ddma"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_sender_main, args=(spec, r, list(versions), trainer_dtype, q, doubles, realloc))
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


def shard_shapes(dims, src: TrainerTopology, rank) -> list:
    """The local shapes of trainer ``rank``'s parameters (its shard of every tensor it holds)."""
    from megarl.ddma.layouts import source_rank_layouts

    return [lay.local_shape for lay in source_rank_layouts(dims, src, rank.tp, rank.pp).values()]


def _expected(dims, dst, version, trainer_dtype, engine_dtype):
    hf = _hf(dims, version, trainer_dtype)
    return {t: {n: w.to(engine_dtype) for n, w in _expected_vllm(hf, dims, dst.tp, t).items()} for t in range(dst.tp)}
