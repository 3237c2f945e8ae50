"""Named pause points for fault tests: hold a process at a precise moment so a test can kill it there.

``MEGARL_FAULT_PAUSE="name=seconds[,name=seconds]"`` makes :func:`pause_point` sleep that long at the
point of that name; unset (always, outside tests), a pause point costs one dict lookup. A kill that
must land inside a window of microseconds (a DDMA transfer of a tiny model) is otherwise a race the
test loses at random. Points: ``ddma_send`` (a trainer rank after it logs 'sending weights vN', before
its shards are published to the generator's workers, who are waiting for them);
``checkpoint_async_write`` (a trainer rank's background checkpoint writer after it wrote its shards,
before anything is committed; ``checkpoint_async_write@N``: only the step-N write); ``step_logged@N``
(the controller after it logged step N, before step N+1 starts: a signal sent once the log shows step N
lands between the steps, where on a quiet machine it would race the next step's training);
``train_step@N`` (a trainer rank after step N's forward and backward, before the optimizer update; it logs
'step N: forward and backward done' first, so a test signals while the step runs);
``ddma_received@v<V>`` (a generator worker once the first tensor of weights vV arrived from the trainer:
bytes moved; it logs 'received B bytes of weights vV' first, so a test kills a sender mid-transfer);
``replica_decoding@r<R>v<V>`` (generator replica R after an engine step that left requests unfinished,
holding weights vV; it logs 'decoding N request(s)' first, so a test kills it mid-generation);
``replica_landing@r<R>v<V>`` (generator replica R as it starts landing weights vV, before vLLM reloads
them; it logs 'landing weights vV' first, so a test kills it mid-landing: the landing itself lasts
~0.1 s on the tiny model, a window a test's poll can miss on a loaded machine).

``MEGARL_FAULT_INJECT="name[=value][,name[=value]]"`` makes the real code path fail where a fault of that
name is read (:func:`injected`), so an error-path test sees the error raised where it is in production,
in a real rank or replica: ``nonfinite_grad`` (a trainer rank's first gradient becomes NaN before the
optimizer's finiteness check, as a diverged step leaves it), ``disk_free_bytes=N`` (a trainer rank's
checkpoint sees N bytes free), ``ddma_corrupt_landing`` (a generator worker lands its first DDMA tensor
with one element changed, as a wrong byte range would, before the checksums are compared).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Callable

ENV = "MEGARL_FAULT_PAUSE"
INJECT_ENV = "MEGARL_FAULT_INJECT"


@functools.lru_cache(maxsize=1)
def _pauses(spec: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, seconds = item.partition("=")
        out[name.strip()] = float(seconds)
    return out


def armed(name: str) -> bool:
    """Whether :func:`pause_point` ``name`` would pause (to log what the test waits for first)."""
    return bool(_pauses(os.environ.get(ENV, "")).get(name))


def pause_point(name: str, until: Callable[[], bool] | None = None) -> None:
    """Sleep at ``name`` if ``MEGARL_FAULT_PAUSE`` asks for it; nothing otherwise.
    ``until``: end the pause early once it returns True (polled every 50 ms; e.g. a signal was received)."""
    seconds = _pauses(os.environ.get(ENV, "")).get(name)
    if not seconds:
        return
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0 and not (until is not None and until()):
        time.sleep(min(left, 0.05) if until is not None else left)


def injected(name: str) -> str | None:
    """The value of fault ``name`` in ``MEGARL_FAULT_INJECT`` ('' for a bare name), or None when it is
    not injected (always, outside tests: one environment lookup)."""
    spec = os.environ.get(INJECT_ENV)
    if not spec:
        return None
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = item.partition("=")
        if key.strip() == name:
            return value.strip()
    return None
