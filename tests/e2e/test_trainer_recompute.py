"""trainer.recompute (megatron-core's activation recompute, megarl/trainer/model.py recompute_kwargs):
a training step with selective or full recompute gives the same loss, gradient norm and updated
weights as none, and holds less memory over the step.

Equality is asserted bit for bit. Recompute reruns the same forward ops on the same saved inputs
(attention_dropout = hidden_dropout = 0, so no RNG enters; megatron also restores the RNG states) in
the same order with the same CPU kernels and thread count, so the recomputed activations equal the
ones a no-recompute forward keeps, bit for bit, and so do the gradients and Adam's update built from
them. Any difference would mean recompute changed the math (e.g. a module rerun in another
precision), which an fp32 tolerance would hide.

Memory: the modes run one after another in one process; the peak resident set over one ``train_step`` is Linux's
VmHWM after resetting it (``echo 5 > /proc/self/clear_refs``) just before the step, minus the RSS at
that point (weights, optimizer state, Python/torch). The shape makes the [b, heads, s, s] attention
scores the largest activation (seq 384, 8 heads, 4 layers), so selective (scores recomputed) must
hold less than none, and full (only each layer's input kept) less than selective.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.utils.dist import run_multiprocess

SEQ, BATCH, VOCAB, LAYERS, HEADS = 384, 4, 1024, 4, 8  # VOCAB: the token ids drawn (the model's is 49152)


@pytest.fixture(scope="module")
def scores_heavy_dir(tmp_path_factory):
    from megarl.models.tiny import make_tiny_hf_checkpoint

    # head_dim 32 x 8 heads = hidden 256: a layer's scores (b*heads*s*s*4 B = 4*8*384*384*4 = 18.9 MB)
    # dwarf its [s, b, h] tensors (384*4*256*4 = 1.6 MB)
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny_scores"), "llama", num_layers=LAYERS,
                                   hidden_size=256, num_heads=HEADS, num_kv_heads=4, head_dim=32,
                                   intermediate_size=256, seed=7)


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    lengths = [SEQ, SEQ - 17, SEQ - 40, SEQ - 3]
    tokens = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    masks = [[0.0] * 8 + [1.0] * (n - 8) for n in lengths]
    behav = [[-5.0] * n for n in lengths]
    return RolloutBatch.from_sequences(tokens, masks, behav_logprobs=behav, advantages=[1.0, -1.0, 0.5, 1.0],
                                       versions=[[0] * n for n in lengths])


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _worker(rank, world, hf_dir, batch, modes):
    import gc

    from megarl.models.layouts import ModelDims
    from megarl.trainer.config import TrainerConfig
    from megarl.trainer.convert import load_hf_into_model
    from megarl.trainer.model import build_gpt_model, read_hf_config, unwrap
    from megarl.trainer.optimizer import build_training
    from megarl.trainer.shards import local_shard_specs
    from megarl.trainer.train_step import train_step
    from megarl.utils.dist import init_model_parallel

    out = {}
    for recompute in modes:  # one process, one mode after another: the peak is reset before each step
        cfg = TrainerConfig(lr=1e-3, grad_clip=1.0, recompute=recompute)
        init_model_parallel(1, 1, seed=1)
        model = build_gpt_model(ModelDims.from_hf_config(read_hf_config(hf_dir)), recompute=cfg.recompute)
        load_hf_into_model(model, hf_dir)
        objs = build_training(cfg, model, total_steps=1)
        conf = unwrap(model).config
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS
        before = _rss("VmRSS")
        metrics = train_step(objs, batch, loss_name="aipo", loss_params={"rho": 4.0, "entropy_coef": 0.0},
                             micro_batch_size=BATCH, current_version=0)
        peak = _rss("VmHWM") - before
        # the updated weights, bit for bit (a digest: tensors do not survive the worker's exit)
        weights = [hashlib.sha256(s.local_view.detach().contiguous().numpy().tobytes()).hexdigest()
                   for s in local_shard_specs(model)]
        out[recompute] = dict(loss=metrics["loss"], grad_norm=metrics["grad_norm"], weights=weights, peak=peak,
                              granularity=conf.recompute_granularity, modules=list(conf.recompute_modules or []))
        del model, objs, metrics
        gc.collect()
    return out


def test_recompute_same_step_less_memory(scores_heavy_dir, monkeypatch):
    # glibc returns freed blocks >= 64 KiB to the kernel at once (mmap), so RSS follows live tensors
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    runs = run_multiprocess(_worker, 1, str(scores_heavy_dir), _batch(), ["none", "selective", "full"],
                            timeout_s=600)[0]
    assert runs["none"]["granularity"] is None
    assert runs["selective"]["granularity"] == "selective" and runs["selective"]["modules"] == ["core_attn"]
    assert runs["full"]["granularity"] == "full"
    base = runs["none"]
    for mode in ("selective", "full"):
        r = runs[mode]
        assert r["loss"] == base["loss"], (mode, r["loss"], base["loss"])
        assert r["grad_norm"] == base["grad_norm"], (mode, r["grad_norm"], base["grad_norm"])
        assert r["weights"] == base["weights"], mode
    peaks = {m: r["peak"] / 2**20 for m, r in runs.items()}
    print("peak RSS over a step (MiB above the pre-step RSS):", {m: round(v, 1) for m, v in peaks.items()})
    # What selective drops: the local spec's DotProductAttention keeps one [b, heads, s, s] fp32 tensor a
    # layer for the backward (softmax's output, which the probs @ V matmul also saves; dropout is 0 so no
    # mask or copy): 4 layers x 18 MiB = 72 MiB. Require at least half of it (the peak may fall where a
    # layer's scores are transiently alive in both modes; RSS moves in pages); the rest of the step is equal.
    scores_layer = BATCH * HEADS * SEQ * SEQ * 4 / 2**20
    assert peaks["none"] - peaks["selective"] > 0.5 * scores_layer * LAYERS, peaks
    assert peaks["full"] < peaks["selective"], peaks
