"""The controller's weight path: trainer parameters -> HF tensors -> vLLM engine, proven by logprobs.

With an fp32 engine, after pushing perturbed trainer weights the generator's behaviour logprobs
must equal the trainer's own logprobs of the same tokens; under the original weights they must
not (so the check would catch a sync that silently kept old weights)."""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.config import load_config
from megarl.generator.executor import GeneratorExecutor
from megarl.batch import RolloutBatch
from megarl.trainer.local import LocalTrainer
from megarl.trainer.logprobs import compute_logprobs

REPO = Path(__file__).resolve().parents[2]


def _max_gap(trainer: LocalTrainer, batch: RolloutBatch) -> float:
    lp = compute_logprobs(trainer.model, batch, temperature=1.0).logprobs
    return float(((lp - batch.behav_logprobs).abs() * batch.loss_mask).max())


def test_pushed_weights_reproduce_trainer_logprobs(tiny_llama_tied_dir, tmp_path):
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_tied_dir}", "generator.dtype=float32", "generator.max_new_tokens=12"])
    trainer = LocalTrainer(cfg.trainer, cfg.algorithm, tiny_llama_tied_dir, total_steps=1, run_dir=tmp_path)
    try:
        with GeneratorExecutor(cfg.generator, tiny_llama_tied_dir, log_dir=tmp_path / "gen_logs") as gen:
            original = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            gen_ = torch.Generator().manual_seed(0)
            with torch.no_grad():  # what an optimizer step does: change every weight in place
                for p in trainer.model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen_) * 0.05)
            gen.update_weights(trainer.hf_weights(), version=1)
            samples = gen.generate([[1, 504, 3180, 314], [1, 2683, 314, 253, 1345]], n_samples=2)
            assert all(s.versions == [1] * len(s.completion_ids) for s in samples)
            batch = RolloutBatch.from_samples(samples)
            # fp32 engine vs fp32 trainer: ~1e-4 would do (test_controller.py); 2e-3 is 20x looser, 25x below stale
            assert _max_gap(trainer, batch) < 2e-3

            with torch.no_grad():
                for n, p in trainer.model.named_parameters():
                    p.copy_(original[n])
            # 0.05 * N(0,1) per weight moves logits by ~0.05 * sqrt(128) ~ 0.6 nats: far above 0.05
            assert _max_gap(trainer, batch) > 0.05  # the check sees stale weights
    finally:
        trainer.close()
    # the tied head got no tensor of its own (its weight is the embedding's, which landed: the logprobs
    # above are the trainer's), so vLLM's "ParallelLMHead: Failed to load weights" is not shown
    log = (tmp_path / "gen_logs" / "generator_replica0.log").read_text()
    assert not [ln for ln in log.splitlines() if "WARNING" in ln and "Failed to load weights" in ln], log[-3000:]
    assert "ParallelLMHead, tied to the input embedding (its weight is the embedding's" in log, log[-3000:]


class ParallelLMHead(torch.nn.Module):  # the names vLLM's classes have; the filter goes by class name
    def __init__(self, weight: torch.nn.Parameter):
        super().__init__()
        self.weight = weight


class VocabParallelEmbedding(ParallelLMHead):
    pass


def _llm(tied: bool, extra_head: bool = False) -> torch.nn.Module:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = VocabParallelEmbedding(torch.nn.Parameter(torch.zeros(8, 4)))
    model.lm_head = ParallelLMHead(model.model.embed_tokens.weight if tied else torch.nn.Parameter(torch.zeros(8, 4)))
    if extra_head:  # e.g. an untied draft head of the same class
        model.mtp_head = ParallelLMHead(torch.nn.Parameter(torch.zeros(8, 4)))
    return model


def test_the_reload_warning_is_dropped_for_a_tied_head_only():
    """A tied lm_head (its weight is the embedding's) is harmless to warn about; an untied one that got no
    tensor is a real fault and keeps vLLM's warning, as does a class with an untied head beside it."""
    import logging

    from megarl.generator.weights import _FAILED_TO_LOAD, _WeightlessLayerFilter, tied_head_classes

    assert tied_head_classes(_llm(tied=True)) == frozenset({"ParallelLMHead"})
    assert tied_head_classes(_llm(tied=False)) == frozenset()
    assert tied_head_classes(_llm(tied=True, extra_head=True)) == frozenset()
    assert tied_head_classes(torch.nn.Linear(2, 2)) == frozenset()

    def shown(names: frozenset, layer: str) -> bool:
        record = logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266, _FAILED_TO_LOAD, (layer,), None)
        return _WeightlessLayerFilter(names).filter(record)

    assert not shown(tied_head_classes(_llm(tied=True)), "ParallelLMHead")
    assert shown(tied_head_classes(_llm(tied=True)), "QKVParallelLinear")
    assert shown(tied_head_classes(_llm(tied=False)), "ParallelLMHead")


