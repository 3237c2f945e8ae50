"""DDMA landing matrix: after a DDMA sync, every vLLM engine parameter is bit for bit what vLLM's
own loader makes of the same HF checkpoint.

Per case: the trainer (real Megatron ranks, TrainerExecutor) holds checkpoint B; the engine
(GeneratorExecutor, fp32) starts from checkpoint A of the same architecture. A DDMA sync at v0
lands B; the engine captures every parameter as it landed (megarl/generator/landing.py: the moment
before vLLM packs it for its CPU kernels). Then vLLM's own loaders read B from its HF tensors (the
shm source: checkpoint format, narrowed by vLLM's weight loaders) and the engine captures again:
that is the reference. fp32 on both sides and pure copies on both paths, so equality is exact.

The cases cover each axis at least twice: family (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k
norms and a decoupled head_dim; Mistral and Llama 3.2-style rope scaling once each), tied and
untied embeddings, KV heads below / equal to / above the generator's TP (below: vLLM replicates KV
heads), trainer TP, PP and DP of 1 and 2, generator TP 1 and 2. MoE rows (Qwen3-MoE): the router and
every expert's block of vLLM's stacked ``w13_weight`` / ``w2_weight``, trainer EP 1 and 2, generator TP 1 and 2.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from megarl.algorithms.config import AlgorithmConfig
from megarl.config import load_config
from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
from megarl.ddma.sync import SyncSpec, host_store
from megarl.generator.errors import GeneratorError
from megarl.generator.executor import GeneratorExecutor
from megarl.generator.shm_source import pack_to_shm
from megarl.models.tiny import LLAMA32_TINY_ROPE, make_tiny_hf_checkpoint
from megarl.trainer.config import TrainerConfig
from megarl.trainer.convert import HFReader
from megarl.trainer.executor import TrainerExecutor
from megarl.models.layouts import ModelDims
from megarl.trainer.model import read_hf_config

REPO = Path(__file__).resolve().parents[2]

# (family, tied, kv heads, trainer tp, pp, dp, generator tp); 4 query heads everywhere.
# kv vs generator tp: 2>1 above, 1<2 below (replicated), 2=2 equal, 4>2 above, 1<2 below, 1=1 equal,
# 2=2 equal, 1<2 below, 4>2 above, 2>1 above. Every family at least once; trainer TP2, PP2, DP2 and
# generator TP2 each at least twice among the new families too. Five rows are slow (CI time: 50-76 s a
# row); the default suite still has every model family (Llama through llama32), tied and untied, KV below
# (qwen2 tied) / equal (qwen2, qwen3 untied) / above (mistral, llama32) the generator's TP, trainer TP2
# (qwen2, qwen3, mistral), PP2 (qwen2 tied, mistral) and DP2 (qwen2 untied, llama32), generator TP1 and TP2.
CASES = [
    pytest.param(("qwen2", False, 2, 1, 1, 1, 1), marks=pytest.mark.slow),
    ("qwen2", True, 1, 1, 2, 1, 2),
    ("qwen2", False, 2, 2, 1, 2, 2),
    pytest.param(("llama", True, 4, 2, 2, 1, 2), marks=pytest.mark.slow),
    pytest.param(("llama", False, 1, 1, 1, 2, 2), marks=pytest.mark.slow),
    pytest.param(("llama", True, 1, 1, 2, 2, 1), marks=pytest.mark.slow),
    ("qwen3", False, 2, 2, 1, 1, 2),
    pytest.param(("qwen3", True, 1, 1, 2, 2, 2), marks=pytest.mark.slow),
    ("mistral", False, 4, 2, 2, 1, 2),
    ("llama32", True, 2, 1, 1, 2, 1),
]
# case family -> (model family, extra make_tiny_hf_checkpoint arguments)
TINY = {"qwen2": ("qwen2", {}), "llama": ("llama", {}), "mistral": ("mistral", {}),
        # head_dim 64 != hidden 128 / 4 heads: kv_channels decoupled, as in Qwen3-8B (128 vs 4096 / 32)
        "qwen3": ("qwen3", {"head_dim": 64}),
        "llama32": ("llama", {"rope_scaling": LLAMA32_TINY_ROPE})}


def _case_id(c) -> str:
    fam, tied, kvh, ttp, tpp, tdp, gtp = c
    return f"{fam}-{'tied' if tied else 'untied'}-kv{kvh}-t{ttp}x{tpp}x{tdp}-g{gtp}"


def _checkpoints(root: Path, family: str, tied: bool, kvh: int) -> tuple[Path, Path]:
    model_family, extra = TINY[family]
    kw = dict(num_kv_heads=kvh, tie_word_embeddings=tied, **extra)
    return (make_tiny_hf_checkpoint(root / "a", model_family, seed=21, **kw),
            make_tiny_hf_checkpoint(root / "b", model_family, seed=22, **kw))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ddma_lands_what_vllms_loader_lands(case, tmp_path):
    family, tied, kvh, ttp, tpp, tdp, gtp = case
    _assert_lands_like_vllms_loader(tmp_path, *_checkpoints(tmp_path, family, tied, kvh), ttp, tpp, tdp, gtp)


# MoE rows (Qwen3-MoE, 4 experts, top-2; layer 0 sparse, layer 1 dense): (trainer ep, dp, generator tp).
# Trainer EP 1 and 2 (DP replica d holds EP rank d % ep's experts), generator TP 1 and 2 (vLLM splits
# each expert's intermediate dim: w13_weight[e] = [gate_r; up_r], w2_weight[e] = down's columns).
# The default row is the one that has both (EP2 into TP2, ~40-65 s here); the others are slow (~35-80 s).
MOE_CASES = [pytest.param((1, 1, 2), marks=pytest.mark.slow), pytest.param((2, 2, 1), marks=pytest.mark.slow),
             (2, 2, 2)]


def _moe_id(c) -> str:
    ep, tdp, gtp = c
    return f"qwen3_moe-ep{ep}-t1x1x{tdp}-g{gtp}"


def _moe_checkpoints(root: Path) -> tuple[Path, Path]:
    return tuple(make_tiny_hf_checkpoint(root / n, "qwen3_moe", head_dim=64, seed=seed,
                                         extra_config={"mlp_only_layers": [1]}) for n, seed in (("a", 21), ("b", 22)))


@pytest.mark.parametrize("case", MOE_CASES, ids=_moe_id)
def test_ddma_lands_experts_like_vllms_loader(case, tmp_path):
    ep, tdp, gtp = case
    _assert_lands_like_vllms_loader(tmp_path, *_moe_checkpoints(tmp_path), 1, 1, tdp, gtp, ep=ep)


# The planted expert-index bug (docs/moe.md): the receiver lands DDMA's block of expert e at e+1 mod E.
# The landing runs in the generator's replica process (spawned: a monkeypatch here never reaches it;
# at generator TP1 vLLM's worker lives in that process), so the plant travels in the weight source
# itself: unpickling a _ShiftedExperts there (the replica's pipe) runs _shift_landed_experts in it.
def _shift_landed_experts(num_experts: int, monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Make ``megarl.generator.ddma_source.expert_checkpoint_name`` (DDMA's per-expert block ->
    the checkpoint name, expert index included, that FusedMoE's loader lands) name expert
    (e + 1) % ``num_experts`` for block e. Idempotent; in a replica it stays for the process's life."""
    from megarl.generator import ddma_source

    right = ddma_source.expert_checkpoint_name
    if getattr(right, "planted", False):
        return

    def shifted(dparam: str) -> str:
        head, _, e = dparam.rpartition(".")
        if head.rpartition(".")[2] in ddma_source.EXPERT_PARAMS and e.isdecimal():
            dparam = f"{head}.{(int(e) + 1) % num_experts}"
        return right(dparam)

    shifted.planted = True
    (monkeypatch or pytest.MonkeyPatch()).setattr(ddma_source, "expert_checkpoint_name", shifted)


