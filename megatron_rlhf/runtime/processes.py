"""Helpers for the processes a command starts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a forked child: have the kernel SIGKILL it when its parent dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


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
