"""Projection for ``megarl plan-sync``: bytes, messages and link time of a DDMA plan, and a baseline.

Link model: every rank (trainer rank or generator worker) has one NIC of ``link_gbps`` Gb/s, full
duplex (sending and receiving do not share bandwidth). A sync is bounded by its busiest link, so

    busiest_link_bytes = max over all ranks of max(bytes sent, bytes received)
    projected_sync_s   = busiest_link_bytes * 8 / (link_gbps * 1e9)

(NVLink inside a node and congestion are ignored: a lower bound per topology). Messages follow the
transports' bucket model (``megarl/ddma/bucket_model.py``): a pair's bytes move in messages of half
``bucket_mb``; with ``message_us`` > 0 every rank's time is its bytes / bandwidth plus its messages x
``message_us`` (a rank's messages are serialised on its NIC), and the sync is its slowest rank:

    projected_sync_latency_s = max over ranks of (bytes / bandwidth + messages * message_us)

Baseline ("gather to trainer rank 0, then broadcast", over rank 0's one link, the two phases one
after the other, not overlapped):

    gather_bytes    = model_bytes - rank0_shard_bytes  (rank 0 receives every HF element it lacks)
    broadcast_bytes = sum over generator workers of the bytes of that worker's shard
                      (rank 0 sends each worker exactly its shard: replicas x model bytes, plus KV heads
                      vLLM replicates when generator TP > num_key_value_heads)
    baseline_s      = (gather_bytes + broadcast_bytes) * 8 / (link_gbps * 1e9)

``model_bytes`` counts HF elements only (no vocab padding; a tied embedding once). Byte sizes:
bf16 = 2 bytes per element, fp8 = 1 byte per element; fp8 scales are IGNORED (not added).
"""

from __future__ import annotations

import math
import statistics
import time

from megarl.ddma.bucket_model import DEFAULT_BUCKET_BYTES, chunk_bytes, pair_messages
from megarl.ddma.layouts import GeneratorTopology, TrainerTopology, source_rank_layouts
from megarl.ddma.plan import plan_sync
from megarl.models.layouts import ModelDims, hf_tensor_shapes

BYTES_PER_ELEMENT = {"bf16": 2, "fp8": 1}


def _piece_numel(p) -> int:
    return p.length * math.prod(p.hf_shape) // p.hf_shape[p.dim]


def _stats(values) -> dict:
    values = sorted(values)
    return {"min": values[0], "median": statistics.median_low(values), "max": values[-1]}


