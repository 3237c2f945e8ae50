"""Name -> function registries for policy losses and advantage estimators.

Losses and advantage estimators register themselves by name with a decorator (as verl does), so a
config string selects them and a typo fails loudly with the list of known names and a guess.
"""

from __future__ import annotations

import difflib
from typing import Callable, Dict, List, TypeVar

F = TypeVar("F", bound=Callable)

_LOSSES: Dict[str, Callable] = {}
_ADVANTAGES: Dict[str, Callable] = {}


def _register(table: Dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__qualname__}); "
                             f"pick another name")
        table[name] = fn
        return fn

    return decorator


def _lookup(table: Dict[str, Callable], kind: str, name: str) -> Callable:
    try:
        return table[name]
    except (KeyError, TypeError):
        known = sorted(table)
        guess = difflib.get_close_matches(str(name), known, n=1)
        hint = f" Did you mean {guess[0]!r}?" if guess else ""
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(known)}.{hint}") from None


def register_loss(name: str) -> Callable[[F], F]:
    """Decorator: register a per-token policy loss under ``name`` (see :mod:`megarl.algorithms.losses`)."""
    return _register(_LOSSES, "loss", name)


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator: register an advantage estimator under ``name`` (see :mod:`megarl.algorithms.advantages`)."""
    return _register(_ADVANTAGES, "advantage estimator", name)


def get_loss(name: str) -> Callable:
    """The loss registered as ``name``; ValueError listing the known names otherwise."""
    return _lookup(_LOSSES, "loss", name)


def get_advantage(name: str) -> Callable:
    """The advantage estimator registered as ``name``; ValueError listing the known names otherwise."""
    return _lookup(_ADVANTAGES, "advantage estimator", name)


def known_losses() -> List[str]:
    return sorted(_LOSSES)


def known_advantages() -> List[str]:
    return sorted(_ADVANTAGES)
