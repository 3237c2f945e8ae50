"""One executor protocol (megarl/executors/base.py) for the trainer, the generator and the reward
pool: each starts, reports health and pids, closes; their failures are the base's classes."""

import pytest

from megarl.executors.base import Executor, ExecutorBase, ExecutorError, ExecutorTimeout, ProcessDied
from megarl.trainer.executor import TrainerExecutor, TrainerRankFailed, TrainerTimeout
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
