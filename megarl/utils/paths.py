"""Where megarl keeps files it creates once and reuses (converted checkpoints, tokenizers)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

DATA_DIR_ENV = "MEGARL_DATA_DIR"


def data_dir() -> Path:
    """Return the megarl data directory, creating it if needed.

    `$MEGARL_DATA_DIR` when set (CI and tests point it somewhere disposable), else
    `~/.cache/megarl`.
    """
    configured = os.environ.get(DATA_DIR_ENV)
    path = Path(configured).expanduser() if configured else Path.home() / ".cache" / "megarl"
    path.mkdir(parents=True, exist_ok=True)
    return path


def portable_path(path: str | os.PathLike) -> str:
    """``path`` as a committed benchmark JSON should name it, without this machine's folders: relative
    to the repository, ``$MEGARL_DATA_DIR/...`` under the data dir, ``<tmp>/...`` under the temp dir,
    else its last part."""
    p = Path(path).expanduser().absolute()
    repo = Path(__file__).resolve().parents[2]
    for root, label in ((repo, ""), (data_dir(), f"${DATA_DIR_ENV}/"), (Path(tempfile.gettempdir()), "<tmp>/")):
        try:
            return label + str(p.relative_to(root))
        except ValueError:
            continue
    return p.name


def portable_args(args) -> dict:
    """A benchmark's argparse namespace for its JSON: every absolute path value through :func:`portable_path`."""
    return {k: portable_path(v) if isinstance(v, str) and v.startswith(("/", "~")) else v for k, v in vars(args).items()}


@contextlib.contextmanager
def atomic_output_dir(final_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a scratch directory that becomes `final_dir` only if the block succeeds.

    The scratch directory sits beside `final_dir` (same filesystem) so the final step is a single
    `rename`: readers never see a half-written folder, and a crash leaves only a `.tmp-*` folder.
    An existing `final_dir` is replaced. If another process renames its own copy into place between
    our removal and our rename, theirs is kept (both hold the same content).
    """
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    scratch.chmod(0o755)  # mkdtemp makes it owner-only; the result is an ordinary folder
    try:
        yield scratch
        if final.exists():
            shutil.rmtree(final)
        try:
            os.rename(scratch, final)
        except OSError:
            if not final.exists():
                raise
            # Lost a race against another process writing the same folder: keep theirs.
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
