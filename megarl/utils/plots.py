"""Matplotlib for the figures megarl writes (benchmarks, ``megarl simulate``, the metrics plot):
headless, and optional -- a run without matplotlib writes its JSON and says there is no PNG."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def pyplot(what: str = "") -> Any | None:
    """``matplotlib.pyplot`` on the headless Agg backend, or None where matplotlib is not installed
    (logged once per call, naming ``what`` would have been drawn)."""
    # its INFO (e.g. "generated new fontManager" on a first run) is not a megarl console line
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG%s", f" ({what})" if what else "")
        return None
    return plt


def save(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Lay out, write and close ``fig`` (a long bench draws many: an open figure keeps its memory)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


__all__ = ["pyplot", "save"]
