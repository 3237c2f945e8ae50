"""Every implementation of a role interface (megarl/executors/base.py) answers every method of it,
on a tiny job: TrainerExecutor and LocalTrainer are Trainers, GeneratorExecutor is a Generator,
RewardPool and the strict held-out scorer are RewardScorers.

Each implementation is wrapped in a recorder that notes which of the protocol's members the test
used; a test passes only when it used them all and every one returned what the protocol says. The
signatures are held against the protocol's too (every parameter the controller may pass is taken).
"""

from __future__ import annotations

import copy
import inspect
import math
from pathlib import Path

import pytest
import torch

from megarl.batch import RolloutBatch
from megarl.config import load_config
from megarl.controller.evaluation import EvalResult, StrictScorer, score_replies, strict_correct
from megarl.controller.startup import model_dims
from megarl.ddma.layouts import GeneratorTopology, TrainerTopology
from megarl.ddma.sync import SyncSpec, host_store
from megarl.executors.base import ExecutorError, Generator, Launchable, RewardScorer, Trainer
from megarl.generator.executor import GeneratorExecutor
from megarl.reward import RewardConfig, RewardPool
from megarl.rollout import Sample
from megarl.trainer.executor import TrainerExecutor
from megarl.trainer.local import LocalTrainer

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 504, 3180, 314], [1, 2683, 314, 253, 1345]]


def members(proto: type) -> set[str]:
    """The methods and properties a protocol declares."""
    return {n for n in vars(proto) if not n.startswith("_")}


class Recorder:
    """``impl`` seen through ``proto``: notes every member of the protocol that is used."""

    def __init__(self, impl, proto: type):
        self._impl, self._members, self.used = impl, members(proto), set()

    def __getattr__(self, name: str):
        if name in self._members:
            self.used.add(name)
        return getattr(self._impl, name)


def assert_signatures_fit(impl: type, proto: type) -> None:
    """Each protocol method exists on ``impl`` and takes every parameter the protocol names, in
    the same kind (positional or keyword); a property stays a property."""
    for name in members(proto):
        want, got = inspect.getattr_static(proto, name), inspect.getattr_static(impl, name, None)
        assert got is not None, f"{impl.__name__} has no {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} is not a property"
            continue
        have = inspect.signature(got).parameters
        for p in inspect.signature(want).parameters.values():
            assert p.name in have, f"{impl.__name__}.{name} does not take {p.name!r}"
            kind = have[p.name].kind
            if p.kind is p.POSITIONAL_OR_KEYWORD:
                assert kind is p.POSITIONAL_OR_KEYWORD, (impl.__name__, name, p.name, kind)
            if p.default is not p.empty:
                assert have[p.name].default is not p.empty, f"{impl.__name__}.{name}: {p.name!r} needs a default"


@pytest.fixture(scope="module")
def cfg(tiny_llama_dir):
    return load_config(REPO / "configs" / "tiny_test.yaml", [
        f"model.path={tiny_llama_dir}", "generator.dtype=float32", "trainer.micro_batch_size=2"])


@pytest.fixture(scope="module")
def gen(cfg, tiny_llama_dir):
    with GeneratorExecutor(cfg.generator, tiny_llama_dir) as ex:
        yield ex


def _spec(dims, trainer_topology: TrainerTopology, store) -> SyncSpec:
    return SyncSpec(dims, trainer_topology, GeneratorTopology(1, 1), "127.0.0.1", store.port, transport="zero_copy",
                    engine_dtype="float32", timeout_s=60)


def _batch(gen) -> RolloutBatch:
    samples = gen.generate(PROMPTS[:1], n_samples=2)
    return RolloutBatch.from_samples(samples, [1.0, -1.0])


