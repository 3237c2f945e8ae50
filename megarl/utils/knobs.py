"""The one way a config knob is declared: a dataclass field with its documentation.

Every section of the config is a dataclass whose fields are declared with :func:`knob`, so the
help text (what it does, its unit, its default) lives exactly where the knob is defined, and the
validator / ``megarl train --help-config`` can print it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence


def knob(default: Any = dataclasses.MISSING, help: str = "", *, choices: Sequence[Any] | None = None,
         default_factory: Callable[[], Any] | None = None) -> Any:
    """Declare a documented config field.

    Args:
        default: the default value (immutable). Use ``default_factory`` for lists/dicts.
        help: one sentence: what it controls, its unit (s, GiB, tokens, ...).
        choices: if given, the only legal values (checked by the validator).
    """
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
