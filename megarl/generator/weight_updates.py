"""How new weights reach the generator's engines, and the RPCs that read landed weights back for
verification: :class:`WeightUpdater`, which :class:`megarl.generator.executor.GeneratorExecutor`
owns and delegates ``update_weights``, ``update_weights_from_source``, ``inspect_weight`` and
``landed_weights`` to.

The updater is given the generator config and one typed interface to its executor,
:class:`UpdateHost` (what it may use, nothing else): the replica handles, the reply table, how to
send to a replica and wait for replies, and the policy hooks -- the current version, what to do
before the replicas load (drain in deterministic mode) and after they all did (the version becomes
current, cached partial rollouts resume).

Two entries: ``sync.method=shm`` gives full HF tensors to :meth:`WeightUpdater.update_weights`,
which packs them into one host shared-memory file every worker maps; DDMA gives
:meth:`WeightUpdater.update_weights_from_source` a ``ddma`` source (``SyncSpec.weight_source``)
from which each worker streams only its own shard (megarl/generator/ddma_source.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megarl.generator.errors import GeneratorError
from megarl.generator.shm_source import pack_to_shm

if TYPE_CHECKING:
    from megarl.generator.config import GeneratorConfig
    from megarl.generator.replicas import ReplicaHandle

log = logging.getLogger("megarl.generator.executor")  # the executor's logger: one log name for the generator

class UpdateHost(Protocol):
    """What the updater uses of its generator executor (``GeneratorExecutor`` is one)."""

    version: int  # the policy version the replicas serve now
    _replicas: Sequence[ReplicaHandle]  # the replica handles now (replaced on shutdown / restart)
    # the reply table: the updater puts a slot under a token and the executor's message handler fills
    # it (("updated", version): a set the acknowledging replica indices are added to; ("rpc", n): results)
    _replies: dict[Any, Any]

    def _send(self, h: ReplicaHandle, msg: tuple) -> None:
        """One command to one replica (raises if it died)."""

    def _wait(self, done: Callable[[], bool], timeout: float, what: str, progress_resets: bool = True,
              also_check: Callable[[], None] | None = None) -> None:
        """Pump replica messages until ``done()``; raises on a dead replica, when ``also_check``
        raises, or at the timeout."""

    def _check_failed(self) -> None:
        """Raise the error of a replica that died."""

    def _quiesce_for_update(self) -> None:
        """Before the replicas load new weights (deterministic mode: wait until no round is in
        flight, so every round runs under the weights it was submitted with)."""

    def _adopt_version(self, version: int) -> None:
        """Every replica loaded ``version``: make it current, resume cached partial rollouts."""


class WeightUpdater:
    """Weight updates and weight read-back for the replicas of one generator.

    Args:
        cfg: the generator config (``dtype``, ``update_timeout_s``, ``request_timeout_s``).
        host: the executor, seen through :class:`UpdateHost`.
    """

    def __init__(self, cfg: GeneratorConfig, host: UpdateHost):
        self.cfg, self._host = cfg, host
        self._rpc_ids = itertools.count()  # ("rpc", n) tokens: only this class makes them

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, replicas: Sequence[int] | None = None) -> float:
        """Load new weights (HF names, full HF-format tensors) into every engine, between decode
        steps; in-flight requests continue under them. Bumps the policy version (to ``version``
        when given), then resumes cached partial rollouts. Returns the seconds it took.

        This is the ``sync.method=shm`` entry: the tensors go through one host shared-memory file
        every worker maps. DDMA uses :meth:`update_weights_from_source` with a ``ddma`` source."""
        self._host._check_failed()
        new_version = self._host.version + 1 if version is None else int(version)
        t0 = time.monotonic()
        shm = pack_to_shm(named_tensors, dtype=getattr(torch, self.cfg.dtype))
        try:
            return self.update_weights_from_source(shm.source(), new_version, _t0=t0, replicas=replicas)
        finally:
            shm.unlink()

    def update_weights_from_source(self, source: dict, version: int, _t0: float | None = None,
                                   peer_check: Callable[[], None] | None = None,
                                   replicas: Sequence[int] | None = None) -> float:
        """Like :meth:`update_weights` for a prepared weight source (see weights.py); the source
        must stay readable until this returns. ``peer_check``: called while waiting, raises if the
        sender side died (its death would otherwise show only as this wait's timeout).
        ``replicas``: load only into these (a restarted replica, megarl/generator/supervision.py);
        the policy version of the others, and the executor's, stay as they are."""
        t0 = time.monotonic() if _t0 is None else _t0
        targets = list(self._host._replicas) if replicas is None else [self._host._replicas[r] for r in replicas]
        if replicas is None:
            self._host._quiesce_for_update()
        acked: set[int] = set()
        token = ("updated", version)
        self._host._replies[token] = acked
        try:
            for h in targets:
                self._host._send(h, ("update", source, version))
            self._host._wait(lambda: acked >= {h.index for h in targets}, self.cfg.update_timeout_s,
                       f"{len(targets)} replica(s) to load weights version {version}",
                       progress_resets=False, also_check=peer_check)
        finally:
            self._host._replies.pop(token, None)
        if replicas is not None:
            seconds = time.monotonic() - t0
            log.info("generator: weights version %d loaded into replica(s) %s in %.2fs", version,
                     ", ".join(map(str, replicas)), seconds)
            return seconds
        self._host._adopt_version(version)
        seconds = time.monotonic() - t0
        log.debug("generator: weights version %d loaded in %.2fs", version, seconds)  # the step line shows sync
        return seconds

    def inspect_weight(self, vllm_param_name: str, replica: int = 0) -> list[torch.Tensor]:
        """A parameter as every TP rank of ``replica`` holds it, float32 ``[out, in]`` with FP8
        dequantized (verification after an update; see MegarlWorkerExtension)."""
        return self._rpc(replica, "megarl_dequantized_weight", vllm_param_name)

    def landed_weights(self, replica: int = 0) -> list[dict[str, torch.Tensor]]:
        """Per TP rank of ``replica``: every parameter as the last update with ``"capture": True``
        in its source landed it (vLLM names; see megarl/generator/landing.py). For landing tests."""
        return self._rpc(replica, "megarl_landed_weights")

    def _rpc(self, replica: int, method: str, *args) -> Any:
        """Call a worker-extension method on every TP worker of ``replica``; one result per worker."""
        token = ("rpc", next(self._rpc_ids))
        self._host._replies[token] = None
        self._host._send(self._host._replicas[replica], ("rpc", token, method, args))
        self._host._wait(lambda: self._host._replies[token] is not None, self.cfg.request_timeout_s,
                   f"replica {replica} to answer {method}", progress_resets=False)
        out = self._host._replies.pop(token)
        if isinstance(out, str):
            raise GeneratorError(f"{method} on replica {replica} failed: {out}")
        return out
