"""One executor protocol (megarl/executors/base.py) for the trainer, the generator and the reward
pool: each starts, reports health and pids, closes; their failures are the base's classes. Trainer
and generator start together (start_together): both launch before either is awaited, and one that
dies while the other is awaited ends the start-up at once, leaving no process."""

import os
import signal
from contextlib import ExitStack
from pathlib import Path

import pytest

from megarl.algorithms.config import AlgorithmConfig
from megarl.config import load_config
from megarl.executors.base import (Executor, ExecutorBase, ExecutorError, ExecutorTimeout, Launchable, ProcessDied,
                                   start_in_turn, start_together)
from megarl.trainer.executor import TrainerExecutor, TrainerRankFailed, TrainerTimeout
from megarl.trainer.worker import PORT_TAKEN_EXIT
from megarl.generator.executor import GeneratorEngineDied, GeneratorExecutor, GeneratorTimeout
from megarl.reward import RewardPool
from megarl.reward.config import RewardConfig


@pytest.mark.parametrize("cls", [TrainerExecutor, GeneratorExecutor, RewardPool])
def test_every_executor_has_the_protocol(cls):
    assert issubclass(cls, ExecutorBase)
    for name in ("start", "health", "close", "pids", "__enter__", "__exit__"):
        assert hasattr(cls, name), (cls.__name__, name)


def test_failures_share_the_base_classes():
    assert issubclass(TrainerRankFailed, ProcessDied) and issubclass(GeneratorEngineDied, ProcessDied)
    assert issubclass(TrainerTimeout, ExecutorTimeout) and issubclass(GeneratorTimeout, ExecutorTimeout)
    assert issubclass(ProcessDied, ExecutorError) and issubclass(ExecutorTimeout, TimeoutError)


def test_reward_pool_lifecycle():
    with RewardPool(RewardConfig(), 24) as pool:
        assert isinstance(pool, Executor)
        assert pool.score_texts(["3 + 4 = 7"], ["7"], ["stop"], [4])[0].correct
        assert all(h["alive"] for h in pool.health())
    assert pool.pids == []  # closed: no scoring process left


REPO = Path(__file__).resolve().parents[2]


def _recorded(ex, name: str, events: list, after_launch=None):
    """``ex`` whose launch and await_ready note, in ``events``, when they return (the real methods run);
    ``ex.launched_pids``: the pids its launch started."""
    launch, await_ready = ex.launch, ex.await_ready

    def launched():
        launch()
        events.append(f"{name} launched")
        ex.launched_pids = list(ex.pids)
        if after_launch is not None:
            after_launch(ex)
        return ex

    def ready(also_check=None):
        await_ready(also_check)
        events.append(f"{name} ready")
        return ex

    ex.launch, ex.await_ready = launched, ready
    return ex


def _executors(tiny_llama_dir, tmp_path, events, kill_generator=False):
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [f"model.path={tiny_llama_dir}"])
    trainer = TrainerExecutor(cfg.trainer, AlgorithmConfig(), tiny_llama_dir, total_steps=2, run_dir=tmp_path)
    generator = GeneratorExecutor(cfg.generator, tiny_llama_dir)
    kill = (lambda g: os.kill(g.pids[0], signal.SIGKILL)) if kill_generator else None
    return _recorded(trainer, "trainer", events), _recorded(generator, "generator", events, after_launch=kill)


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_trainer_and_generator_start_together(tiny_llama_dir, tmp_path):
    """Both launch before either is awaited (the job starts in the slower one's time), both are usable,
    and the stack closes both."""
    events: list[str] = []
    trainer, generator = _executors(tiny_llama_dir, tmp_path, events)
    assert isinstance(trainer, Launchable) and isinstance(generator, Launchable)
    with ExitStack() as stack:
        ready = start_together(stack, {"trainer": trainer, "generator": generator})
        assert events == ["trainer launched", "generator launched", "trainer ready", "generator ready"]
        assert list(ready) == ["trainer", "generator"] and 0 < ready["trainer"] <= ready["generator"]
        assert trainer.step_count == 0 and len(trainer.health()) == 1
        (sample,) = generator.generate([[1, 504, 3180, 314]], n_samples=1, max_new_tokens=2)
        assert 1 <= len(sample.completion_ids) <= 2
        pids = trainer.launched_pids + generator.launched_pids
        assert len(_alive(pids)) == 2
    assert _alive(pids) == []  # closed with the stack


def test_start_in_turn_launches_each_once_the_one_before_is_ready(tiny_llama_dir, tmp_path):
    """cluster.share_devices' start: vLLM must find the trainer's memory taken when it sizes its cache."""
    events: list[str] = []
    trainer, generator = _executors(tiny_llama_dir, tmp_path, events)
    with ExitStack() as stack:
        ready = start_in_turn(stack, {"trainer": trainer, "generator": generator})
        assert events == ["trainer launched", "trainer ready", "generator launched", "generator ready"]
        assert 0 < ready["trainer"] < ready["generator"]  # from the first launch, as start_together counts
        pids = trainer.launched_pids + generator.launched_pids
    assert len(pids) == 2 and _alive(pids) == []


def test_a_generator_dying_at_start_ends_the_trainers_wait(tiny_llama_dir, tmp_path):
    """The replica is killed just after its launch: the trainer's wait (first) ends at once, before
    its ranks are ready, and the error is the generator's own, naming the replica; nothing is left."""
    events: list[str] = []
    trainer, generator = _executors(tiny_llama_dir, tmp_path, events, kill_generator=True)
    with pytest.raises(ProcessDied) as e:
        with ExitStack() as stack:
            start_together(stack, {"trainer": trainer, "generator": generator})
    assert events == ["trainer launched", "generator launched"]  # the trainer never became ready
    assert isinstance(e.value, GeneratorEngineDied), repr(e.value)
    assert "replica 0" in str(e.value) and "SIGKILL" in str(e.value), str(e.value)
    launched = trainer.launched_pids + generator.launched_pids
    assert len(launched) == 2 and _alive(launched) == []  # both closed: no rank, no replica left


def _exit_with(conn, code: int) -> None:
    os._exit(code)


@pytest.mark.parametrize("code, failed", [(PORT_TAKEN_EXIT, False), (1, True)])
def test_a_trainer_rank_that_found_its_port_taken_is_not_a_failure_to_the_others(tiny_llama_dir, tmp_path, code,
                                                                                  failed):
    """Rank 0 exits with PORT_TAKEN_EXIT when the rendezvous port was taken, and the trainer's own wait
    relaunches it: another executor's wait must not stop the start-up for it (a teacher's or critic's
    collision while the trainer is awaited), but must for any other exit."""
    cfg = load_config(REPO / "configs" / "tiny_test.yaml", [f"model.path={tiny_llama_dir}"])
    trainer = TrainerExecutor(cfg.trainer, AlgorithmConfig(), tiny_llama_dir, total_steps=2, run_dir=tmp_path)
    rank = trainer._group.spawn(0, _exit_with, (code,), name="megarl-test-rank", make=trainer._make_rank)
    rank.process.join(60)
    assert rank.process.exitcode == code
    assert trainer.has_exited() is failed
    trainer.close()
