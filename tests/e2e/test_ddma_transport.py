"""DDMA transports (megarl/ddma/transport/): the choice, nccl's rounds over gloo (cuda_ipc's logic:
tests/e2e/test_ddma_cuda_ipc.py).

- ``choose_transport``: from where the bytes live and whether the peers share a host; explicit wrong
  choices are config errors naming what to set.
- nccl: the same code that runs over NCCL on GPUs runs here over a gloo group of its own; with a tiny
  memory budget every parameter is split over many rounds and must still land exact bytes.
- the acknowledgement: a sender returns only after every worker acknowledged.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import types
from datetime import timedelta

import pytest
import torch

from megarl.ddma.layouts import GeneratorTopology, SrcRank, TrainerTopology
from megarl.ddma.plan import plan_sync
from megarl.ddma.sync import DdmaSender, DdmaTransportError, SyncSpec, host_store
from megarl.ddma.transport import choose_transport, transport_problem
from megarl.ddma.transport.base import plan_buckets
from megarl.ddma.transport.nccl import chunk_segments, param_groups, pair_streams
from megarl.models.layouts import hf_to_local
from tests.harness.ddma import _dims, _expected, _hf, _run, shard_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


@pytest.mark.parametrize("alias", ["auto", "p2p"])
def test_sync_spec_takes_only_a_resolved_transport(alias):
    """One resolution path: choose_transport, where the device is known. SyncSpec used to resolve an
    alias itself as if the bytes were on the CPU, a second and possibly wrong answer."""
    dims = _dims("llama_kv4_untied")
    with pytest.raises(ValueError, match="megarl.ddma.transport.choose_transport"):
        SyncSpec(dims, TrainerTopology(1, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", 1, transport=alias)
    with pytest.raises(ValueError, match="choose one of"):
        SyncSpec(dims, TrainerTopology(1, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", 1, transport="rdma")
    resolved = choose_transport(alias, device="cpu", same_host=True)
    spec = SyncSpec(dims, TrainerTopology(1, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", 1, transport=resolved)
    assert spec.transport == resolved


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
    from megarl.config.job import describe_sync, resolved_sync

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

@pytest.mark.parametrize("wire,bucket,coalescing", [("engine", 4096, False), ("engine", 1 << 30, False),
                                                     ("fp8", 777, False), ("engine", 4096, True), ("fp8", 777, True)])
def test_nccl_code_path_over_gloo_lands_exact_bytes(wire, bucket, coalescing):
    """A tiny budget splits parameters over many rounds (chunk edges fall inside copies, FP8 codes
    and scales); the landed bytes must not change. ``coalescing``: over CoalescingGlooDouble, the
    stand-in with NCCL's Backend signatures and coalescing contract (NCCL's branch of ``_round``)."""
    dims = _dims("qwen2_kv2")
    src, dst = TrainerTopology(2, 1, 2), GeneratorTopology(2, 1)
    _, res = _run(dims, src, dst, transport="nccl", wire=wire, versions=(1, 2) if wire == "engine" else (1,),
                  bucket_bytes=bucket, coalescing=coalescing)
    if coalescing:  # every round went through _start_coalescing() / _end_coalescing(), one batch each
        for _, _, stats in res["sent"]:
            assert stats["batches"] >= stats["rounds"] > 0
        for _, _, (_, stats) in res["got"]:
            assert stats["batches"] >= stats["rounds"] > 0
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
        shard = sum(math.prod(s) * 2 for s in shard_shapes(dims, src, rank))
        assert stats["peak_extra_bytes"] <= shard + 2 * min(bucket, shard)


@pytest.mark.parametrize("wire,bucket", [("engine", 1 << 20), ("engine", 4096), ("fp8", 1 << 20), ("fp8", 777)])
def test_nccl_cuda_path_copies_blocks_not_runs(wire, bucket):
    """On CUDA, nccl packs and lands with torch copies (no host memcpy). A trainer at TP2 feeding a TP1 worker
    sends o_proj and down_proj one run per row (524k runs a sync at Llama-3.1-8B: a launch each). Runs fold
    into strided blocks and FP8 message parts merge, so a (sender, parameter) pair in one chunk takes at most
    three copies (qkv: q, k and v; FP8: three for its codes, three for its scales), fewer than its runs. Forced on host tensors (``BucketedTransport.host_memcpy = False``). Breaks
    caught: one copy per run or per FP8 part (the counts), a block's stride or word width wrong (the bytes,
    also with chunk edges inside rows at 4096 / 777 bytes)."""
    dims = _dims("qwen2_kv2")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(1, 1)
    spec, res = _run(dims, src, dst, transport="nccl", wire=wire, versions=(1, 2), bucket_bytes=bucket,
                     coalescing=True, device_copies=True)
    plan = plan_sync(dims, src, dst)
    pairs = {s: cs for (s, _), cs in plan.pairs.items()}
    runs = sum(len(cs) for cs in pairs.values())
    for rank, v, (got, stats) in res["got"]:
        want = _expected(dims, dst, v, torch.float32, torch.bfloat16)[rank.tp]
        for n, w in want.items():
            if wire == "engine" or w.dim() == 1:
                assert torch.equal(got[n].view(torch.int16), w.view(torch.int16)), (v, n)
            else:  # the e4m3 round trip bound of test_ddma_sync.test_sync_fp8_before_send
                err = (got[n].float() - w.float()).abs()
                bound = w.float().abs() * (2 ** -4 + 2 ** -8) + w.float().abs().amax() * 2 ** -9 / 448 * 8
                assert bool((err <= bound + 1e-30).all()), n
        if bucket == 1 << 20:  # one chunk per group: copies per (sender, engine parameter) pair
            pieces = sum(len({c.dst_param for c in cs}) for cs in pairs.values())
            fp8 = 2 if wire == "fp8" else 1  # codes and scales: two message parts, then the dequantization
            assert 0 < stats["copies"] <= 3 * fp8 * pieces < runs, (stats["copies"], pieces, runs)
    for rank, v, stats in res["sent"]:
        if bucket == 1 << 20:  # per wire tensor: its copies folded (engine) or its codes' and scales' blocks
            tensors = len({c.src_param for c in pairs[rank]})
            assert 0 < stats["copies"] <= 3 * (2 if wire == "fp8" else 1) * tensors < len(pairs[rank])


@pytest.mark.parametrize("wire", ["engine", "fp8"])
def test_copy_counts_tool_at_llama_1b(wire, capsys):
    """tools/ddma_copy_counts.py (the figures in docs/ddma.md): at Llama-3.2-1B, trainer TP2 -> TP1, the worker's
    ~131k runs (one per row of o_proj and down_proj) take a few hundred copies with nccl and cuda_ipc, and
    FP8's ~263k message parts merge likewise. Break caught: a transport copying per run or per part again."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import ddma_copy_counts

    assert ddma_copy_counts.main(["--model", os.path.join(REPO, "configs/models/llama-3.2-1b.json"),
                                  "--wire", wire]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["runs"] > 100_000  # 16 layers x 2 senders x 2048 rows x (o_proj, down_proj)
    # a sender's 2048 rows of o_proj (2 KiB each) or down_proj (8 KiB) fold into a block or two (a 16 MiB chunk
    # holds 2048 to 8192 such rows): runs per copy are in the hundreds; 100 leaves room for the other
    # parameters' one run, one copy
    assert 0 < out["nccl_copies"] < out["runs"] / 100 and 0 < out["cuda_ipc_copies"] < out["runs"] / 100
    assert out["nccl_fp8_parts_unmerged"] == 0 if wire == "engine" else out["nccl_fp8_parts_unmerged"] > out["runs"]


def test_nccl_round_takes_the_backend_bindings_sequence():
    """``NcclTransport._round`` on the real c10d Backends: gloo does not coalesce (its own Works), and the
    coalescing calls as ``_round`` makes them are what the Backend binding takes -- no argument (the old
    ``_start_coalescing(device)`` is ProcessGroup's form: a TypeError on a Backend, before any op)."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    from megarl.ddma.transport.nccl import NcclTransport

    store = host_store()
    pg = ProcessGroupGloo(torch.distributed.PrefixStore("t", store), 0, 1, timedelta(seconds=10))
    assert pg.supports_coalescing is False
    NcclTransport._round(pg, [])  # the gloo branch, no op
    with pytest.raises(TypeError, match="incompatible function arguments"):
        pg._start_coalescing(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="does not implement startCoalescing"):
        pg._start_coalescing()  # the binding takes the call; gloo has no implementation behind it


class _RecordingGroup:
    """A group double that records how the transport uses it (no bytes move)."""

    supports_coalescing = False

    def __init__(self, store, rank, size, timeout_s, prefix="x"):
        from megarl.ddma.transport.base import group_prefix

        self.rank, self.prefix, self.connected = rank, group_prefix(store, prefix, rank), []

    def eager_connect_single_device(self, arg0):
        self.connected.append(arg0)


def test_nccl_rank_with_no_pairs_still_joins_and_each_group_has_its_own_prefix(monkeypatch):
    """A worker no sender feeds posts no round, yet joins the communicator (NCCL creates it with every
    rank of the group, lazily at the first batched round otherwise: a hang until the timeout); and a
    second group built on the same store gets a prefix of its own (a fixed one let it read the first
    group's stale NCCL id)."""
    from megarl.ddma.layouts import DstRank
    from megarl.ddma.transport import nccl
    from megarl.ddma.transport.base import group_prefix

    monkeypatch.setattr(nccl, "HOST_GROUP", _RecordingGroup)
    store = host_store()
    dims = _dims("llama_kv4_untied")
    spec = SyncSpec(dims, TrainerTopology(1, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", store.port, transport="nccl",
                    timeout_s=5)
    class Side:  # a worker whose plan has no copies for it
        src_ranks, dst_ranks = [SrcRank(0, 0, 0)], [DstRank(0, 0)]
        rank, device, layouts, incoming = DstRank(0, 0), torch.device("cpu"), {}, {}
        plan = types.SimpleNamespace(pairs={})

        def __init__(self):
            self.spec, self.store = spec, store

        def group_rank(self, r):
            return 0 if isinstance(r, SrcRank) else 1

    t = nccl.NcclTransport(Side())
    monkeypatch.setattr(t, "groups", lambda d: [])
    assert list(t.receive_params(1)) == [] and t.rounds == 0
    assert t._pg.connected == [torch.device("cpu")]  # joined, though it received nothing
    first = t._pg.prefix
    t2 = nccl.NcclTransport(Side())
    monkeypatch.setattr(t2, "groups", lambda d: [])
    list(t2.receive_params(1))
    assert t2._pg.prefix != first
    # the ranks that build their n-th group together agree on its prefix, with no message
    assert [group_prefix(store, "p", r) for r in (0, 1, 0, 1)] == ["p/1", "p/1", "p/2", "p/2"]


# --- the acknowledgement -------------------------------------------------------------------------

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


# --- no silent fallback -------------------------------------------------------------------------

_START = textwrap.dedent("""
    import logging, sys
    from megarl.config import ConfigError, load_config
    import megarl.config.job as job
    import megarl.controller.loop as loop
    class Stop(Exception):
        pass
    def stop(*a, **k):
        raise Stop()
    job.resolve_model = stop  # the first step after the start-up checks
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
        # tools/run_tests.sh (CI) sets MEGARL_REQUIRE_NATIVE=1: there the extension must have built
        assert os.environ.get("MEGARL_REQUIRE_NATIVE") != "1", "MEGARL_REQUIRE_NATIVE=1 but the extension is missing"
        pytest.skip("extension not built here")
    out = _start("required", no_native=False)
    assert "STARTED" in out.stdout, out.stdout + out.stderr[-2000:]
    assert not [line for line in (out.stdout + out.stderr).splitlines() if " WARNING " in line and "_C" in line]
