"""DDMA transports (megarl/ddma/transport/): the choice, nccl's rounds over gloo, cuda_ipc's logic.

- ``choose_transport``: from where the bytes live and whether the peers share a host; explicit wrong
  choices are config errors naming what to set.
- nccl: the same code that runs over NCCL on GPUs runs here over a gloo group of its own; with a tiny
  memory budget every parameter is split over many rounds and must still land exact bytes.
- cuda_ipc: run between real processes with its four CUDA calls (export, open, synchronize, collect)
  replaced by ``HostIpcDouble`` (tests/test_ddma_sync.py), the GPU-boundary double: buckets, the
  handle caches (export once per topology), the acknowledgement protocol and the run copies are the
  real code. The real CUDA run is ``gpu``-marked here and in tools/gpu_ddma_ipc.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megarl.ddma.layouts import GeneratorTopology, SrcRank, TrainerTopology
from megarl.ddma.sync import DdmaSender, DdmaTransportError, SyncSpec, host_store
from megarl.ddma.transport import choose_transport, transport_problem
from megarl.ddma.transport.base import plan_buckets
from megarl.ddma.transport.cuda_ipc import ExportCache, explain_open_failure, ptrace_permitted
from megarl.ddma.transport.nccl import chunk_segments, param_groups, pair_streams
from megarl.models.layouts import hf_to_local
from tests.test_ddma_sync import _dims, _expected, _hf, _run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the choice --------------------------------------------------------------------------------

@pytest.mark.parametrize("device,same_host,want", [
    ("cpu", True, "zero_copy"), ("cuda", True, "cuda_ipc"), ("cpu", False, "gloo"), ("cuda", False, "nccl")])
def test_auto_picks_from_where_bytes_live(device, same_host, want):
    assert choose_transport("auto", device=device, same_host=same_host) == want
    assert choose_transport(device=device, same_host=same_host) == want  # auto is the default
    assert transport_problem(want, device=device, same_host=same_host) is None


@pytest.mark.parametrize("device,want", [("cpu", "gloo"), ("cuda", "nccl")])
def test_p2p_is_the_old_name_of_point_to_point(device, want):
    assert choose_transport("p2p", device=device, same_host=True) == want
    assert transport_problem("p2p", device=device, same_host=False) is None


def test_explicit_choice_is_kept_and_a_wrong_one_names_the_fix():
    assert choose_transport("gloo", device="cpu", same_host=True) == "gloo"
    msg = transport_problem("cuda_ipc", device="cpu", same_host=True)
    assert msg.startswith("sync.transport=cuda_ipc") and "sync.transport=zero_copy" in msg
    msg = transport_problem("zero_copy", device="cpu", same_host=False)
    assert "different hosts" in msg and "sync.transport=gloo" in msg
    msg = transport_problem("gloo", device="cuda", same_host=False)
    assert "sync.transport=nccl" in msg
    with pytest.raises(ValueError, match="choose one of"):
        choose_transport("rdma", device="cpu", same_host=True)


def _problems(*overrides):
    from megarl.config import ConfigError, load_config

    try:
        load_config(os.path.join(REPO, "configs/quickstart.yaml"), list(overrides))
    except ConfigError as e:
        return e.problems if hasattr(e, "problems") else [str(e)]
    return []


def test_config_errors_before_start():
    (msg,) = [p for p in _problems("cluster.device=cpu", "sync.transport=cuda_ipc") if "sync.transport" in p]
    assert "set sync.transport=auto (picks zero_copy)" in msg
    assert not [p for p in _problems("cluster.device=cpu", "sync.transport=p2p") if "sync.transport" in p]
    assert not [p for p in _problems("cluster.device=cpu") if "sync." in p]


def test_sync_log_line_names_the_chosen_transport():
    from megarl.config import load_config
    from megarl.controller.loop import describe_sync, resolved_sync

    cfg = load_config(os.path.join(REPO, "configs/quickstart.yaml"), ["cluster.device=cpu"])
    assert cfg.sync.transport == "auto"
    assert describe_sync(cfg).startswith("DDMA zero_copy (sync.transport=auto), wire ")
    assert resolved_sync(cfg).transport == "zero_copy"
    cfg = load_config(os.path.join(REPO, "configs/quickstart.yaml"), ["cluster.device=cpu", "sync.transport=gloo"])
    assert describe_sync(cfg).startswith("DDMA gloo, wire ")


def test_cpu_only_transports_refuse_other_devices():
    """CUDA (here: meta) wire tensors never reach a CPU-only path: a clear error naming the fix."""
    from megarl.ddma.transport.gloo import GlooTransport

    class Side:
        spec = None

    t = GlooTransport.__new__(GlooTransport)
    t.side, t.spec = Side(), None
    with pytest.raises(DdmaTransportError, match="DDMA moves host or CUDA memory"):
        t.check_wire({"w": torch.empty(4, device="meta")})


# --- bucketing -------------------------------------------------------------------------------

def test_plan_buckets_packs_in_order_under_the_budget():
    sizes = [100, 300, 50, 1000, 10, 10]
    buckets = plan_buckets(sizes, budget=512, align=256)
    # 1 alone (its end 300 rounds up to 512: 2 does not fit), 3 over budget alone, 4 and 5 share
    assert [[i for i, _ in b] for b in buckets] == [[0], [1], [2], [3], [4, 5]]
    for b in buckets:
        assert all(off % 256 == 0 for _, off in b)
        ends = [off + sizes[i] for i, off in b]
        assert len(b) == 1 or max(ends) <= 512
        assert all(o2 >= e1 for (_, o2), e1 in zip(b[1:], ends))  # no overlap


def test_nccl_streams_chunk_exactly_over_the_stream():
    dims = _dims("llama_kv4_untied")
    spec = SyncSpec(dims, TrainerTopology(2, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", 1, transport="nccl",
                    wire="fp8", bucket_bytes=1000)
    from megarl.ddma.layouts import DstRank, vllm_param_layouts
    from megarl.ddma.plan import plan_sync

    plan = plan_sync(spec.dims, spec.src, spec.dst)
    d = DstRank(0, 0)
    layouts = vllm_param_layouts(dims, 1, 0, spec.dst.vocab_padding)
    groups = param_groups(layouts, 2, 1000)
    assert sum(len(g) for g in groups) == len(layouts) and all(len(g) == 1 for g in groups if
                                                                   math.prod(layouts[g[0]].local_shape) * 2 > 1000)
    for s in spec.src.ranks():
        for segs in pair_streams(plan, spec, s, d, groups):
            total = sum(x.nbytes for x in segs)
            covered = sum(n for j in range(-(-total // 1000)) for _, _, n in chunk_segments(segs, j * 1000, (j + 1) * 1000))
            assert covered == total


# --- nccl's code path over gloo ----------------------------------------------------------------

@pytest.mark.parametrize("wire,bucket", [("engine", 4096), ("engine", 1 << 30), ("fp8", 777)])
def test_nccl_code_path_over_gloo_lands_exact_bytes(wire, bucket):
    """A tiny budget splits parameters over many rounds (chunk edges fall inside copies, FP8 codes
    and scales); the landed bytes must not change."""
    dims = _dims("qwen2_kv2")
    src, dst = TrainerTopology(2, 1, 2), GeneratorTopology(2, 1)
    _, res = _run(dims, src, dst, transport="nccl", wire=wire, versions=(1, 2) if wire == "engine" else (1,),
                  bucket_bytes=bucket)
    rounds = []
    for rank, v, (got, stats) in res["got"]:
        want = _expected(dims, dst, v, torch.float32, torch.bfloat16)[rank.tp]
        assert set(got) == set(want)
        rounds.append(stats["rounds"])
        for n, w in want.items():
            if wire == "engine" or w.dim() == 1:
                assert torch.equal(got[n].view(torch.int16), w.view(torch.int16)), (rank, v, n)
            else:  # the e4m3 round trip bound of test_ddma_sync.test_sync_fp8_before_send
                err = (got[n].float() - w.float()).abs()
                bound = w.float().abs() * (2 ** -4 + 2 ** -8) + w.float().abs().amax() * 2 ** -9 / 448 * 8
                assert bool((err <= bound + 1e-30).all()), n
        if bucket < 1 << 20:  # worker staging: one group (<= budget unless one parameter is larger) + chunks
            largest = max(t.numel() * 2 for t in want.values())
            assert stats["peak_extra_bytes"] <= max(bucket, largest) + 2 * (largest + bucket) + 16 * largest
    total = sum(math.prod(t.shape) * 2 for t in _expected(dims, dst, 1, torch.float32, torch.bfloat16)[0].values())
    if bucket == 4096:
        assert min(rounds) >= total // 4096 // 2  # many rounds: the budget was honoured
    for rank, v, stats in res["sent"]:
        # its converted shard (fp32 trainer -> bf16 wire: 2 bytes/element; fp8: 1 + row scales) plus
        # at most one chunk of <= bucket bytes per worker it feeds (2 here)
        shard = sum(math.prod(s) * 2 for s in _shapes_of(dims, src, rank))
        assert stats["peak_extra_bytes"] <= shard + 2 * min(bucket, shard)


# --- cuda_ipc's logic (GPU-boundary double) -----------------------------------------------------

@pytest.mark.parametrize("trainer_dtype,wire", [(torch.float32, "engine"), (torch.bfloat16, "engine"),
                                                (torch.float32, "fp8")])
def test_cuda_ipc_protocol_lands_exact_and_exports_once(trainer_dtype, wire):
    dims = _dims("llama_kv2_tied")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(1, 2)  # TP2 senders -> two TP1 replicas
    _, res = _run(dims, src, dst, transport="cuda_ipc", wire=wire, trainer_dtype=trainer_dtype,
                  versions=(1, 2, 3), bucket_bytes=64 << 10)
    assert len(res["got"]) == 2 * 3
    for rank, v, (got, stats) in res["got"]:
        want = _expected(dims, dst, v, trainer_dtype, torch.bfloat16)[rank.tp]
        for n, w in want.items():
            if wire == "engine" or w.dim() == 1:
                assert torch.equal(got[n].view(torch.int16), w.view(torch.int16)), (rank, v, n)
        # handles opened once per topology, not per sync; every sync collects
        assert stats["ipc_opens"] == res["got"][0][2][1]["ipc_opens"] or v == 1
        assert stats["collects"] >= v
    by_version = {}
    for rank, v, stats in res["sent"]:
        by_version.setdefault(rank, {})[v] = stats
    for rank, st in by_version.items():
        # exported once (one handle per storage: bf16 params are views of the live tensors; fp32 and
        # fp8 conversions sit in 64 KiB buckets), never again while storages stay put
        assert st[1]["ipc_exports"] == st[2]["ipc_exports"] == st[3]["ipc_exports"] > 0
        assert st[3]["collects"] >= 3
        if trainer_dtype == torch.float32 and wire == "engine":
            shard = sum(math.prod(s) * 2 for s in _shapes_of(dims, src, rank))
            assert st[1]["ipc_exports"] <= -(-shard // (64 << 10)) + 2  # buckets, not one per tensor


def _shapes_of(dims, src, rank):
    from megarl.ddma.layouts import source_rank_layouts

    return [l.local_shape for l in source_rank_layouts(dims, src, rank.tp, rank.pp).values()]


class _CountingOps:
    """GPU-boundary double for ExportCache: records exports instead of making CUDA IPC handles."""

    device_type = "cpu"

    def __init__(self):
        self.exported = []

    def export(self, storage_bytes):
        self.exported.append(storage_bytes.data_ptr())
        return ("handle", storage_bytes.data_ptr())


def test_export_cache_reexports_only_when_a_storage_changes():
    ops = _CountingOps()
    cache = ExportCache(ops)
    bucket = torch.zeros(1024, dtype=torch.uint8)
    a, b = bucket[:256].view(torch.float32), bucket[512:768].view(torch.float32)
    t1 = cache.table({"a": a, "b": b})
    assert len(ops.exported) == 1 and len(t1["buckets"]) == 1  # one handle per bucket, not per tensor
    assert t1["where"]["b"][1] == 512
    cache.table({"a": a, "b": b})
    assert len(ops.exported) == 1  # same storages: nothing re-exported
    c = torch.zeros(64)  # b's storage replaced (a new allocation)
    t3 = cache.table({"a": a, "b": c})
    assert len(ops.exported) == 2 and len(t3["buckets"]) == 2
    t4 = cache.table({"b": c})  # a's storage no longer used: its handle is dropped
    assert len(t4["buckets"]) == 1 and len(cache.handles) == 1


def test_sender_waits_for_every_ack_before_returning():
    """A sender never returns (so never lets the trainer step or rewrite a buffer) before every
    worker acknowledged: with no worker, it times out naming them."""
    dims = _dims("llama_kv4_untied")
    store = host_store()
    spec = SyncSpec(dims, TrainerTopology(1, 1, 1), GeneratorTopology(1, 2), "127.0.0.1", store.port,
                    transport="zero_copy", timeout_s=1.5)
    from megarl.ddma.layouts import source_rank_layouts

    params = hf_to_local(_hf(dims, 1, torch.bfloat16).__getitem__, source_rank_layouts(dims, spec.src, 0, 0))
    sender = DdmaSender(spec, SrcRank(0, 0, 0), params)
    store.set("ddma/v1/done1", b"1")  # one of the two workers acked
    with pytest.raises(TimeoutError, match=r"2 generator worker\(s\).*missing: \['ddma/v1/done2'\]"):
        sender.sync(1)


def test_ptrace_probe_and_failure_message_name_the_fallback():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        allowed = ptrace_permitted(child.pid)
        assert allowed in (True, False, None)
        msg = explain_open_failure(child.pid, RuntimeError("pidfd_getfd: Operation not permitted"))
        assert "sync.transport=nccl" in msg and f"pid {child.pid}" in msg
        if allowed is False:
            assert "ptrace" in msg
    finally:
        child.kill()
        child.wait()
    assert ptrace_permitted(child.pid) in (False, None)  # a dead pid is never readable


@pytest.mark.gpu
def test_cuda_ipc_between_processes_on_one_gpu():
    """The real CUDA run: tools/gpu_ddma_ipc.py (TP2 senders -> TP1 and TP2 receivers, exact, checksums on)."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools/gpu_ddma_ipc.py"), "--syncs", "3"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


