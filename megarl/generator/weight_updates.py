"""How new weights reach the generator's engines: the weight-update half of
:class:`megarl.generator.executor.GeneratorExecutor` (a mixin it inherits), and the RPCs that read
landed weights back for verification.

The host provides ``cfg`` (GeneratorConfig), ``version``, ``deterministic``, the replica handles
``_replicas``, the reply table ``_replies`` and ids ``_round_ids``, cached partial rollouts
``_partials`` and in-flight rounds ``_tracks``, and ``_send`` / ``_wait`` / ``_check_failed`` /
``drain`` / ``resume_partials`` (see the executor)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megarl.generator.errors import GeneratorError
from megarl.generator.shm_source import pack_to_shm

log = logging.getLogger("megarl.generator.executor")  # the executor's logger: one log name for the generator


class WeightUpdates:
    """Weight updates and weight read-back for :class:`~megarl.generator.executor.GeneratorExecutor`."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> float:
        """Load new weights (HF names, full HF-format tensors) into every engine, between decode
        steps; in-flight requests continue under them. Bumps the policy version (to ``version``
        when given), then resumes cached partial rollouts. Returns the seconds it took.

        This path (``sync.method=shm``) sends the tensors through one host shared-memory file every
        worker maps; DDMA does not come here: it hands :meth:`update_weights_from_source` a ``ddma``
        source (``SyncSpec.weight_source``) from which each worker streams only its shard
        (megarl/generator/ddma_source.py)."""
        self._check_failed()
        new_version = self.version + 1 if version is None else int(version)
        t0 = time.monotonic()
        shm = pack_to_shm(named_tensors, dtype=getattr(torch, self.cfg.dtype))
        try:
            return self.update_weights_from_source(shm.source(), new_version, _t0=t0)
        finally:
            shm.unlink()

    def update_weights_from_source(self, source: dict, version: int, _t0: float | None = None,
                                   peer_check: Callable[[], None] | None = None) -> float:
        """Like :meth:`update_weights` for a prepared weight source (see weights.py); the source
        must stay readable until this returns. ``peer_check``: called while waiting, raises if the
        sender side died (its death would otherwise show only as this wait's timeout)."""
        t0 = time.monotonic() if _t0 is None else _t0
        if self.deterministic and self._tracks:  # every round runs under the weights it was submitted with
            self.drain()
        acked: set[int] = set()
        self._replies[("updated", version)] = acked
        for h in self._replicas:
            self._send(h, ("update", source, version))
        self._wait(lambda: len(acked) == len(self._replicas), self.cfg.update_timeout_s,
                   f"{len(self._replicas)} replica(s) to load weights version {version}",
                   progress_resets=False, also_check=peer_check)
        del self._replies[("updated", version)]
        self.version = version
        if self._partials:
            self.resume_partials()
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
        token = ("rpc", next(self._round_ids))
        self._replies[token] = None
        self._send(self._replicas[replica], ("rpc", token, method, args))
        self._wait(lambda: self._replies[token] is not None, self.cfg.request_timeout_s,
                   f"replica {replica} to answer {method}", progress_resets=False)
        out = self._replies.pop(token)
        if isinstance(out, str):
            raise GeneratorError(f"{method} on replica {replica} failed: {out}")
        return out