def project_sync(dims: ModelDims, src: TrainerTopology, dst: GeneratorTopology, dtype: str = "bf16",
                 link_gbps: float = 400.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, message_us: float = 0.0) -> dict:
    """Plan the sync and return every number ``megarl plan-sync`` prints (JSON-serialisable)."""
    bpe = BYTES_PER_ELEMENT[dtype]
    t0 = time.perf_counter()
    plan = plan_sync(dims, src, dst)
    plan_s = time.perf_counter() - t0
    sent, recv = plan.bytes_sent(bpe), plan.bytes_received(bpe)
    msg_sent, msg_recv = plan.messages_sent(), plan.messages_received()
    links = [(f"trainer {r}", v) for r, v in sorted(sent.items())] + \
        [(f"generator {r}", v) for r, v in sorted(recv.items())]
    busiest_rank, busiest = max(links, key=lambda kv: kv[1])  # first (lowest) rank among ties
    bytes_per_s = link_gbps * 1e9 / 8
    model_elems = sum(math.prod(s) for s in hf_tensor_shapes(dims).values())
    rank0_elems = sum(_piece_numel(p) for lay in source_rank_layouts(dims, src, 0, 0).values() for p in lay.pieces)
    model_bytes, rank0_bytes = model_elems * bpe, rank0_elems * bpe
    gather, broadcast = model_bytes - rank0_bytes, sum(recv.values())
    total = sum(sent.values())
    projected_s = busiest / bytes_per_s
    # the bucket model: messages per pair, and each rank's bytes and messages
    pair_bytes = {k: sum(c.numel for c in cs) * bpe for k, cs in plan.pairs.items() if cs}
    pair_msgs = {k: pair_messages(n, bucket_bytes) for k, n in pair_bytes.items()}
    rank_bytes, rank_msgs = {}, {}
    for (s_, d_), n in pair_bytes.items():
        for r in (("trainer", s_), ("generator", d_)):
            rank_bytes[r] = rank_bytes.get(r, 0) + n
            rank_msgs[r] = rank_msgs.get(r, 0) + pair_msgs[(s_, d_)]
    latency_s = max((rank_bytes[r] / bytes_per_s + rank_msgs[r] * message_us * 1e-6 for r in rank_bytes),
                    default=0.0)
    n_msgs = sum(pair_msgs.values())
    baseline_s = (gather + broadcast) / bytes_per_s
    return {
        "trainer": {"tp": src.tp, "pp": src.pp, "dp": src.dp, "ranks": len(sent)},
        "generator": {"tp": dst.tp, "replicas": dst.replicas, "workers": len(recv)},
        "dtype": dtype, "bytes_per_element": bpe, "fp8_scales": "ignored" if dtype == "fp8" else None,
        "link_gbps": link_gbps,
        "model_params": model_elems, "model_bytes": model_bytes,
        "total_bytes": total,
        "bytes_sent_per_trainer_rank": _stats(sent.values()),
        "bytes_received_per_generator_worker": _stats(recv.values()),
        "messages": len(plan.pairs),
        "messages_sent_per_trainer_rank_max": max(msg_sent.values()),
        "messages_received_per_generator_worker_max": max(msg_recv.values()),
        "copies": plan.num_copies(),
        "bucket_bytes": bucket_bytes, "chunk_bytes": chunk_bytes(bucket_bytes),
        "bucket_messages_per_pair": _stats(pair_msgs.values()) if pair_msgs else None,
        "bucket_messages_total": n_msgs,
        "bytes_per_message": sum(pair_bytes.values()) // max(1, n_msgs),
        "bucket_messages_per_rank_max": max(rank_msgs.values(), default=0),
        "message_us": message_us, "projected_sync_latency_s": latency_s,
        "busiest_link_bytes": busiest, "busiest_rank": busiest_rank,
        "projected_sync_s": projected_s,
        "baseline": {"model": "gather the full model to trainer rank 0, then send every generator worker its "
                              "shard, both over rank 0's one link, one after the other",
                     "rank0_shard_bytes": rank0_bytes, "gather_bytes": gather, "broadcast_bytes": broadcast,
                     "link_bytes": gather + broadcast, "sync_s": baseline_s},
        "speedup_vs_baseline": baseline_s / projected_s if projected_s else None,
        "plan_seconds": plan_s,
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def format_projection(r: dict) -> str:
    """The human-readable report of :func:`project_sync`'s dict."""
    t, g, b = r["trainer"], r["generator"], r["baseline"]
    s, v = r["bytes_sent_per_trainer_rank"], r["bytes_received_per_generator_worker"]
    m = r["bucket_messages_per_pair"] or {"min": 0, "median": 0, "max": 0}
    dtype = r["dtype"] + (" (1 byte/element; fp8 scales ignored)" if r["dtype"] == "fp8" else " (2 bytes/element)")
    lines = [
        f"trainer TP{t['tp']} x PP{t['pp']} x DP{t['dp']} ({t['ranks']} ranks) -> generator TP{g['tp']} x "
        f"{g['replicas']} replicas ({g['workers']} workers), {dtype}, link {r['link_gbps']:g} Gb/s per rank (duplex)",
        f"model:                  {r['model_params']:,} params = {_gb(r['model_bytes'])}",
        f"total bytes moved:      {_gb(r['total_bytes'])} ({r['total_bytes']:,} B)",
        f"sent per trainer rank:  min {_gb(s['min'])}  median {_gb(s['median'])}  max {_gb(s['max'])}",
        f"recv per gen. worker:   min {_gb(v['min'])}  median {_gb(v['median'])}  max {_gb(v['max'])}",
        f"messages:               {r['messages']} (src,dst) pairs, max {r['messages_sent_per_trainer_rank_max']} "
        f"sent per trainer rank, max {r['messages_received_per_generator_worker_max']} received per worker; "
        f"{r['copies']:,} copy runs",
        f"bucket messages:        {r['bucket_messages_total']:,} of {r['chunk_bytes'] / 2**20:g} MiB at most "
        f"(bucket {r['bucket_bytes'] / 2**20:g} MiB); per pair min {m['min']} median {m['median']} max {m['max']}; "
        f"{r['bytes_per_message'] / 1e6:.1f} MB per message on average; at most {r['bucket_messages_per_rank_max']} "
        f"at one rank",
        f"busiest link:           {_gb(r['busiest_link_bytes'])} ({r['busiest_rank']})",
        f"projected sync (DDMA):  {r['projected_sync_s']:.3f} s   (busiest link bytes / link bandwidth)",
        f"  with {r['message_us']:g} us/message: {r['projected_sync_latency_s']:.3f} s   (slowest rank: bytes / "
        f"bandwidth + messages x latency)",
        f"baseline (rank 0):      {b['sync_s']:.3f} s   = gather {_gb(b['gather_bytes'])} (model minus rank 0's "
        f"shard {_gb(b['rank0_shard_bytes'])}) + broadcast {_gb(b['broadcast_bytes'])} (every worker's shard), "
        f"sequential over rank 0's link",
        f"speedup vs baseline:    {r['speedup_vs_baseline']:.1f}x" if r["speedup_vs_baseline"] else
        "speedup vs baseline:    n/a",
        f"planned in {r['plan_seconds']:.2f} s",
    ]
    return "\n".join(lines)


__all__ = ["project_sync", "format_projection", "BYTES_PER_ELEMENT"]