# --- no silent fallback -------------------------------------------------------------------------

_START = textwrap.dedent("""
    import logging, sys
    from megarl.config import ConfigError, load_config
    import megarl.controller.loop as loop
    class Stop(Exception):
        pass
    def stop(*a, **k):
        raise Stop()
    loop.resolve_model = stop  # the first step after the start-up checks
    try:
        cfg = load_config({cfg!r}, ["cluster.device=cpu", "sync.native={mode}"])
    except ConfigError as e:
        print("VALIDATION ERROR", e)
        sys.exit(0)
    cfg.sync.native = {start_mode!r}  # what run_job sees (a build that is on disk but does not load)
    try:
        loop.run_job(cfg)
    except Stop:
        print("STARTED")
    except ConfigError as e:
        print("CONFIG ERROR", e)
""")


def _start(mode: str, no_native: bool, start_mode: str | None = None):
    env = dict(os.environ, MEGARL_NO_NATIVE="1" if no_native else "0")
    env.pop("MEGARL_NATIVE_ANNOUNCED", None)
    code = _START.format(cfg=os.path.join(REPO, "configs/quickstart.yaml"), mode=mode, start_mode=start_mode or mode)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_missing_extension_warns_once_at_start():
    out = _start("auto", no_native=True)
    text = out.stdout + out.stderr
    assert "STARTED" in out.stdout, text[-3000:]
    warnings = [line for line in text.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    for what in ("planner", "checksums", "transport"):
        assert what in warnings[0]
    assert "sync.native=required" in warnings[0]


def test_native_required_is_a_config_error_when_missing():
    # found missing by validation (no torch import there) ...
    out = _start("required", no_native=True)
    assert "VALIDATION ERROR" in out.stdout and "sync.native=required" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "pip install --no-build-isolation" in out.stdout
    # ... and, for a build that is there but does not load, by run_job before anything starts
    out = _start("auto", no_native=True, start_mode="required")
    assert "CONFIG ERROR" in out.stdout and "sync.native=required" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "STARTED" not in out.stdout and " WARNING " not in out.stdout


def test_native_present_is_silent():
    from megarl import native

    if not native.HAS_NATIVE:
        pytest.skip("extension not built here")
    out = _start("required", no_native=False)
    assert "STARTED" in out.stdout, out.stdout + out.stderr[-2000:]
    assert not [line for line in (out.stdout + out.stderr).splitlines() if " WARNING " in line and "_C" in line]
