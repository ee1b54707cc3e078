"""Small helpers every command shares: atomic outputs, JSONL with file:line errors, summaries."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path


class InputError(ValueError):
    """Bad user input: the message names the file/line or config key and says how to fix it."""


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    A crash or an exception leaves no half-written file that looks complete.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, record)`` for each non-empty line; errors name the file and line."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file")
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(f"{path}:{line_number}: invalid UTF-8 ({err.reason})") from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{line_number}: malformed JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise InputError(f"{path}:{line_number}: expected a JSON object per line")
            yield line_number, record


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> int:
    """Write records as JSONL atomically; return how many were written."""
    count = 0
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def write_json(path: str | os.PathLike, obj) -> None:
    """Write one JSON document atomically (indented, NaN-free)."""
    with atomic_output(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n", encoding="utf-8")


def require_finite(value: float, where: str) -> float:
    """Return ``value`` as a float, or raise naming ``where`` if it is missing, NaN or inf."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise InputError(f"{where}: score is {value} (NaN/inf); fix or drop that record")
    return float(value)


def is_rank0() -> bool:
    """True outside torch.distributed and on global rank 0."""
    rank = os.environ.get("RANK")
    return rank is None or rank == "0"


def print_summary(command: str, **fields) -> None:
    """The one-line summary printed at the end of every command (rank 0 only)."""
    if not is_rank0():
        return
    parts = " ".join(f"{key}={_fmt(value)}" for key, value in fields.items())
    print(f"[{command}] done: {parts}", file=sys.stdout, flush=True)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
