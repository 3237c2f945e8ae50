"""Named pause points for fault tests: hold a process at a precise moment so a test can kill it there.

``MEGARL_FAULT_PAUSE="name=seconds[,name=seconds]"`` makes :func:`pause_point` sleep that long at the
point of that name; unset (always, outside tests), a pause point costs one dict lookup. A kill that
must land inside a window of microseconds (a DDMA transfer of a tiny model) is otherwise a race the
test loses at random. Points: ``ddma_send`` (a trainer rank after it logs 'sending weights vN', before
its shards are published to the generator's workers, who are waiting for them);
``checkpoint_async_write`` (a trainer rank's background checkpoint writer after it wrote its shards,
before anything is committed; ``checkpoint_async_write@N``: only the step-N write).
"""

from __future__ import annotations

import functools
import os
import time

ENV = "MEGARL_FAULT_PAUSE"


@functools.lru_cache(maxsize=1)
def _pauses(spec: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, seconds = item.partition("=")
        out[name.strip()] = float(seconds)
    return out


def pause_point(name: str) -> None:
    """Sleep at ``name`` if ``MEGARL_FAULT_PAUSE`` asks for it; nothing otherwise."""
    seconds = _pauses(os.environ.get(ENV, "")).get(name)
    if seconds:
        time.sleep(seconds)
