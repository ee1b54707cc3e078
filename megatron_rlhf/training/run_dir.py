"""Run-directory discipline every trainer shares: what a run may resume, replace or rewrite.

``open_run(output_dir, config, ...)`` first locks ``output_dir`` for this run
(runtime/locks.py: a second run on it is refused with exit code 2), then decides:

- resuming (``train.resume=true`` and a checkpoint exists): the checkpoint is the latest one
  that verifies (training/checkpointing.py); the config it was saved with is compared key by
  key with the new one, and a change outside ``allowed`` (steps, intervals, logging) is refused
  unless ``force_config_change`` — every change is printed and appended to
  ``config_changes.jsonl``;
- not resuming on a directory that holds checkpoints: refused unless ``overwrite``, which
  deletes the old checkpoints and logs first;
- the step logs (``metrics.jsonl``, ``samples.jsonl``) are cut back to the resumed step, so each
  step appears once (TensorBoard: ``SummaryWriter(purge_step=step + 1)``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_rlhf.utils import InputError, atomic_output, is_rank0

STEP_LOGS = ("metrics.jsonl", "samples.jsonl")
RUN_FILES = ("latest_checkpoint.txt", "config.json", "config_changes.jsonl", *STEP_LOGS)


def open_run(
    output_dir: str | Path,
    config: dict,
    *,
    resume: bool,
    overwrite: bool,
    force_config_change: bool,
    allowed: tuple[str, ...],
    defaults: dict | None = None,
    moved: dict[str, str] | None = None,
) -> Path | None:
    """The checkpoint to resume from (None: a fresh run); see the module docstring.

    ``config`` is the resolved config as a dict; ``allowed`` holds dotted keys (or prefixes
    ending in ".") that may change on resume; ``defaults`` ({dotted key: default}): a key the
    checkpoint's config lacks (added since it was written) is no change while it holds its
    default; ``moved`` ({old dotted key: new}): a checkpoint's config written with an old key
    is compared at the new one. Collective: call on every rank."""
    from megatron_rlhf.checkpoint.dist import read_metadata
    from megatron_rlhf.config import move_keys
    from megatron_rlhf.runtime import locks
    from megatron_rlhf.training.checkpointing import latest_checkpoint, resume_checkpoint

    output_dir = Path(output_dir)
    locks.acquire(output_dir)  # one run per directory, before anything is written there
    latest = latest_checkpoint(output_dir)
    if latest is not None and not resume:
        if not overwrite:
            raise InputError(
                f"{output_dir}: already holds checkpoints ({latest.name}) and train.resume=false;"
                " set train.resume=true to continue that run, pass --overwrite to delete it and "
                "start over, or choose another train.output_dir"
            )
        _clear(output_dir)
        latest = None
    checkpoint = resume_checkpoint(output_dir) if latest is not None else None
    if checkpoint is not None:
        saved = read_metadata(checkpoint).get("config")
        if saved is not None:
            move_keys(saved, moved or {}, str(checkpoint), warn=False)
            _check_changes(
                output_dir, checkpoint, saved, config, allowed, force_config_change, defaults or {}
            )
    truncate_step_logs(output_dir, _step_of(checkpoint))
    return checkpoint


def config_changes(old: dict, new: dict) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} for every leaf that differs."""
    flat_old, flat_new = _flatten(old), _flatten(json.loads(json.dumps(new)))
    return {
        key: (flat_old.get(key), flat_new.get(key))
        for key in sorted(set(flat_old) | set(flat_new))
        if flat_old.get(key) != flat_new.get(key)
    }


def truncate_step_logs(output_dir: Path, step: int) -> None:
    """Drop every record of ``metrics.jsonl`` / ``samples.jsonl`` after ``step`` (rank 0; each
    file replaced atomically). The only place the step logs are cut (training/run.py)."""
    if is_rank0():
        for name in STEP_LOGS:
            path = output_dir / name
            if path.exists():
                kept = [
                    line
                    for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                    if line.strip() and json.loads(line).get("step", 0) <= step
                ]
                with atomic_output(path) as tmp:
                    tmp.write_text("".join(kept), encoding="utf-8")
    _barrier()


def first_logged(output_dir: Path, key: str):
    """``key`` of the first record of ``metrics.jsonl`` (the run's real first step), or None."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            return json.loads(line).get(key)
    return None


def _check_changes(output_dir, checkpoint, saved, config, allowed, force, defaults) -> None:
    known = _flatten(saved)
    changes = {
        key: (old, new)
        for key, (old, new) in config_changes(saved, config).items()
        if key in known or key not in defaults or defaults[key] != new
    }
    if not changes:
        return
    refused = {k: v for k, v in changes.items() if not _allowed(k, allowed)}
    listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())
    if refused and not force:
        names = ", ".join(refused)
        raise InputError(
            f"{checkpoint}: resuming with a changed config ({names}); only "
            f"{', '.join(allowed)} may change on resume; restore the saved values (see "
            f"{output_dir / 'config.json'}), pass --force-config-change to resume anyway, or "
            "choose another train.output_dir"
        )
    if is_rank0():
        print(f"[resume] config changed since {checkpoint.name}: {listed}", file=sys.stderr)
        record = {
            "step": _step_of(checkpoint),
            "forced": bool(refused),
            "changes": {k: [old, new] for k, (old, new) in changes.items()},
        }
        with open(output_dir / "config_changes.jsonl", "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def _allowed(key: str, allowed: tuple[str, ...]) -> bool:
    return any(key == a or (a.endswith(".") and key.startswith(a)) for a in allowed)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _step_of(checkpoint: Path | None) -> int:
    return 0 if checkpoint is None else int(checkpoint.name.removeprefix("step_"))


def _clear(output_dir: Path) -> None:
    """--overwrite: delete the run's checkpoints, logs and TensorBoard events (rank 0)."""
    if is_rank0():
        print(f"[run] --overwrite: deleting the previous run in {output_dir}", file=sys.stderr)
        for path in output_dir.glob("step_*"):
            shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(output_dir / "tensorboard", ignore_errors=True)
        for name in RUN_FILES:
            (output_dir / name).unlink(missing_ok=True)
    _barrier()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
