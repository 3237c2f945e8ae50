"""The generator's errors (importable without torch or vLLM)."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from megarl.executors.base import ExecutorError, ExecutorTimeout, ProcessDied
from megarl.utils.errors import remote_error

if TYPE_CHECKING:
    from megarl.generator.replicas import ReplicaHandle


class GeneratorError(ExecutorError):
    """The generator cannot continue (see the message for which engine and why)."""


class GeneratorEngineDied(GeneratorError, ProcessDied):
    """A replica process exited or raised; the message carries the cause and its log's tail."""


class GeneratorTimeout(GeneratorError, ExecutorTimeout):
    """A wait on the engines exceeded its configured timeout."""


def engine_died(h: ReplicaHandle, cause: str, tb: str = "") -> GeneratorEngineDied:
    """The error that ends the job for replica ``h``: ``cause`` (how it ended; ``tb``: its
    traceback when it raised), the tail of its log, and what the command's last line names."""
    where = f"pid {h.process.pid} on {h.process.host}" if h.remote else f"pid {h.process.pid}"
    exc = GeneratorEngineDied(f"generator replica {h.index} ({where}) {cause}\n"
                              f"--- last lines of {h.log_path} ---\n{h.log_tail()}")
    node = h.process.host if h.remote else socket.gethostname()
    exc.component = f"generator replica {h.index} (pid {h.process.pid} on {node})"
    exc.log_path = str(h.log_path)
    exc.remote_error = remote_error(tb) if tb else None
    return exc


__all__ = ["GeneratorError", "GeneratorEngineDied", "GeneratorTimeout", "engine_died"]
