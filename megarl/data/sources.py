"""Where rows come from: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder of them, or a glob of
parquet shards, read as a stream of ``(where, row)`` pairs.

Nothing is loaded whole: jsonl is read a line at a time, parquet a record batch at a time
(``pyarrow.parquet.ParquetFile.iter_batches``, only the columns the row schema reads), so a 500k-row
file costs one batch of dicts at a time, never a list of every row. ``.json`` is a JSON array (parsed
whole: JSON has no streaming form in the standard library) or, when it does not start with ``[``,
JSON lines. A file of another suffix is read as JSON lines (gunzipped when it ends in ``.gz``).

``where`` names the row in every message: ``file:line`` for JSON lines (1-based, as editors count),
``file:row N`` for parquet and JSON arrays (0-based, as pandas and pyarrow count).
"""

from __future__ import annotations

import glob
import gzip
import json
import re
from pathlib import Path
from typing import Iterator, Optional, Sequence

SUFFIXES = (".jsonl", ".json", ".parquet")
PARQUET_BATCH_ROWS = 1024  # rows per record batch read from a parquet file (rows)
_SPLIT = re.compile(r"^(train|test|validation|valid|dev|eval)[-_.]", re.IGNORECASE)


class DataError(ValueError):
    """A data row (or file) that cannot be used; the message is one line starting with ``file:line``
    (``file:row N`` for parquet), or with the path when the whole file is the problem."""


def is_pattern(source: str) -> bool:
    return any(c in source for c in "*?[")


def data_files(source: str) -> list[Path]:
    """The files ``source`` names, in reading order: itself, a folder's data files (sorted), or a
    glob's matches (sorted). :class:`DataError` when there are none, or when a folder mixes the
    shards of several splits (``train-*`` beside ``test-*``)."""
    if is_pattern(source):
        files = [Path(p) for p in sorted(glob.glob(source)) if Path(p).is_file()]
        if not files:
            raise DataError(f"{source}: the pattern matches no file")
        return files
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise DataError(f"{source}: the folder holds no {', '.join(SUFFIXES)} file")
        splits = sorted({m.group(1).lower() for p in files if (m := _SPLIT.match(p.name))})
        if len(splits) > 1:
            one = "train" if "train" in splits else splits[0]
            raise DataError(f"{source}: the folder holds shards of several splits ({', '.join(splits)}); name one "
                            f"with a glob, e.g. {path / one}*{files[0].suffix}")
        return files
    if not path.is_file():
        raise DataError(f"{source}: no such file or folder")
    return [path]


def iter_rows(source: str, columns: Optional[Sequence[str]] = None) -> Iterator[tuple[str, dict]]:
    """Every row of every file of ``source`` as ``(where, row)``. ``columns``: the top-level
    columns a parquet reader needs to load (None = all). :class:`DataError` names a row that is not
    UTF-8, not valid JSON or not an object."""
    for path in data_files(source):
        if path.suffix == ".parquet":
            yield from _parquet_rows(path, columns)
        elif path.suffix == ".json" and _starts_with(path, b"["):
            yield from _json_array_rows(path)
        else:
            yield from _jsonl_rows(path)


def first_row(source: str) -> tuple[str, dict]:
    """The first row of ``source`` (what its row schema is detected from)."""
    for where, row in iter_rows(source):
        return where, row
    raise DataError(f"{source}: no rows")


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip()
    return head.startswith(prefix)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    # A gzipped JSON-lines file (HumanEval.jsonl.gz) is read through gzip, a line at a time.
    with (gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")) as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 (byte {e.start}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                                f"object (e.g. with 'question' and 'answer')") from None
            yield where, _object(row, where)


def _json_array_rows(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        rows = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte {e.start}); save the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a JSON {type(rows).__name__}, not an array of row objects")
    for i, row in enumerate(rows):
        yield f"{path}:row {i}", _object(row, f"{path}:row {i}")


def _object(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a JSON {type(row).__name__}, not an object with a prompt and an answer "
                        f"(e.g. 'question' and 'answer')")
    return row


def _parquet_rows(path: Path, columns: Optional[Sequence[str]]) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow, which is not installed (pip install -r "
                        f"requirements/common.txt)") from None
    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError for a bad file
        raise DataError(f"{path}: not a readable parquet file ({' '.join(str(e).split())})") from None
    names = set(pf.schema_arrow.names)
    want = [c for c in columns if c in names] if columns is not None else None
    i = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=want):
        for row in batch.to_pylist():
            yield f"{path}:row {i}", row
            i += 1
