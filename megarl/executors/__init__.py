"""Executors: groups of processes with their own parallelism, driven by the controller.

``base`` holds the one protocol (start / health / close / pids, a context manager) and the
supervision errors; ``group`` the process group under every role (start or attach, messaging,
waits, the heartbeat detector, failures naming the process, kill-all); ``attach`` how ranks
started elsewhere (srun) connect. The executors themselves
live with their roles (``megarl.trainer.executor``, ``megarl.generator.executor``,
``megarl.reward.pool``), so this package imports none of them.
"""

from megarl.executors.base import Executor, ExecutorBase, ExecutorError, ExecutorTimeout, ProcessDied

__all__ = ["Executor", "ExecutorBase", "ExecutorError", "ExecutorTimeout", "ProcessDied"]
