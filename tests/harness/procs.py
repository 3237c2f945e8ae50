"""Process checks the tests share."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie not yet reaped (dead, its parent has not waited) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # after the name, which may hold spaces
    except OSError:
        return False