def exercise_trainer(impl, gen, dims, abandon_fails: bool) -> None:
    """Every Trainer method, in the order the loop and the weight sync call them."""
    t = Recorder(impl, Trainer)
    assert t.step_count == 0
    topo = t.topology()
    assert isinstance(topo, TrainerTopology) and (topo.tp, topo.pp, topo.dp) == (1, 1, 1)
    store = host_store()
    spec = _spec(dims, topo, store)
    gen.update_weights(t.hf_weights(), version=t.step_count)  # the job's first push: the engine starts at v0
    weights = dict(t.hf_weights())
    assert weights["model.embed_tokens.weight"].shape[1] == dims.hidden_size

    batch = _batch(gen)
    lp = t.logprobs(batch, temperature=1.0)
    assert lp.shape == batch.input_ids.shape and torch.isfinite(lp).all()
    metrics = t.step(batch)
    assert math.isfinite(metrics["loss"]) and t.step_count == 1
    assert t.save().is_dir()
    t.wait_saves()  # no write in flight (trainer.async_save off): returns at once

    t.start_sync(spec, 1)
    t.raise_if_dead()  # nothing died: a no-op while the sync is in flight
    gen.update_weights_from_source(spec.weight_source(1), 1, peer_check=t.raise_if_dead)
    (stats,) = t.finish_sync()
    assert stats["rank"] == 0 and stats["bytes_sent"] > 0
    # the engine now holds the trained weights: its logprobs of a fresh greedy reply are the trainer's
    probe = RolloutBatch.from_samples(gen.generate(PROMPTS[1:], n_samples=1, sampling={"temperature": 0.0}))
    gap = ((t.logprobs(probe, temperature=1.0) - probe.behav_logprobs).abs() * probe.loss_mask).max()
    assert float(gap) < 1e-3  # fp32 on both sides: the sync probe's fp32 bound (controller/weight_sync.py)

    # the receivers' failure path: the sender is stopped instead of waiting out its timeout
    t.start_sync(spec, 2)
    if abandon_fails:  # many processes: every rank is killed, later calls raise
        t.abandon_sync("a test stops it")
        with pytest.raises(ExecutorError):
            t.raise_if_dead()
    else:  # in-process: the sender thread is joined once its receivers are done
        gen.update_weights_from_source(spec.weight_source(2), 2)
        t.abandon_sync("a test stops it")
        t.raise_if_dead()
    assert t.used == members(Trainer), members(Trainer) - t.used


def test_signatures_fit_their_protocols():
    for impl in (TrainerExecutor, LocalTrainer):
        assert_signatures_fit(impl, Trainer)
    assert_signatures_fit(GeneratorExecutor, Generator)
    for impl in (RewardPool, StrictScorer):
        assert_signatures_fit(impl, RewardScorer)
    from megarl.critic.executor import CriticExecutor
    from megarl.reward.judge import JudgeScorer
    from megarl.teacher.executor import TeacherExecutor

    # started together (megarl/controller/startup.py)
    for impl in (TrainerExecutor, GeneratorExecutor, JudgeScorer, TeacherExecutor, CriticExecutor):
        assert_signatures_fit(impl, Launchable)


def test_local_trainer_is_a_trainer(cfg, gen, tiny_llama_dir, tmp_path):
    trainer = LocalTrainer(cfg.trainer, cfg.algorithm, tiny_llama_dir, total_steps=2, run_dir=tmp_path)
    try:
        exercise_trainer(trainer, gen, model_dims(tiny_llama_dir), abandon_fails=False)
    finally:
        trainer.close()


def test_trainer_executor_is_a_trainer(cfg, gen, tiny_llama_dir, tmp_path):
    with TrainerExecutor(cfg.trainer, cfg.algorithm, tiny_llama_dir, total_steps=2, run_dir=tmp_path) as trainer:
        exercise_trainer(trainer, gen, model_dims(tiny_llama_dir), abandon_fails=True)


