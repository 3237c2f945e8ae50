"""Name -> function registry for rewards, plus ``"package.module:function"`` import paths.

A reward function decides whether one reply's final answer is right::

    fn(completion: str, gold: str, *, strict: bool) -> bool

Built-in rewards (:mod:`megarl.reward.rewards`) register themselves by name with
:func:`register_reward` (as losses and advantage estimators do in :mod:`megarl.algorithms.registry`),
so ``reward.fn`` in a config selects one and a typo fails loudly with the known names. The package
(``megarl/reward/__init__.py``) imports them, so they are registered before any module of it is
used; this module imports none of them. A reward of your own needs no registration: set
``reward.fn: my_pkg.my_module:my_reward``.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Callable, Dict, List, Optional, TypeVar

F = TypeVar("F", bound=Callable)

_REWARDS: Dict[str, Callable] = {}

# Attribute a registered function carries: {"extract": fn(completion, strict) -> answer or None,
# "in_process": bool, "explain": fn(completion, gold, *, strict) -> (bool, reason) or None,
# "prepare": fn() run once per scoring process, or None}. ``extract`` tells RewardPool whether a reply was formatted; ``in_process``
# marks rewards cheap and safe enough (a few regexes, no sympy) to run without the process pool.
META = "__megarl_reward__"


def register_reward(name: str, *, extract: Optional[Callable[..., object]] = None,
                    in_process: bool = False, explain: Optional[Callable[..., object]] = None,
                    prepare: Optional[Callable[[], object]] = None) -> Callable[[F], F]:
    """Decorator: register a reward function under ``name``.

    ``extract(completion, *, strict) -> answer or None`` (optional) is the reward's answer extraction:
    a reply it returns None for counts as unformatted. ``in_process=True`` lets RewardPool call the
    function in the calling process (only for fast pure-Python rewards that cannot hang).
    ``explain(completion, gold, *, strict) -> (bool, reason)`` (optional) is the same verdict with the
    reason a person reads (``megarl reward check``); without it the reason is said from ``extract``.
    ``prepare()`` (optional) runs once in each scoring process before it takes a sample (the code
    sandbox's machine check): what it raises stops the pool at start, not on the first sample.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def decorator(fn: F) -> F:
        if name in _REWARDS and _REWARDS[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered (by {_REWARDS[name].__qualname__}); "
                             f"pick another name")
        setattr(fn, META, {"extract": extract, "in_process": in_process, "explain": explain, "prepare": prepare})
        _REWARDS[name] = fn
        return fn

    return decorator


def known_rewards() -> List[str]:
    """Registered reward names, sorted."""
    return sorted(_REWARDS)


def unknown_message(spec: object) -> str:
    known = known_rewards()
    guess = difflib.get_close_matches(str(spec), known, n=1)
    hint = f"; did you mean {guess[0]!r}?" if guess else ""
    return f"unknown reward; known: {', '.join(known)}, or a 'module:function' path{hint}"


def get_reward(spec: str) -> Callable:
    """The reward named ``spec``, or the function at import path ``"package.module:function"``.

    ValueError for an unknown name (listing the known ones) or a path that does not resolve to a
    callable.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward {spec!r}: {unknown_message(spec)}")
    if ":" not in spec:
        try:
            return _REWARDS[spec]
        except KeyError:
            raise ValueError(f"reward {spec!r}: {unknown_message(spec)}") from None
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r}: an import path must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {exc}") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {attr!r} is not callable")
    return fn


def reward_meta(fn: Callable) -> dict:
    """The registration metadata of ``fn`` (defaults for an unregistered import-path function)."""
    return getattr(fn, META, None) or {"extract": None, "in_process": False, "explain": None, "prepare": None}


def explain(fn: Callable, completion: str, gold: str, *, strict: bool) -> tuple[bool, str]:
    """``fn``'s verdict on one reply with a reason: its own ``explain`` when registered with one, else
    the verdict and what its ``extract`` read from the reply."""
    meta = reward_meta(fn)
    if meta.get("explain") is not None:
        ok, reason = meta["explain"](completion, gold, strict=strict)
        return bool(ok), str(reason)
    ok = bool(fn(completion, gold, strict=strict))
    if meta.get("extract") is None:
        return ok, "right" if ok else "wrong"
    answer = meta["extract"](completion, strict=strict)
    if answer is None:
        return False, "no final answer in the expected format" + (" (strict)" if strict else "")
    return ok, f"final answer {str(answer)!r} {'equals' if ok else 'does not equal'} gold {gold!r}"
