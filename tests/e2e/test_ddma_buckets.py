"""The p2p transports' bucket model (megarl/ddma/bucket_model.py) is the one the transports run, the one
``megarl plan-sync`` reports and the one the simulator charges per-message latency with."""

from __future__ import annotations

import math

import pytest

from megarl.ddma.bucket_model import chunk_bytes, pair_messages
from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, vllm_param_layouts
from megarl.ddma.plan import plan_sync
from megarl.ddma.project import project_sync
from megarl.ddma.sync import SyncSpec
from megarl.ddma.transport.buckets import param_groups, pair_streams
from tests.harness.ddma import _dims


@pytest.mark.parametrize("bucket", [4096, 1 << 20])
def test_model_counts_the_transport_schedule(bucket):
    """Per pair, the schedule's messages (per group, ceil(stream bytes / chunk)) are the model's count,
    plus at most one per group (a group's last partial message)."""
    dims = _dims("qwen2_kv2")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(2, 1)
    spec = SyncSpec(dims, src, dst, "127.0.0.1", 1, transport="gloo", bucket_bytes=bucket)
    plan = plan_sync(dims, src, dst)
    chunk = chunk_bytes(bucket)
    assert chunk == bucket // 2
    most = 0
    for (s, d), copies in plan.pairs.items():
        groups = param_groups(vllm_param_layouts(dims, dst.tp, d.tp, dst.vocab_padding), 2, bucket)
        sizes = [sum(g.nbytes for g in segs) for segs in pair_streams(plan, spec, s, d, groups)]
        scheduled = sum(-(-n // chunk) for n in sizes)
        total = sum(c.numel for c in copies) * 2
        assert sum(sizes) == total
        model = pair_messages(total, bucket)
        assert model <= scheduled <= model + sum(1 for n in sizes if n)
        most = max(most, model)
    assert most > 1 if bucket == 4096 else most == 1  # a small budget splits pairs; a large one does not


def test_projection_reports_messages_and_adds_latency_per_rank():
    dims = _dims("llama_kv4_untied")
    src, dst = TrainerTopology(2, 1, 1), GeneratorTopology(1, 1)
    bucket = 4096
    r0 = project_sync(dims, src, dst, link_gbps=8.0, bucket_bytes=bucket)
    r = project_sync(dims, src, dst, link_gbps=8.0, bucket_bytes=bucket, message_us=20.0)
    plan = plan_sync(dims, src, dst)
    per_pair = [pair_messages(sum(c.numel for c in cs) * 2, bucket) for cs in plan.pairs.values() if cs]
    assert r["bucket_messages_total"] == sum(per_pair) and r["bucket_messages_per_pair"]["max"] == max(per_pair)
    assert r["bytes_per_message"] == r["total_bytes"] // sum(per_pair)
    # one worker receives every pair: it is the slowest rank, its bytes / bandwidth + all messages x 20 us
    worker_s = r["total_bytes"] / (8.0e9 / 8) + sum(per_pair) * 20e-6
    assert r0["projected_sync_latency_s"] == pytest.approx(r0["projected_sync_s"], rel=1e-12)
    assert r["projected_sync_latency_s"] == pytest.approx(worker_s, rel=1e-12)
    assert math.isclose(r["projected_sync_s"], r0["projected_sync_s"])
