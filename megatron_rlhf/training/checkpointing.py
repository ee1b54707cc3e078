"""Training checkpoints that resume exactly: model, optimizer, LR schedule, RNG, data position.

A training checkpoint is also a model checkpoint: its model tensors carry the model's own keys,
so ``megatron_rlhf.checkpoint.load_bloom`` reads it at any TP/PP layout. Optimizer state is
saved sharded like the model. RNG states (torch, numpy, python) are saved per rank; resuming at
another layout restores everything except those (and says so).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

from megatron_rlhf.checkpoint import dist as dist_ckpt

LATEST_FILE = "latest_checkpoint.txt"


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_training_checkpoint(
    run_dir: str | Path,
    step: int,
    engines: dict,
    metadata: dict,
    trainer_state: dict,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Save ``engines`` ({role: TrainEngine}) and ``trainer_state`` as ``run_dir/step_{step}``,
    then point ``run_dir/latest_checkpoint.txt`` at it (written atomically)."""
    sharded = {role: engine.sharded_state_dict() for role, engine in engines.items()}
    rank_state = {
        "rng": rng_state(),
        "schedulers": {role: engine.scheduler_state() for role, engine in engines.items()},
        "trainer": trainer_state,
    }
    directory = Path(run_dir) / f"step_{step:07d}"
    dist_ckpt.save(
        directory,
        sharded,
        metadata,
        tokenizer_dir=tokenizer_dir,
        overwrite=True,
        rank_state=rank_state,
    )
    if dist_ckpt._rank() == 0:
        tmp = Path(run_dir) / (LATEST_FILE + ".tmp")
        tmp.write_text(directory.name + "\n")
        tmp.replace(Path(run_dir) / LATEST_FILE)
    dist_ckpt._barrier()
    return directory


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / LATEST_FILE
    if not pointer.exists():
        return None
    return Path(run_dir) / pointer.read_text().strip()


def load_training_checkpoint(directory: str | Path, engines: dict) -> dict:
    """Restore ``engines`` and the RNG from ``directory``; return the trainer state."""
    sharded = {role: engine.sharded_state_dict(is_loading=True) for role, engine in engines.items()}
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