class _ShiftedExperts:
    """Put in a weight source: whoever unpickles the source gets the plant applied."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def __reduce__(self):
        return _shift_landed_experts, (self.num_experts,)


def test_ddma_landing_catches_a_planted_expert_index_bug(tmp_path, monkeypatch):
    """The MoE row (ep2 dp2 -> generator TP1) with expert e landed at e+1 mod E fails twice over:
    with verification off the comparison against vLLM's loader names both stacked expert tensors
    (and only them); with checksums on the sync stops, naming expert 0's down_proj and where it landed."""
    ckpt_a, ckpt_b = _moe_checkpoints(tmp_path)
    num_experts = ModelDims.from_hf_config(read_hf_config(ckpt_b)).num_experts
    assert num_experts == 4
    # What the plant does (here, undone at teardown; the replica gets its own copy from the source):
    _shift_landed_experts(num_experts, monkeypatch)
    from megarl.generator import ddma_source
    assert (ddma_source.expert_checkpoint_name("model.layers.0.mlp.experts.routed_experts.w2_weight.3")
            == "model.layers.0.mlp.experts.0.down_proj.weight")
    plant = {"plant": _ShiftedExperts(num_experts)}
    failure = {}

    def sync_with_checksums(trainer, gen, spec) -> None:  # last: a failed landing ends the replica
        on = dataclasses.replace(spec, verify_every=1)
        trainer.start_sync(on, 2)
        with pytest.raises(GeneratorError) as excinfo:
            gen.update_weights_from_source({**on.weight_source(2), **plant}, 2)
        trainer.finish_sync()  # the senders finished: the wire was right, the landing was not
        failure["error"] = str(excinfo.value)

    wrong = _landing_differences(tmp_path, ckpt_a, ckpt_b, 1, 1, 2, 1, ep=2, verify_every=0, extra_source=plant,
                                 then=sync_with_checksums)
    assert len(wrong) == 1
    assert sorted(n.rsplit(".", 1)[-1] for n in wrong[0]) == ["w13_weight", "w2_weight"], wrong
    assert all(n.startswith("model.layers.0.") for n in wrong[0]), wrong  # layer 1 is dense
    first = failure["error"].splitlines()[0]
    assert "DdmaVerifyError" in first and "model.layers.0.mlp.experts.0.down_proj.weight checksum 0x" in first, first
    assert " != 0x" in first and "landed at model.layers.0.mlp.experts.routed_experts.w2_weight.0 " in first, first


