"""DDMA into a real vLLM engine from a real multi-rank Megatron trainer (the TrainerExecutor: its
ranks in their own processes), checked against the established full-tensor shared-memory path.

The engine starts from checkpoint A; the trainer ranks hold checkpoint B. After a DDMA sync the
engine's greedy generations and logprobs must be *bitwise* those it gives after loading B through
the shm path (same bytes in the engine -> same arithmetic), and must differ from A's (so a sync
that kept old weights fails). With FP8 (engine re-quantizes on arrival, wire FP8 before send) the
two paths quantize differently (DDMA: per trainer row, then the engine again), so logprobs agree
within a bound derived from e4m3 precision instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.config import load_config
from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
from megarl.ddma.sync import SyncSpec, host_store
from megarl.ddma.transport import choose_transport
from megarl.trainer.executor import TrainerExecutor
from megarl.generator.executor import GeneratorExecutor
from megarl.models.tiny import make_tiny_hf_checkpoint
from megarl.trainer.config import TrainerConfig
from megarl.trainer.convert import HFReader
from megarl.models.layouts import ModelDims
from megarl.trainer.model import read_hf_config

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 504, 3180, 314], [1, 2683, 314, 253, 1345]]
GREEDY = {"temperature": 0.0}


def _run(gen, prompts=PROMPTS):
    samples = gen.generate(prompts, n_samples=1, sampling=GREEDY)
    return [s.completion_ids for s in samples], [torch.tensor(s.behav_logprobs) for s in samples]


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory):
    # the tiny_llama_dir fixture's architecture (4 heads, 2 KV heads, untied) with other weights
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_llama_b"), "llama", seed=5)


@pytest.mark.parametrize("ttp,tpp,gtp,dtype,transport", [
    (2, 1, 1, "float32", "zero_copy"),
    (1, 2, 2, "bfloat16", "p2p"),
], ids=str)
def test_ddma_sync_equals_shm_push(tiny_llama_dir, checkpoint_b, tmp_path, ttp, tpp, gtp, dtype, transport):
    overrides = [f"model.path={tiny_llama_dir}", f"generator.dtype={dtype}", "generator.max_new_tokens=12",
                 f"generator.tp={gtp}"]
    if gtp == 2:
        overrides.append("generator.threads_bind=0|1")
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", overrides)
    dims = ModelDims.from_hf_config(read_hf_config(tiny_llama_dir))
    store = host_store()
    spec = SyncSpec(dims, TrainerTopology(ttp, tpp, 1), GeneratorTopology(gtp, 1), "127.0.0.1", store.port,
                    transport=choose_transport(transport, device="cpu", same_host=True), engine_dtype=dtype,
                    timeout_s=120)
    cpus = [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None
    with TrainerExecutor(TrainerConfig(tp=ttp, pp=tpp), AlgorithmConfig(), checkpoint_b, total_steps=1,
                         run_dir=tmp_path, cpus=cpus) as trainer, \
            GeneratorExecutor(cfg.generator, tiny_llama_dir) as gen:
        ids_a, lps_a = _run(gen)
        trainer.start_sync(spec, 1)
        gen.update_weights_from_source(spec.weight_source(1), 1)
        sent = trainer.finish_sync()
        ids_ddma, lps_ddma = _run(gen)
        reader = HFReader(checkpoint_b)
        gen.update_weights(((n, reader(n)) for n in reader.names()), version=2)
        ids_shm, lps_shm = _run(gen)
    assert ids_ddma == ids_shm
    for a, b in zip(lps_ddma, lps_shm):
        assert torch.equal(a, b)
    assert ids_a != ids_ddma or any(not torch.equal(a, b) for a, b in zip(lps_a, lps_ddma))
    assert sum(s["bytes_sent"] for s in sent) > 0



def _trainer_gap(trainer, gen) -> float:
    """Max |engine - trainer| logprob over the engine's own greedy tokens (teacher-forced on the
    trainer: the same tokens on both sides, whatever the engine chose)."""
    from megarl.batch import RolloutBatch

    batch = RolloutBatch.from_samples(gen.generate(PROMPTS, n_samples=1, sampling=GREEDY))
    lp = trainer.logprobs(batch, temperature=1.0)
    return float(((lp - batch.behav_logprobs).abs() * batch.loss_mask).max())


def test_ddma_fp8_before_send_into_an_fp8_engine(tiny_llama_dir, checkpoint_b, tmp_path):
    """FP8 on the wire (per trainer row) into an FP8 engine (vLLM re-quantizes per its own row on
    arrival) against the shm push of the same weights (vLLM quantizes the bf16 weights itself),
    both measured against the trainer's exact fp32 logprobs on the engine's tokens.

    Both engines hold per-channel e4m3 weights of the same tensors: each weight is within half an
    e4m3 step (2^-4 relative) of the trainer's for the shm path; the DDMA path rounds twice (trainer
    row, then the engine's row: the trainer's TP2 o_proj/down_proj rows are half rows), so within
    2 x 2^-4. Logprob errors scale with the weight error, hence DDMA <= 2x shm (+ the bf16
    activation noise both share, bounded by the bf16 probe bound 0.25 / 10). With the old
    weights (no sync) the gap is the whole checkpoint change: it must be far larger."""
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_dir}", "generator.dtype=bfloat16", "generator.quantization=fp8_per_channel",
        "generator.max_new_tokens=12"])
    dims = ModelDims.from_hf_config(read_hf_config(tiny_llama_dir))
    store = host_store()
    spec = SyncSpec(dims, TrainerTopology(2, 1, 1), GeneratorTopology(1, 1), "127.0.0.1", store.port,
                    wire="fp8", engine_dtype="bfloat16", timeout_s=120)
    with TrainerExecutor(TrainerConfig(tp=2), AlgorithmConfig(), checkpoint_b, total_steps=1,
                         run_dir=tmp_path) as trainer, GeneratorExecutor(cfg.generator, tiny_llama_dir) as gen:
        gap_old = _trainer_gap(trainer, gen)
        trainer.start_sync(spec, 1)
        gen.update_weights_from_source(spec.weight_source(1), 1)
        sent = trainer.finish_sync()
        gap_ddma = _trainer_gap(trainer, gen)
        reader = HFReader(checkpoint_b)
        gen.update_weights(((n, reader(n)) for n in reader.names()), version=2)
        gap_shm = _trainer_gap(trainer, gen)
    # half the bytes of a bf16 wire: one byte per weight element (+ 4 bytes per row scale, norms in bf16)
    numel = sum(int(torch.Size(reader(n).shape).numel()) for n in reader.names())
    assert sum(s["bytes_sent"] for s in sent) < 1.1 * numel
    print(f"fp8 logprob gaps vs trainer: ddma {gap_ddma:.4f} shm {gap_shm:.4f} old weights {gap_old:.4f}")
    assert gap_ddma <= 2 * gap_shm + 0.025, (gap_ddma, gap_shm)
    # A sync that kept the old weights leaves the engine on another checkpoint, an O(1)-relative change of
    # every weight against FP8's <= 2 x 2^-4 (above): its gap must dwarf the FP8 one; 4x leaves room for
    # the bf16 activation noise in both.
    assert gap_old > 4 * gap_ddma, (gap_old, gap_ddma)
