"""Training checkpoints that resume exactly: model, optimizer, LR schedule, RNG, data position.

A training checkpoint is also a model checkpoint: its model tensors carry the model's own keys,
so ``megatron_rlhf.checkpoint.load_bloom`` reads it at any TP/PP layout. Optimizer state is
saved sharded like the model. RNG states (torch, numpy, python), LR-schedule positions and the
trainer's counters are saved per rank as JSON (never a pickle); resuming at another layout
restores everything except those (and says so). ``latest_checkpoint.txt`` names a ``step_N``
directory of the run, resolved inside it (a symlink out is refused, checkpoint/containment.py);
when that checkpoint is damaged (its manifest does not verify), resuming
falls back to the newest one that does, and says so.
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.checkpoint import dist as dist_ckpt
from megatron_rlhf.checkpoint.containment import require_inside
from megatron_rlhf.utils import InputError

LATEST_FILE = "latest_checkpoint.txt"
OPTIMIZER_SHARDING_KEY = "optimizer_checkpoint_sharding"


def rng_state() -> dict:
    """This process's RNG states as JSON-able lists."""
    version, mt_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt_state), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def point_latest(run_dir: str | Path, directory: Path) -> None:
    """Point ``run_dir/latest_checkpoint.txt`` at ``directory`` (rank 0, atomically)."""
    if dist_ckpt._rank() == 0:
        tmp = Path(run_dir) / (LATEST_FILE + ".tmp")
        tmp.write_text(directory.name + "\n")
        tmp.replace(Path(run_dir) / LATEST_FILE)
    dist_ckpt._barrier()


def save_training_checkpoint(
    run_dir: str | Path,
    step: int,
    engines: dict,
    metadata: dict,
    trainer_state: dict,
    tokenizer_dir: str | Path | None = None,
    trainer_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save ``engines`` ({role: TrainEngine}) and ``trainer_state`` as ``run_dir/step_{step}``,
    then point ``run_dir/latest_checkpoint.txt`` at it (written atomically). The metadata
    records each role's optimizer checkpoint format, which a resume reads back.
    ``trainer_tensors``: the trainer state's global tensors (``dist.load_global_tensors``
    reads them back)."""
    sharded = {role: engine.sharded_state_dict() for role, engine in engines.items()}
    schedulers = {role: engine.scheduler_state() for role, engine in engines.items()}
    # The trainer state is global (steps, data positions counted in global samples): kept in
    # the metadata too, so that a run resumes at another world size or layout (Run.restore).
    metadata = {
        "trainer_state": trainer_state,
        "schedulers": schedulers,
        **metadata,
        OPTIMIZER_SHARDING_KEY: {r: e.checkpoint_sharding for r, e in engines.items()},
    }
    rank_state = {"rng": rng_state(), "schedulers": schedulers, "trainer": trainer_state}
    directory = Path(run_dir) / f"step_{step:07d}"
    try:
        dist_ckpt.save(
            directory,
            sharded,
            metadata,
            tokenizer_dir=tokenizer_dir,
            overwrite=True,
            rank_state=rank_state,
            global_tensors=trainer_tensors,
        )
    except dist_ckpt.DiskFullError as err:  # the pointer was not moved: say what it names
        raise dist_ckpt.DiskFullError(f"{err}; {_last_good(run_dir)}") from None
    point_latest(run_dir, directory)
    return directory


def _last_good(run_dir: str | Path) -> str:
    """What a run that failed to save can resume from (latest_checkpoint.txt is unchanged)."""
    latest = Path(run_dir) / LATEST_FILE
    if not latest.is_file():
        return "no checkpoint of this run was written before it; the run starts over"
    last = Path(run_dir) / latest.read_text().strip()
    return f"the last checkpoint {last} is intact: relaunch and the run resumes from it"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The directory ``latest_checkpoint.txt`` names: a ``step_N`` directory of ``run_dir``."""
    pointer = Path(run_dir) / LATEST_FILE
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not re.fullmatch(r"step_\d+", name):
        raise InputError(
            f"{pointer}: names {name!r}, not a step_N directory of this run; a checkpoint is "
            "only read from inside its run directory (fix or delete the file)"
        )
    return require_inside(Path(run_dir) / name, run_dir)


