"""Weight sources: how new weights reach a vLLM worker, one registry entry per transport.

A weight update reaches every vLLM worker (each TP rank of each replica) as a small, picklable
*source* dict ``{"kind": ..., ...}``. The worker opens it (:func:`open_weight_source`) into a
:class:`WeightSource`, which carries everything the landing needs:

- its tensors (iterate it): ``(name, tensor)`` pairs handed to vLLM's layerwise reload
  (``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``);
- its loading context (:meth:`WeightSource.landing`): how the engine's loaders take those tensors
  (vLLM's own loaders for checkpoint-format tensors; DDMA swaps in a plain copy because it sends
  the worker's local layout);
- its check after landing (:meth:`WeightSource.after_landing`): DDMA compares checksums of what the
  engine's parameters received with what the senders sent.

Each transport registers its kind when its module is imported (``shm_source``, ``ddma_source``;
the worker extension in ``weights.py`` imports both), so no module is loaded by a string name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch


class WeightSource:
    """One update's weights as one worker sees them. Subclasses implement :meth:`tensors`."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs, ideally grouped by layer so the layerwise reload processes and
        frees each layer as soon as it is complete. A tensor must stay valid until the reload ends:
        the reload buffers a layer's tensors until the whole layer has arrived."""
        raise NotImplementedError

    def landing(self, model: torch.nn.Module) -> ContextManager[None]:
        """Context around the reload: how ``model``'s loaders take these tensors (default: vLLM's
        own loaders, which narrow checkpoint-format tensors to this worker's shard)."""
        return contextlib.nullcontext()

    def after_landing(self) -> None:
        """Called once the engine holds the new weights; raises if they are not what was sent."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.tensors()


WeightOpener = Callable[[dict, Any], WeightSource]
_SOURCES: dict[str, WeightOpener] = {}


def register_weight_source(kind: str, opener: WeightOpener) -> None:
    """Teach every worker to open weight sources of ``kind``: ``opener(source, worker)`` returns a
    :class:`WeightSource`. Call at import time of the transport's module."""
    _SOURCES[kind] = opener


def open_weight_source(source: dict, worker: Any = None) -> WeightSource:
    """The :class:`WeightSource` for ``source`` (raises ValueError for a kind nobody registered)."""
    kind = source.get("kind")
    if kind not in _SOURCES:
        raise ValueError(f"unknown weight source kind {kind!r}; registered: {sorted(_SOURCES)}")
    return _SOURCES[kind](source, worker)


__all__ = ["WeightSource", "WeightOpener", "register_weight_source", "open_weight_source"]