def test_generator_executor_is_a_generator(cfg, gen, tiny_llama_dir, tmp_path):
    g = Recorder(gen, Generator)
    groups = g.submit(PROMPTS, 2, max_new_tokens=4, prompt_indices=[7, 8], sampling={"temperature": 1.0})
    got = g.collect(min_samples=1)
    got += g.collect()  # the rest
    got += g.poll()
    assert len(groups) == 2 and sorted({s.group_id for s in got}) == sorted(groups)
    assert all(isinstance(s, Sample) and s.prompt_index in (7, 8) and len(s.completion_ids) <= 4 for s in got)
    assert len(got) == 4
    greedy = g.generate(PROMPTS, n_samples=1, sampling={"temperature": 0.0})
    assert [s.prompt_ids for s in greedy] == PROMPTS

    # a partial rollout survives a snapshot / restore (the controller's checkpoint)
    (group,) = g.submit(PROMPTS[:1], 1, round_token_budget=2)
    state = copy.deepcopy(g.snapshot({group}))  # as the checkpoint file holds it
    new_ids = g.restore(state, groups=[group])
    assert set(new_ids) == {group}
    g.drain()  # in flight: finished or cut (a cut partial stays cached for collect)
    g.collect()
    activity = g.activity()
    assert set(activity) == {"busy_s", "load_s"} and activity["busy_s"] > 0

    trainer = LocalTrainer(cfg.trainer, cfg.algorithm, tiny_llama_dir, total_steps=1, run_dir=tmp_path)
    try:
        took = g.update_weights(trainer.hf_weights(), version=5)
        assert took > 0  # seconds it took
        # the load is counted once the update returns (its reply carries the replicas' counters), not
        # when a later generation reports: a step's exec/generator_load_s holds its own sync's load
        loaded = g.activity()["load_s"] - activity["load_s"]
        assert 0 < loaded <= took, (loaded, took)
        activity = g.activity()
        assert all(v == 5 for v in g.generate(PROMPTS[:1], n_samples=1)[0].versions)
        store = host_store()
        spec = _spec(model_dims(tiny_llama_dir), trainer.topology(), store)
        trainer.start_sync(spec, 6)
        assert g.update_weights_from_source(spec.weight_source(6), 6, peer_check=trainer.raise_if_dead) > 0
        assert g.activity()["load_s"] > activity["load_s"]  # DDMA's load too
        trainer.finish_sync()
    finally:
        trainer.close()
    assert all(v == 6 for v in g.generate(PROMPTS[:1], n_samples=1)[0].versions)
    assert g.used == members(Generator), members(Generator) - g.used


# One character per token: the scorers see the text the test wrote.
def _decode(ids) -> str:
    return "".join(map(chr, ids))


def _replies() -> list[Sample]:
    rows = [("3 + 4 = 7", 0, "stop"), ("3 + 4 = 8", 0, "stop"), ("so 12", 1, "stop"), ("12 and more", 1, "length"),
            ("no number", 1, "stop")]
    return [Sample(prompt_ids=[1], completion_ids=[ord(c) for c in text], behav_logprobs=[0.0] * len(text),
                   versions=[0] * len(text), finish_reason=reason, prompt_index=i) for text, i, reason in rows]


@pytest.mark.parametrize("make", [lambda: RewardPool(RewardConfig(overlong_buffer=4), 12), StrictScorer],
                         ids=["RewardPool", "StrictScorer"])
def test_scorers_are_reward_scorers(make):
    """``score`` sets on each sample exactly what the scorer's text path gives for its reply."""
    answers = ["7", "12"]
    samples = _replies()
    texts, golds = [_decode(s.completion_ids) for s in samples], [answers[s.prompt_index] for s in samples]
    reasons, lengths = [s.finish_reason for s in samples], [len(s.completion_ids) for s in samples]
    impl = make()
    r = Recorder(impl, RewardScorer)
    if isinstance(impl, RewardPool):
        with impl:
            r.score(samples, answers, _decode)
            want = [(x.reward, x.correct, x.formatted) for x in impl.score_texts(texts, golds, reasons, lengths)]
    else:
        r.score(samples, answers, _decode)
        want = [(float(c), c, f) for c, f in (strict_correct(t, g, why) for t, g, why in zip(texts, golds, reasons))]
        assert EvalResult.of_samples(samples) == score_replies(texts, golds, reasons, lengths)[0]
    assert [(s.reward, s.correct, s.formatted) for s in samples] == want
    assert [s.correct for s in samples] == [True, False, True, False, False]
    assert r.used == members(RewardScorer)
