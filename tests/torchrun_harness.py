"""The worker side of every multi-rank test: one torchrun launch runs many named checks.

A worker script registers its checks and hands over to :meth:`Harness.main`::

    harness = Harness(__doc__)
    harness.parser.add_argument("--data", required=True)

    @harness.check
    def loader_order(args) -> str:
        ...  # collectives as needed; raise (assert) to fail
        return "what was compared"

    if __name__ == "__main__":
        harness.main()

``main`` parses the command line (``--out DIR``, ``--checks NAME ...`` to run only some, and the
worker's own flags), starts torch.distributed over gloo (Megatron-Core's layouts are the checks'
business: ``distributed.initialize``), runs the checks in registration order and writes this
rank's records to ``DIR/rank<r>.json``, then tears everything down. A check returns its detail
(recorded as passed under its name) or records several results itself with
:meth:`Harness.record`; one that raises is recorded as failed with this rank's traceback and
the next check still runs. Ranks write their own files, so a check may tear the process group
down (``train-ppo``'s main does) and nothing is gathered at the end; the launcher
(``torchrun_util.run_checks``) merges the files: a check passes when every rank that recorded
it passed. A collective that never completes ends the worker after ``--hang-seconds`` with
every thread's stack on stderr, which the launcher shows. For resume checks,
:func:`run_killed_during_step` runs a training command that dies in the middle of a step.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

Check = Callable[[argparse.Namespace], "str | None"]


class Harness:
    """A registry of named checks and the one way a worker runs them."""

    def __init__(self, description: str | None = None):
        self.parser = argparse.ArgumentParser(description=description)
        self.parser.add_argument("--out", type=Path, required=True, help="folder for rank files")
        self.parser.add_argument("--checks", nargs="*", help="run only these (default: all)")
        self.parser.add_argument("--hang-seconds", type=float, default=570)
        self.checks: dict[str, Check] = {}
        self.records: dict[str, tuple[bool, str]] = {}

    def check(self, fn: Check) -> Check:
        """Register ``fn`` under its name (decorator)."""
        self.checks[fn.__name__] = fn
        return fn

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        """Record one result on this rank (the launcher merges the ranks)."""
        self.records[name] = (bool(ok), str(detail))

    def main(self) -> None:
        """Run the checks named on the command line (all by default), then tear down."""
        args = self.parser.parse_args()
        faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
        torch.set_num_threads(1)
        from megatron_rlhf.distributed import destroy, init_process_group

        init_process_group()
        rank = dist.get_rank()
        unknown = sorted(set(args.checks or ()) - set(self.checks))
        if unknown:
            raise SystemExit(f"unknown checks {unknown}; registered: {sorted(self.checks)}")
        for name in args.checks or list(self.checks):
            try:
                detail = self.checks[name](args)
            except Exception:
                self.record(name, False, traceback.format_exc()[-3000:])
                continue
            if detail is not None:
                self.record(name, True, detail)
        args.out.mkdir(parents=True, exist_ok=True)
        records = {
            name: {"ok": ok, "detail": detail} for name, (ok, detail) in self.records.items()
        }
        (args.out / f"rank{rank}.json").write_text(json.dumps(records, indent=1))
        if dist.is_initialized():  # a check may have torn it down (train-ppo's main does)
            destroy()
        faulthandler.cancel_dump_traceback_later()


class Killed(Exception):
    """Stands in for the process being killed in the middle of a training step."""


def run_killed_during_step(engine_class, step: int, run: Callable[[], object]) -> int:
    """Call ``run()`` with ``engine_class.step`` raising :class:`Killed` at its ``step``-th
    training (not forward-only) call, as if the process died there; returns how many training
    steps began."""
    original, calls = engine_class.step, []

    def dying_step(self, microbatches, loss_fn, forward_only=False):
        if not forward_only:
            calls.append(1)
            if len(calls) == step:
                raise Killed(f"killed during step {step}")
        return original(self, microbatches, loss_fn, forward_only)

    engine_class.step = dying_step
    try:
        run()
    except Killed:
        pass
    finally:
        engine_class.step = original
    return len(calls)