def test_ddma_push_verified_and_probe_catches_stale_weights(tiny_llama_tied_dir, tmp_path):
    """The controller's sync call (controller/weight_sync.py) over DDMA: after pushing perturbed
    weights the probe passes within the fp32 bound; perturb again without pushing and the probe
    must stop the job (a lost update), naming the gap."""
    import pytest

    from megarl.controller.loop import model_dims, resolved_sync
    from megarl.controller.weight_sync import ProbeMismatch, WeightSync

    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_tied_dir}", "generator.dtype=float32", "generator.max_new_tokens=12",
        "sync.probe_every=1", "sync.verify_every=2", "cluster.device=cpu"])
    trainer = LocalTrainer(cfg.trainer, cfg.algorithm, tiny_llama_tied_dir, total_steps=1, run_dir=tmp_path)
    try:
        with GeneratorExecutor(cfg.generator, tiny_llama_tied_dir) as gen:
            sync = WeightSync(resolved_sync(cfg), trainer, gen, dims=model_dims(tiny_llama_tied_dir), generator_cfg=cfg.generator,
                              probe_prompt=[1, 504, 3180, 314])
            # sync/verified is what the generator workers' checksum compares found, not the flag:
            # v1 is not checksummed (verify_every=2), v2 is, by every worker
            assert sync.push(1)["sync/verified"] == 0.0
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            m = sync.push(2)
            assert m["sync/verified"] == 1.0 and m["sync/bytes_sent"] > 0
            assert m["sync/probe_gap"] < 1e-3  # the fp32 bound (weight_sync.py docstring)
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            with pytest.raises(ProbeMismatch, match="probe prompt differ"):
                sync.probe(3)  # weights changed, never pushed: ~0.6 nats (see above), far over 1e-3
    finally:
        trainer.close()


def test_probe_runs_at_the_first_sync_then_every_probe_every():
    from megarl.controller.weight_sync import probe_due

    assert [n for n in range(1, 32) if probe_due(n, 10)] == [1, 11, 21, 31]
    assert [n for n in range(1, 6) if probe_due(n, 1)] == [1, 2, 3, 4, 5]
    assert [n for n in range(1, 30) if probe_due(n, 0)] == [1]  # 0: the first sync only, never none


def test_default_probe_bound_follows_the_coarser_of_engine_and_trainer():
    """fp32 on both sides: 1e-3 nats; bf16 weights on either side: 0.25; FP8: 1.0 (the numbers'
    sources: megarl/controller/weight_sync.py). An explicit sync.probe_max_gap wins."""
    from megarl.controller.loop import resolved_sync
    from megarl.ddma.config import default_probe_gap

    assert default_probe_gap("float32", "none") == default_probe_gap("float32", "none", "float32") == 1e-3
    assert default_probe_gap("float32", "none", "bfloat16") == default_probe_gap("bfloat16", "none") == 0.25
    assert default_probe_gap("bfloat16", "fp8_per_channel", "float32") == 1.0
    qs = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
    gap = lambda *o: resolved_sync(load_config(qs, ["cluster.device=cpu", *o])).probe_max_gap  # noqa: E731
    assert gap("trainer.params_dtype=float32", "generator.dtype=float32") == 1e-3
    assert gap("trainer.params_dtype=bfloat16", "generator.dtype=float32") == 0.25
    assert gap("trainer.params_dtype=bfloat16", "sync.probe_max_gap=0.5") == 0.5


def test_fp8_wire_into_an_fp32_engine_runs_past_the_first_probe(tiny_llama_tied_dir, tmp_path):
    """sync.wire=fp8 lands e4m3-rounded weights in an fp32 engine: the probe gap is FP8's, not fp32's.
    The bound followed the engine alone (1e-3) and a config that validates stopped at v0 with
    ProbeMismatch; it follows the coarsest of trainer, wire and engine (1.0, FP8's)."""
    from megarl.controller.loop import model_dims, resolved_sync
    from megarl.controller.weight_sync import WeightSync

    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_tied_dir}", "generator.dtype=float32", "generator.max_new_tokens=12",
        "sync.wire=fp8", "sync.probe_every=1", "cluster.device=cpu"])
    sync_cfg = resolved_sync(cfg)
    assert sync_cfg.probe_max_gap == 1.0  # FP8's bound (megarl/controller/weight_sync.py)
    trainer = LocalTrainer(cfg.trainer, cfg.algorithm, tiny_llama_tied_dir, total_steps=1, run_dir=tmp_path)
    try:
        with GeneratorExecutor(cfg.generator, tiny_llama_tied_dir) as gen:
            sync = WeightSync(sync_cfg, trainer, gen, dims=model_dims(tiny_llama_tied_dir), generator_cfg=cfg.generator,
                              probe_prompt=[1, 504, 3180, 314])
            g = torch.Generator().manual_seed(0)
            gaps = []
            for version in (0, 1):  # v0 is where it stopped; v1 after the weights moved as a step moves them
                m = sync.push(version)
                assert m["sync/verified"] == 1.0
                gaps.append(m["sync/probe_gap"])
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.05)
            # e4m3 rounding moves the engine's logprobs past the fp32 bound (the old one) and stays under FP8's
            print("fp8 wire probe gaps", gaps)
            assert max(gaps) > 1e-3 and max(gaps) < 1.0, gaps
    finally:
        trainer.close()


def test_probe_bound_follows_the_wire():
    from megarl.controller.loop import resolved_sync
    from megarl.ddma.config import default_probe_gap

    assert default_probe_gap("float32", "none", "float32", "fp8") == 1.0
    assert default_probe_gap("float32", "none", "float32", "engine") == 1e-3
    tiny = str(REPO / "configs" / "tiny_test.yaml")
    gap = lambda *o: resolved_sync(load_config(tiny, ["cluster.device=cpu", "generator.dtype=float32", *o])).probe_max_gap  # noqa: E731
    assert gap("sync.wire=fp8") == 1.0
    assert gap("sync.wire=engine") == 1e-3
    assert gap("sync.wire=fp8", "sync.probe_max_gap=0.4") == 0.4
