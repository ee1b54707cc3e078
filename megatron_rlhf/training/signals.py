"""Save on a signal and leave nothing behind: what every trainer does when it is preempted.

``train.exit_signals`` (default SIGTERM and SIGUSR1) are caught from the first step
(``train-ppo``: from before its models are built; earlier, a signal ends the process as usual,
with nothing new to save). The handler only records the signal, so the current step finishes; after each step every rank
takes part in one all-reduce (MAX of the signal number) to agree that the run stops at that step,
even when the ranks got the signal at different moments, or only some did. The trainer then
saves a checkpoint of that step (unless the step was just saved), prints its summary and exits
with :data:`EXIT_SAVED_ON_SIGNAL`. A second signal while saving is reported and otherwise
ignored; the save still completes, and as every save it writes ``<dir>.tmp-partial`` and renames
it only when complete, so even a SIGKILL mid-save leaves the previous checkpoint as the latest.

Child processes: Megatron's checkpoint writer serves its results queue from a forked ``Manager``
process (checkpoint/dist.py); it is started with ``runtime/processes.die_with_parent`` so the
kernel kills it when the trainer dies, however it dies (a normal exit, a caught signal
included, shuts it down through multiprocessing's own exit hooks). Megatron's shard writers are
forked for one save and joined before the save returns.
"""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist

from megatron_rlhf.distributed.parallel import world_max
from megatron_rlhf.utils import InputError

EXIT_SAVED_ON_SIGNAL = 75
"""Exit code of a run stopped by one of ``train.exit_signals`` after saving its checkpoint
(sysexits' EX_TEMPFAIL: relaunch it, e.g. by requeueing the job, and it resumes from there)."""
DEFAULT_EXIT_SIGNALS = ("SIGTERM", "SIGUSR1")


def parse_signals(names, key: str = "train.exit_signals") -> list[signal.Signals]:
    """``["SIGTERM", "USR1", 10]`` -> signals; an unknown or uncatchable one is named."""
    parsed = []
    for name in names:
        text = str(name).upper()
        text = text if text.startswith("SIG") or text.isdigit() else "SIG" + text
        try:
            sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals[text]
        except (KeyError, ValueError):
            raise InputError(f"{key}: {name!r} is not a signal; e.g. [SIGTERM, SIGUSR1]") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise InputError(f"{key}: {sig.name} cannot be caught; use SIGTERM or SIGUSR1")
        parsed.append(sig)
    return parsed


class ExitSignals:
    """Catch ``names`` until :meth:`restore`; :meth:`agreed` is the per-step agreement."""

    def __init__(self, names=DEFAULT_EXIT_SIGNALS, command: str = "train"):
        self.command = command
        self.received: signal.Signals | None = None
        self._previous = {}
        for sig in parse_signals(names):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = signal.Signals(signum)
            note = f"[{self.command}] {name}: finishing this step, then saving a checkpoint\n"
        else:
            note = f"[{self.command}] {name} again: already stopping; the save is not cut off\n"
        os.write(2, note.encode())  # not print(): the handler may interrupt a write to stderr

    def agreed(self) -> signal.Signals | None:
        """The signal the run stops for, the same on every rank, or None (collective when
        distributed: one all-reduce over the world)."""
        agreed = world_max(int(self.received or 0))
        return signal.Signals(agreed) if agreed else None

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def stopped_message(command: str, sig: signal.Signals, step: int, checkpoint) -> None:
    _say(
        f"[{command}] stopped by {sig.name} after step {step}; checkpoint {checkpoint}; exit "
        f"code {EXIT_SAVED_ON_SIGNAL}: relaunch the same command to resume"
    )


def _say(message: str) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
