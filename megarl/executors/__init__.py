"""Executors: groups of processes with their own parallelism, driven by the controller.

``base`` holds the one protocol (start / health / close / pids, a context manager) and the
supervision errors; ``trainer`` the TP x PP x DP Megatron rank group.
"""

from megarl.executors.base import Executor, ExecutorBase, ExecutorError, ExecutorTimeout, ProcessDied

__all__ = ["Executor", "ExecutorBase", "ExecutorError", "ExecutorTimeout", "ProcessDied"]