def _assert_lands_like_vllms_loader(tmp_path: Path, ckpt_a: Path, ckpt_b: Path, ttp: int, tpp: int, tdp: int,
                                    gtp: int, ep: int = 1) -> None:
    wrong = _landing_differences(tmp_path, ckpt_a, ckpt_b, ttp, tpp, tdp, gtp, ep=ep)
    for rank, names in enumerate(wrong):
        assert not names, f"tp rank {rank}: DDMA landed {len(names)} parameter(s) unlike vLLM's loader: {names[:6]}"


def _landing_differences(tmp_path: Path, ckpt_a: Path, ckpt_b: Path, ttp: int, tpp: int, tdp: int, gtp: int,
                         ep: int = 1, verify_every: int = 1, extra_source: dict | None = None,
                         then=None) -> list[list[str]]:
    """Per generator TP rank, the engine parameters a DDMA sync (v0, its weight source plus
    ``extra_source``) landed unlike vLLM's own loader (v1). ``then(trainer, gen, spec)`` runs after
    both, before the executors close."""
    overrides = [f"model.path={ckpt_a}", "generator.dtype=float32", f"generator.tp={gtp}"]
    if gtp == 2:
        overrides.append("generator.threads_bind=0|1")
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", overrides)
    dims = ModelDims.from_hf_config(read_hf_config(ckpt_b))
    store = host_store()
    spec = SyncSpec(dims, TrainerTopology(ttp, tpp, tdp, ep=ep), GeneratorTopology(gtp, 1), "127.0.0.1", store.port,
                    engine_dtype="float32", verify_every=verify_every, timeout_s=120,)
    cpus = [0, 1] if len(os.sched_getaffinity(0)) >= 2 else None
    with TrainerExecutor(TrainerConfig(tp=ttp, pp=tpp, dp=tdp, ep=ep), AlgorithmConfig(), ckpt_b, total_steps=1,
                         run_dir=tmp_path, cpus=cpus) as trainer, GeneratorExecutor(cfg.generator, ckpt_a) as gen:
        trainer.start_sync(spec, 0)
        gen.update_weights_from_source({**spec.weight_source(0), "capture": True, **(extra_source or {})}, 0)
        trainer.finish_sync()
        ddma = gen.landed_weights(0)
        reader = HFReader(ckpt_b)
        shm = pack_to_shm(((n, reader(n)) for n in reader.names()), dtype=torch.float32)
        try:
            gen.update_weights_from_source({**shm.source(), "capture": True}, 1)
        finally:
            shm.unlink()
        reference = gen.landed_weights(0)
        if then is not None:
            then(trainer, gen, spec)
    assert len(ddma) == len(reference) == gtp
    for rank, (got, want) in enumerate(zip(ddma, reference)):
        assert want, f"tp rank {rank}: vLLM's loader landed nothing"
        assert sorted(got) == sorted(want), f"tp rank {rank}: DDMA landed other parameters than vLLM's loader"
    return [[n for n in want if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
            for got, want in zip(ddma, reference)]
