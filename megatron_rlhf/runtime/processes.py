"""Helpers for the processes a command starts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


# libc, opened here rather than in a forked child: dlopen there could wait forever on a loader
# lock that another thread of the parent held at the fork (subprocess's preexec_fn runs there).
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """In a forked child: have the kernel SIGKILL it when its parent dies (Linux)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def become_subreaper() -> bool:
    """Make this process the one that orphans below it are re-parented to (Linux), instead of
    init: a grandchild whose parent died, or one that started a session of its own (torchrun's
    workers do), stays among :func:`descendants` of this process, so a supervisor can find and
    end it. It must then reap them (:func:`end_tree` does). Returns whether it took effect."""
    return _LIBC is not None and _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), read from /proc; empty
    where there is no /proc. Sessions and process groups do not matter, parenthood does."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while being read
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_tree(pid: int, grace_s: float, *, also: list[int] = (), reap: bool = False) -> None:
    """End ``pid``'s descendants (not ``pid`` itself) and the processes ``also`` names: SIGTERM to
    all of them at once, then, after up to ``grace_s``, SIGKILL to whatever is still running.
    SIGTERM first so that a launcher such as torchrun can stop its workers and the workers can
    free the GPU cleanly; all at once so that nobody's grace waits on someone else's. ``reap``:
    collect the exit status of this process's ended children, for a subreaper
    (:func:`become_subreaper`) that has no other children whose status someone else awaits (a
    ``subprocess.Popen`` it still holds would lose its return code)."""
    found = [*also, *descendants(pid)]
    _signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in found) and time.monotonic() < deadline:
        if reap:
            _reap()
        time.sleep(0.05)
    _signal_all([p for p in [*found, *descendants(pid)] if _alive(p)], signal.SIGKILL)
    for _ in range(100):
        if reap:
            _reap()
        if not any(_alive(p) for p in found):
            return
        time.sleep(0.05)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _reap() -> None:
    """Collect the exit status of this process's ended children (orphans it adopted)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


_forks_die_with_parent = threading.local()


def _after_fork_in_child() -> None:
    if getattr(_forks_die_with_parent, "on", False):
        die_with_parent()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def forks_die_with_parent():
    """Every process this thread forks inside the block dies with this process (SIGKILL from
    the kernel). Megatron's checkpoint writer forks workers that, if the trainer is killed
    mid-save, would otherwise wait forever on a queue whose other end died, holding the tensors
    they were given and every descriptor they inherited. Thread-local because the kernel ties
    the signal to the forking thread's exit: only forks of a thread that lives as long as the
    process may carry it."""
    before = getattr(_forks_die_with_parent, "on", False)
    _forks_die_with_parent.on = threading.current_thread() is threading.main_thread()
    try:
        yield
    finally:
        _forks_die_with_parent.on = before
