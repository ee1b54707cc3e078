"""One run per output directory: an exclusive lock, held by global rank 0 for the whole run.

``acquire(output_dir, key)`` (collective, called by ``training/run_dir.open_run`` before
anything is written there) takes ``flock(LOCK_EX | LOCK_NB)`` on ``output_dir/.run.lock`` and
writes the holder into it: host, pid, start time (UTC) and command line. A second run on the
same directory is refused on every rank with exit code 2 and a message naming that holder.

The kernel drops an ``flock`` when the last descriptor of its open file is closed, i.e. when its
process dies, however it dies, so the lock never outlives its run on this host: a forked child
(Megatron's checkpoint writer, a data-loader worker) closes its inherited copy at once
(``os.register_at_fork``), so a child orphaned by a SIGKILLed trainer cannot keep the lock. A holder record left behind (the run was SIGKILLed) is *stale*: when it
names this host the record is reported and replaced. A record from another host cannot be
checked from here (``flock`` may not span hosts on a network file system): it is refused, with
the command that clears it. On a file system without ``flock`` (``ENOSYS``, ``ENOLCK``, ...) the
record alone guards the directory: a record whose pid is alive on this host is refused. :func:`release` (end of the command, and ``atexit``)
removes the file while still holding the lock; a run that opened the old file re-opens the path
after locking, so two runs never hold two different files of the same name.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.utils import InputError, at_command_end

LOCK_FILE = ".run.lock"
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # e.g. Lustre w/o flock
_held: dict[str, tuple[int, bool]] = {}  # lock file realpath -> (descriptor, dir created)


def _close_in_forked_child() -> None:
    """A forked child holds none of its parent's locks (module docstring)."""
    for fd, _ in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)  # the descriptor only: the lock stays with the parent's
    _held.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)


def acquire(output_dir: str | Path, key: str = "train.output_dir") -> None:
    """Lock ``output_dir`` for this run (rank 0 holds it; collective when distributed).

    Raises InputError on every rank when another run holds it. Re-acquiring a directory this
    process already holds is a no-op."""
    refusal = None
    if _rank() == 0:
        try:
            _acquire_here(Path(output_dir), key)
        except InputError as err:
            refusal = str(err)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [refusal]
        dist.broadcast_object_list(shared, src=0)
        refusal = shared[0]
    if refusal is not None:
        raise InputError(refusal)


def lock_output(path: str | Path, flag: str) -> None:
    """One command per output file, path prefix or directory that is not a training run's
    (``score --output``, ``generate --output``, ``eval-* --output-dir``, ``preprocess
    --output-prefix``, ``build_rehearsal_clusters``, the converters' ``--save``): the same lock
    as :func:`acquire`, on ``.<name>.lock`` beside it, held by rank 0 until the command exits.
    Not collective (commands check their outputs before torch.distributed starts): under
    torchrun, rank 0's refusal ends the launch."""
    path = Path(path)
    if _rank() == 0:
        # keep_directory: the command creates (or fills) the parent itself; releasing the lock
        # must not remove a directory it would have left behind
        _acquire_here(
            path.parent, flag, lock_name=f".{path.name}.lock", what="output", keep_directory=True
        )


def release() -> None:
    """Drop every lock this process holds: the lock file is removed (and the output directory,
    if acquiring created it and nothing else was written there)."""
    for path, (fd, created) in list(_held.items()):
        try:
            os.unlink(path)  # while still locked: a waiting run re-opens the new file
            if created:
                with contextlib.suppress(OSError):  # not empty: the run wrote there
                    os.rmdir(os.path.dirname(path))
            with contextlib.suppress(OSError):  # no flock on this file system: nothing held
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            del _held[path]


def _acquire_here(
    output_dir: Path,
    key: str,
    lock_name: str = LOCK_FILE,
    what: str = "directory",
    keep_directory: bool = False,
) -> None:
    path = output_dir / lock_name
    if os.path.realpath(path) in _held:
        return
    if output_dir.exists() and not output_dir.is_dir():
        raise InputError(f"{key} {output_dir}: is a file; give a directory")
    created = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    flocked = True
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise _held_by(holder, output_dir, path, key, what) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            print(
                f"[run] {path}: this file system does not support flock ({err.strerror}); "
                "the holder record alone guards the directory",
                file=sys.stderr,
                flush=True,
            )
            flocked = False
            break
        if _same_file(fd, path):
            break
        os.close(fd)  # the holder removed it as we opened it: lock the new one
    previous = _read(fd)
    if previous:
        try:
            if not flocked and _alive_here(previous):
                raise _held_by(previous, output_dir, path, key, what)
            _check_stale(previous, path, key)
        except InputError:
            os.close(fd)
            raise
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[os.path.realpath(path)] = (fd, created and not keep_directory)


def _held_by(
    holder: dict, output_dir: Path, path: Path, key: str, what: str = "directory"
) -> InputError:
    target = output_dir if what == "directory" else path.with_name(path.name[1:-5])
    separator = "=" if what == "directory" else " "
    return InputError(
        f"{key}{separator}{target}: another run is using this {what} ({_describe(holder)}; lock "
        f"{path}); wait for it to end or choose another {key}"
    )


def _alive_here(holder: dict) -> bool:
    """The holder's pid runs on this host (only consulted where flock is unavailable: with
    flock, a free lock proves the holder is gone even if its pid was reused)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _check_stale(previous: dict, path: Path, key: str) -> None:
    """A record nobody flocks: report it and go on if its pid is gone on this host, else
    refuse (a run on another host may hold it without this host's kernel knowing)."""
    if previous.get("host") != socket.gethostname():
        raise InputError(
            f"{path.parent}: locked by a run on another host ({_describe(previous)}), which "
            f"cannot be checked from here; if that run has ended, clear the lock with "
            f"`rm {path}` and relaunch, or choose another {key}"
        )
    print(
        f"[run] {path}: stale lock, held by no process on this host ({_describe(previous)}; "
        "that run was killed before it could release it), taken over",
        file=sys.stderr,
        flush=True,
    )


def _read(fd: int) -> dict:
    raw = os.pread(fd, 65536, 0).decode(errors="replace").strip()
    if not raw:
        return {}
    try:
        record = json.loads(raw)
    except json.JSONDecodeError:
        return {"unreadable": raw[:80]}
    return record if isinstance(record, dict) else {"unreadable": raw[:80]}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "holder not recorded yet"
    return (
        f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started')}, "
        f"command: {holder.get('command')}"
    )


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


at_command_end(release)  # the end of the command that took the lock
atexit.register(release)
