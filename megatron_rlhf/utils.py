"""Small helpers every command shares: atomic outputs, JSONL with file:line errors, summaries,
and the one-line error (exit code 2) that a bad input or an unusable output path ends in."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], object]:
    """A package's module ``__getattr__`` (PEP 562) importing ``{name: submodule}`` on first
    use, so importing the package (e.g. for a command's ``--help``) does not load torch."""
    import importlib

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__


class InputError(ValueError):
    """Bad user input: the message names the file/line or config key and says how to fix it."""


class NonFiniteError(InputError):
    """A non-finite loss, gradient norm or tensor: the run stops (exit code 2)."""


# OS errors a user can fix (a full disk, a path they may not write, a directory deleted while the
# command ran) end in one line and exit code 2, like an InputError; any other is a bug: traceback.
USER_OS_ERRORS = {
    errno.ENOSPC: "the disk is full; free space or write somewhere else",
    errno.EDQUOT: "the disk quota is exhausted; free space or write somewhere else",
    errno.EACCES: "permission denied; choose a path you may write (or read)",
    errno.EPERM: "operation not permitted; choose another path",
    errno.EROFS: "read-only file system; write somewhere else",
    errno.EISDIR: "is a directory; give a file path",
    errno.ENOTDIR: "a parent of this path is not a directory; fix the path",
    errno.ENOENT: "no such file or directory (was it moved or deleted while the command ran?)",
}


# What every command gives back when it ends, however it ended, registered by the modules that
# hold it (utils imports none of them): the run and output locks (runtime/locks.py), and
# torch.distributed with Megatron's groups for a command run distributed (distributed/).
_AT_COMMAND_END: dict[bool, list[Callable[[], None]]] = {False: [], True: []}


def at_command_end(hook: Callable[[], None], *, distributed: bool = False) -> None:
    """Have :func:`run_command` call ``hook`` when a command ends (``distributed``: only a
    command run with ``distributed=True``), after the hooks registered before it."""
    if hook not in _AT_COMMAND_END[distributed]:
        _AT_COMMAND_END[distributed].append(hook)


def run_command(command: str, body: Callable[[], int], distributed: bool = False) -> int:
    """Run a command's body; an :class:`InputError` or a user-fixable OS error anywhere in it
    (also one wrapped by torch's ``CheckpointException``) becomes one line on stderr,
    ``<command>: error: ...``, and exit code 2. Nothing else is caught. ``distributed``: tear
    down torch.distributed and Megatron's groups afterwards, however the body ended."""
    try:
        return body()
    except InputError as err:
        message = str(err)
    except BaseException as err:  # CheckpointException derives from BaseException
        os_error = find_user_os_error(err)
        if os_error is None:
            raise
        message = os_error_message(os_error)
    finally:
        for hook in _AT_COMMAND_END[False] + (_AT_COMMAND_END[True] if distributed else []):
            hook()
    print(f"{command}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return 2


def find_user_os_error(err: BaseException) -> OSError | None:
    """The first user-fixable ``OSError`` in ``err``, its causes and (for torch's
    ``CheckpointException``) the per-rank failures it wraps; None if there is none."""
    for current in error_chain(err):
        if isinstance(current, OSError) and current.errno in USER_OS_ERRORS:
            return current
        if isinstance(current, (KeyboardInterrupt, SystemExit)):
            return None
    return None


def error_chain(err: BaseException):
    """``err``, then (breadth first, each once) its causes, contexts and the per-rank failures
    a torch ``CheckpointException`` wraps."""
    seen, pending = set(), [err]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [current.__cause__, current.__context__]


def os_error_message(err: OSError) -> str:
    """``PATH: what happened; how to fix it`` for a user-fixable OS error."""
    where = err.filename if err.filename is not None else "an output path"
    return f"{where}: {USER_OS_ERRORS[err.errno]} ({err.strerror or os.strerror(err.errno)})"


def check_output_path(path: str | os.PathLike, overwrite: bool, flag: str = "--output") -> Path:
    """Refuse an output file before any heavy work: an existing one (unless ``overwrite``), a
    directory, or a place this process cannot write. Returns ``path`` as a Path."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a directory; give a file path")
    if path.exists() and not overwrite:
        raise InputError(f"{flag} {path}: already exists; pass --overwrite to replace it")
    check_writable_parent(path, flag)
    return path


def check_output_dir(path: str | os.PathLike, overwrite: bool, flag: str = "--output-dir") -> Path:
    """Refuse an output directory before any heavy work: a file at that path, an existing one
    (unless ``overwrite``), or a place this process cannot write. Returns ``path`` as a Path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: is a file; give a directory")
    if path.exists() and not overwrite:
        raise InputError(f"{flag} {path}: exists; pass --overwrite or another {flag}")
    check_writable_parent(path, flag)
    return path


def check_output_prefix(
    prefix: str | os.PathLike, suffixes: Iterable[str], overwrite: bool, flag: str
) -> Path:
    """:func:`check_output_path` for the files ``PREFIX<suffix>`` a multi-file writer creates."""
    prefix = Path(prefix)
    if prefix.is_dir():
        raise InputError(
            f"{flag} {prefix}: is a directory; give a path prefix such as {prefix}/out"
        )
    existing = [str(prefix) + s for s in suffixes if Path(str(prefix) + s).exists()]
    if existing and not overwrite:
        raise InputError(
            f"{flag} {prefix}: {existing[0]} already exists; pass --overwrite to replace it"
        )
    check_writable_parent(prefix, flag)
    return prefix


def check_writable_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor of ``path`` must be a directory this process may write."""
    parent = path.parent.resolve()
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is not a directory; fix the path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot write in {parent}; choose a writable place")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` only if the block succeeds.

    The block may write a file or make a directory there. A crash or an exception leaves no
    half-written file or directory that looks complete.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        elif tmp.exists() or tmp.is_symlink():
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