def checkpoint_in(path: str | Path) -> str:
    """``path``, or for a training run directory (one with ``latest_checkpoint.txt``) its latest
    checkpoint: a config may name ``runs/am`` instead of ``runs/am/step_0000096``."""
    latest = latest_checkpoint(path) if Path(path).is_dir() else None
    return str(latest) if latest is not None else str(path)


def resume_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint to resume ``run_dir`` from: the latest one, or, when it is missing or
    damaged, the newest complete ``step_N`` whose manifest verifies (said on stderr).
    Collective: every rank verifies its share of the files."""
    from megatron_rlhf.checkpoint import manifest

    latest = latest_checkpoint(run_dir)
    if latest is None:
        return None
    steps = sorted(
        (p for p in Path(run_dir).glob("step_*") if re.fullmatch(r"step_\d+", p.name)),
        key=lambda p: p.name,
        reverse=True,
    )
    candidates = [latest] + [p for p in steps if p.name < latest.name]
    for candidate in candidates:
        try:
            require_inside(candidate, run_dir)
            if not (candidate / dist_ckpt.METADATA_FILE).is_file():
                raise InputError(f"{candidate}: missing or incomplete")
            manifest.verify(candidate)
        except InputError as err:
            _say(f"[resume] {err}")
            continue
        if candidate != latest:
            _say(f"[resume] falling back to {candidate}, the newest checkpoint that verifies")
        return candidate
    raise InputError(
        f"{run_dir}: no checkpoint verifies (see above); restore one or start a new run "
        "in another train.output_dir"
    )


def _say(message: str) -> None:
    if dist_ckpt._rank() == 0:
        print(message, file=sys.stderr, flush=True)


def load_training_checkpoint(directory: str | Path, engines: dict) -> dict:
    """Restore ``engines`` and the RNG from ``directory``; return the trainer state. Each role's
    optimizer state is read in the format it was saved in (older checkpoints, which do not
    record it, in the engine's configured one)."""
    from megatron_rlhf.training.config import OPTIMIZER_CHECKPOINT_SHARDINGS

    if not engines:  # a rank that holds no trained model (train-ppo's rollout ranks)
        state = dist_ckpt.load_rank_state(directory)
        return state["trainer"] if state else {}
    saved = dist_ckpt.read_metadata(directory).get(OPTIMIZER_SHARDING_KEY, {})
    for role, sharding in saved.items():
        if sharding not in OPTIMIZER_CHECKPOINT_SHARDINGS:
            raise InputError(
                f"{Path(directory) / dist_ckpt.METADATA_FILE}: {OPTIMIZER_SHARDING_KEY}.{role}="
                f"{sharding!r} is not one of {', '.join(OPTIMIZER_CHECKPOINT_SHARDINGS)}; the "
                "checkpoint is damaged: resume from another step_N"
            )
    sharded = {
        role: engine.sharded_state_dict(is_loading=True, sharding=saved.get(role))
        for role, engine in engines.items()
    }
    loaded = dist_ckpt.load(directory, sharded)
    for role, engine in engines.items():
        engine.load_sharded_state_dict(loaded[role])
    state = dist_ckpt.load_rank_state(directory)
    if state is None:
        print(
            f"[resume] {directory} was saved at another world size: model and optimizer "
            "restored, RNG streams and LR-schedule position start fresh",
            file=sys.stderr,
        )
        return {}
    for role, engine in engines.items():
        engine.load_scheduler_state(state["schedulers"][role])
    set_rng_state(state["rng"])
    return state["trainer"]
