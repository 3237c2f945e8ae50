"""Where ``model.path`` is on this machine, and its shape when it is not.

``model.path`` is an HF model folder, the built-in SmolLM2, or an HF hub id (``Qwen/Qwen3-8B``) that
resolves to its snapshot in the local HF cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) when it was downloaded there. Nothing is downloaded: jobs run offline.

For a plan without the weights (``megarl train RECIPE --dry-run`` on a laptop), the model's
``config.json`` ships in ``configs/models/``: the hub id's name, lower-cased (``Qwen/Qwen3-8B`` ->
``qwen3-8b.json``; an ``-Instruct`` variant falls back to its base's file, same shape).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED = REPO_ROOT / "configs" / "models"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
    """``org/name`` that is not a local path."""
    return bool(_HUB_ID.match(path)) and not Path(path).exists()


def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def cached_snapshot(hub_id: str) -> Optional[Path]:
    """The local snapshot folder of ``hub_id`` holding a config.json (the ``main`` ref's when recorded,
    else the newest), or None."""
    repo = hub_cache() / f"models--{hub_id.replace('/', '--')}"
    snaps = repo / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        snap = snaps / ref.read_text().strip()
        if (snap / "config.json").is_file():
            return snap
    found = sorted((p for p in snaps.iterdir() if (p / "config.json").is_file()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def local_model_dir(path: str) -> Optional[Path]:
    """The folder ``model.path`` names on this machine (a folder, or a hub id's cached snapshot)."""
    p = Path(path)
    if p.is_dir():
        return p
    if _HUB_ID.match(path):
        return cached_snapshot(path)
    return None


def shipped_config(path: str) -> Optional[Path]:
    """``configs/models/<name>.json`` for a hub id or folder name, or None."""
    name = Path(path.rstrip("/")).name.lower()
    for candidate in (name, re.sub(r"-(instruct|chat|it|base)$", "", name)):  # a base checkpoint: same shape
        f = SHIPPED / f"{candidate}.json"
        if f.is_file():
            return f
    return None
