"""The generator's errors (importable without torch or vLLM)."""

from __future__ import annotations

from megarl.executors.base import ExecutorError, ExecutorTimeout, ProcessDied


class GeneratorError(ExecutorError):
    """The generator cannot continue (see the message for which engine and why)."""


class GeneratorEngineDied(GeneratorError, ProcessDied):
    """A replica process exited or raised; the message carries the cause and its log's tail."""


class GeneratorTimeout(GeneratorError, ExecutorTimeout):
    """A wait on the engines exceeded its configured timeout."""


__all__ = ["GeneratorError", "GeneratorEngineDied", "GeneratorTimeout"]
