"""How new weights reach the generator's engines, and the RPCs that read landed weights back for
verification: :class:`WeightUpdater`, which :class:`megarl.generator.executor.GeneratorExecutor`
owns and delegates ``update_weights``, ``update_weights_from_source``, ``inspect_weight`` and
``landed_weights`` to.

The updater is given everything it uses when it is built (nothing reaches into the executor): the
generator config, the replica handles, the executor's reply table, how to send to a replica and
wait for replies, and three policy hooks -- the current version, what to do before the replicas
load (``quiesce``: drain in deterministic mode) and after they all did (``adopt``: the version
becomes current, cached partial rollouts resume).

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
from typing import TYPE_CHECKING, Any

import torch

from megarl.generator.errors import GeneratorError
from megarl.generator.shm_source import pack_to_shm

if TYPE_CHECKING:
    from megarl.generator.config import GeneratorConfig
    from megarl.generator.replicas import ReplicaHandle

log = logging.getLogger("megarl.generator.executor")  # the executor's logger: one log name for the generator

# wait(done, timeout_s, what, *, progress_resets, also_check): pump replica messages until done()
# (GeneratorExecutor._wait: raises on a dead replica, when also_check raises, or at the timeout)
Wait = Callable[..., None]


class WeightUpdater:
    """Weight updates and weight read-back for the replicas of one generator.

    Args:
        cfg: the generator config (``dtype``, ``update_timeout_s``, ``request_timeout_s``).
        replicas: returns the replica handles now (the executor replaces its list on shutdown).
        replies: the executor's reply table: the updater puts a slot under a token and the
            executor's message handler fills it (``("updated", version)``: a set the acknowledging
            replica indices are added to; ``("rpc", n)``: the workers' results).
        send: ``send(handle, message)``, one command to one replica (raises if it died).
        wait: see :data:`Wait`.
        check_failed: raises the error of a replica that died.
        current_version: the policy version the replicas serve now.
        quiesce: called before the replicas load new weights (deterministic mode: waits until no
            round is in flight, so every round runs under the weights it was submitted with).
        adopt: called with the new version once every replica loaded it (the executor makes it
            current, then resumes its cached partial rollouts under it).
    """

    def __init__(self, cfg: GeneratorConfig, *, replicas: Callable[[], Sequence[ReplicaHandle]],
                 replies: dict[Any, Any], send: Callable[[ReplicaHandle, tuple], None], wait: Wait,
                 check_failed: Callable[[], None], current_version: Callable[[], int],
                 quiesce: Callable[[], None], adopt: Callable[[int], None]):
        self.cfg = cfg
        self._replicas, self._replies, self._send, self._wait = replicas, replies, send, wait
        self._check_failed, self._current_version = check_failed, current_version
        self._quiesce, self._adopt = quiesce, adopt
        self._rpc_ids = itertools.count()  # ("rpc", n) tokens: only this class makes them

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, replicas: Sequence[int] | None = None) -> float:
        """Load new weights (HF names, full HF-format tensors) into every engine, between decode
        steps; in-flight requests continue under them. Bumps the policy version (to ``version``
        when given), then resumes cached partial rollouts. Returns the seconds it took.

        This is the ``sync.method=shm`` entry: the tensors go through one host shared-memory file
        every worker maps. DDMA uses :meth:`update_weights_from_source` with a ``ddma`` source."""
        self._check_failed()
        new_version = self._current_version() + 1 if version is None else int(version)
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
        targets = list(self._replicas()) if replicas is None else [self._replicas()[r] for r in replicas]
        if replicas is None:
            self._quiesce()
        acked: set[int] = set()
        token = ("updated", version)
        self._replies[token] = acked
        try:
            for h in targets:
                self._send(h, ("update", source, version))
            self._wait(lambda: acked >= {h.index for h in targets}, self.cfg.update_timeout_s,
                       f"{len(targets)} replica(s) to load weights version {version}",
                       progress_resets=False, also_check=peer_check)
        finally:
            self._replies.pop(token, None)
        if replicas is not None:
            seconds = time.monotonic() - t0
            log.info("generator: weights version %d loaded into replica(s) %s in %.2fs", version,
                     ", ".join(map(str, replicas)), seconds)
            return seconds
        self._adopt(version)
        seconds = time.monotonic() - t0
        log.info("generator: weights version %d loaded in %.2fs", version, seconds)
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
        self._replies[token] = None
        self._send(self._replicas()[replica], ("rpc", token, method, args))
        self._wait(lambda: self._replies[token] is not None, self.cfg.request_timeout_s,
                   f"replica {replica} to answer {method}", progress_resets=False)
        out = self._replies.pop(token)
        if isinstance(out, str):
            raise GeneratorError(f"{method} on replica {replica} failed: {out}")
        return out
