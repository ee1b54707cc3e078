"""One training run's lifecycle, the same for every trainer (``train-sft``, ``train-reward``
through training/loop.py; ``train-ppo`` through ppo/train.py).

A :class:`Run` is built once the models can be loaded, and then:

- opens ``train.output_dir`` (training/run_dir.py ``open_run``: the lock, the checkpoint to
  resume from, the config-change rules of ``allowed``, ``--overwrite``; the step logs cut back to
  the resumed step);
- :meth:`Run.restore` loads that checkpoint into the trainer's engines and gives back the trainer
  state (at another world size, the global one saved in the metadata), with the non-finite
  guard's count; a trainer adds its own state (PPO: KL controller, reward normaliser, data
  positions) from the returned dict;
- :meth:`Run.start` writes ``config.json`` (atomically) and opens the :class:`RunLog`;
- per step: :meth:`Run.check` (training/guards.py: a non-finite step is skipped or stops the run
  with exit code 2 before it is saved), :meth:`Run.write` (the step's metrics, when a log line
  is due), then :meth:`Run.end_step` (a checkpoint when due, and on an exit signal all ranks
  agree on, training/signals.py, a checkpoint and a stop);
- :func:`finish` prints the one-line summary and returns the exit code (75 when stopped by a
  signal).

The run owns the cadence, for every trainer: :meth:`Run.due` is the one rule for
``train.save_interval``, ``train.log_interval``, ``train.eval_interval`` and
``train.sample_interval`` (every that many steps and at the last step; 0: only at the last), so
a trainer never reads an interval itself and the commands cannot drift apart.

What differs is the trainer's ``save()`` (its engines and state) and what it logs.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from megatron_rlhf.training.config import RESUMABLE_CHANGES
from megatron_rlhf.utils import InputError, is_rank0, print_summary, write_json


class Run:
    """A run in ``config.train.output_dir`` (``config.train``'s ``resume`` and
    ``max_nonfinite_skips``; ``allowed``: the config keys that may change on resume; ``lr_key``:
    what the guard's error tells to lower). Collective: build it on every rank."""

    def __init__(
        self,
        command: str,
        config,
        *,
        overwrite: bool = False,
        force_config_change: bool = False,
        allowed: tuple[str, ...] = RESUMABLE_CHANGES,
        lr_key: str = "optim.lr",
    ):
        from megatron_rlhf.config import config_defaults, moved_keys, to_dict
        from megatron_rlhf.training.guards import NonFiniteGuard
        from megatron_rlhf.training.run_dir import open_run

        self.command, self.config = command, config
        self.output_dir = Path(config.train.output_dir)
        self.guard = NonFiniteGuard(config.train.max_nonfinite_skips, lr_key=lr_key)
        self.resume_from: Path | None = open_run(
            self.output_dir,
            to_dict(config),
            resume=config.train.resume,
            overwrite=overwrite,
            force_config_change=force_config_change,
            allowed=allowed,
            defaults=config_defaults(type(config)),
            moved=moved_keys(type(config)),
        )
        """The checkpoint to resume from; None: a fresh run."""
        self.step = 0
        """Optimizer steps done (the resumed one's, then the last one's)."""
        self.checkpoint: Path | None = self.resume_from
        """The newest checkpoint of the run."""
        self.saved_step: int | None = None
        self.stopped_by: signal.Signals | None = None
        self.log: RunLog | None = None
        self.total_steps: int | None = None
        """The run's last step (set by :meth:`start`)."""

    def restore(self, engines: dict) -> dict:
        """Load :attr:`resume_from` into ``engines`` ({role: TrainEngine}); the trainer state it
        holds: this rank's, or at another world size the global one of its metadata (a
        checkpoint without one is refused: it would restart at step 0 with trained weights)."""
        from megatron_rlhf.checkpoint.dist import read_metadata
        from megatron_rlhf.training.checkpointing import load_training_checkpoint

        state = load_training_checkpoint(self.resume_from, engines)
        if not state:  # saved at another world size: the global state from the metadata
            meta = read_metadata(self.resume_from)
            if "trainer_state" in meta:
                state = meta["trainer_state"]
                for role, engine in engines.items():
                    engine.load_scheduler_state(meta["schedulers"][role])
            else:
                raise InputError(
                    f"{self.resume_from}: saved at another world size by a version without a "
                    "global trainer state; resume with the same launch"
                )
        self.resumed(state)
        return state

    def resumed(self, state: dict) -> None:
        """The trainer state of :attr:`resume_from` is loaded: the step and the guard's count."""
        self.step = self.saved_step = state.get("step", 0)
        self.guard.load_state_dict(state.get("nonfinite", {}))
        log(self.command, f"resumed from {self.resume_from} at step {self.step}")

    def start(self, total_steps: int) -> RunLog:
        """Write ``config.json`` and open the run log at :attr:`step` (collective)."""
        from megatron_rlhf.config import to_dict

        if self.resume_from is not None and self.step >= total_steps:
            log(
                self.command,
                f"nothing left to do: {self.resume_from} is at step {self.step} of {total_steps};"
                " raise train.steps (or train.epochs) to train further",
            )
        if is_rank0():
            write_json(self.output_dir / "config.json", to_dict(self.config))
        self.total_steps = total_steps
        self.log = RunLog(self.command, self.output_dir, self.step, total_steps)
        return self.log

    def check(self, step: int, metrics: dict) -> bool:
        """Step ``step`` was finite (False: skipped); past the budget it stops the run with a
        NonFiniteError (exit 2) before the step is saved. Collective."""
        self.step = step
        return self.guard.check(step, metrics)

    def due(self, what: str, step: int) -> bool:
        """Whether ``train.<what>_interval`` (``what``: save, log, eval or sample) acts after step
        ``step``: every that many steps and at the run's last step; 0 means only at the last;
        and after each step listed in ``train.<what>_at`` (``save_at``). The one rule of every
        trainer (a trainer without that key never acts early)."""
        interval = getattr(self.config.train, f"{what}_interval", 0)
        listed = step in getattr(self.config.train, f"{what}_at", ())
        return step == self.total_steps or (interval > 0 and step % interval == 0) or listed

    def write(self, step: int, metrics: dict, prefix: str | None = None) -> None:
        """Step ``step``'s metrics to the run log (rank 0) when a log line is due
        (``train.log_interval``)."""
        if self.due("log", step):
            self.log.write(step, metrics, prefix)

    def end_step(self, step: int, save, exit_signals) -> signal.Signals | None:
        """After step ``step``: ``save(step)`` (collective; returns the checkpoint) when due
        (``train.save_interval``); then the exit signal every rank agrees on, if any, after a
        checkpoint of this step."""
        from megatron_rlhf.training.signals import stopped_message

        self.step = step
        if self.due("save", step):
            self.checkpoint, self.saved_step = save(step), step
        self.stopped_by = exit_signals.agreed()
        if self.stopped_by is not None:
            if self.saved_step != step:
                self.checkpoint, self.saved_step = save(step), step
            stopped_message(self.command, self.stopped_by, step, self.checkpoint)
        return self.stopped_by

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def log(command: str, message: str) -> None:
    """One line on rank 0's stderr, prefixed with the command."""
    if is_rank0():
        print(f"[{command}] {message}", file=sys.stderr, flush=True)


def finish(command: str, fields: dict, stopped_by: str | None) -> int:
    """Print the one-line summary (``stopped_by=`` when a signal stopped the run); the exit
    code: 75 (training/signals.py) if it was stopped, else 0."""
    from megatron_rlhf.training.signals import EXIT_SAVED_ON_SIGNAL

    print_summary(command, **fields, **({"stopped_by": stopped_by} if stopped_by else {}))
    return EXIT_SAVED_ON_SIGNAL if stopped_by else 0


class RunLog:
    """Rank 0's progress bar, TensorBoard scalars and ``metrics.jsonl`` (other ranks: nothing).
    Opened at a resumed step, TensorBoard drops that run's later events (``open_run`` has cut
    ``metrics.jsonl`` back), so each step appears once."""

    def __init__(self, command: str, output_dir: Path, step: int, total_steps: int):
        self.enabled = is_rank0()
        self.metrics_file = output_dir / "metrics.jsonl"
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter
            from tqdm import tqdm

            output_dir.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(output_dir / "tensorboard"), purge_step=step + 1)
            self.bar = tqdm(total=total_steps, initial=step, desc=command)

    def advance(self, **postfix) -> None:
        """One optimizer step done: move the bar, show ``postfix`` (numbers or text)."""
        if self.enabled:
            self.bar.update(1)
            self.bar.set_postfix({k: _short(v) for k, v in postfix.items()})

    def write(self, step: int, scalars: dict, prefix: str | None = None) -> None:
        """Scalars (``prefix/key`` when given, echoed as a line) to TensorBoard and one
        ``metrics.jsonl`` line."""
        if not self.enabled:
            return
        named = {f"{prefix}/{k}" if prefix else k: v for k, v in scalars.items()}
        for key, value in named.items():
            self.writer.add_scalar(key, value, step)
        with open(self.metrics_file, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **named}) + "\n")
        if prefix:
            self.bar.write(
                f"{prefix} @ step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in scalars.items())
            )

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.writer.close()


def _short(value) -> str:
    return value if isinstance(value, str) else f"{value:.4g}"
