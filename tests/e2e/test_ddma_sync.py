"""DDMA at run time between real processes: trainer-rank senders with simulated shards (built from
random HF tensors through the trainer layouts) and generator-worker receivers, over both
transports (zero-copy reads and gloo point-to-point; nccl's code over gloo and cuda_ipc's through a
host-memory double of its CUDA calls are in tests/e2e/test_ddma_transport.py and test_ddma_cuda_ipc.py), engine-dtype and FP8 wires.

What lands in every worker is compared with an independent vLLM-layout reference built from the
HF tensors (tests/harness/ddma.py's ``_expected_vllm``): bitwise for bf16/fp32, and for FP8
equal to the per-row e4m3 round trip of the trainer's row. A corrupted plan must fail
verification naming the tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.ddma.layouts import GeneratorTopology, SrcRank, TrainerTopology
from megarl.ddma.sync import DdmaReceiver, DdmaVerifyError, SyncSpec, host_store
from tests.harness.ddma import TIMEOUT_S, _dims, _expected, _expected_vllm, _run


def _shapes(dims, src, rank):
    from megarl.ddma.layouts import source_rank_layouts

    return {n: l.local_shape for n, l in source_rank_layouts(dims, src, rank.tp, rank.pp).items()}


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
