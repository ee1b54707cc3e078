"""Checkpoint paths stay inside their run: what a path resolves to (realpath) is checked, so a
``step_N`` that is a symlink to another run's checkpoint, or a shard that is a symlink to a file
elsewhere, is refused instead of followed.

A checkpoint directory given on a command line may itself be a symlink (the user chose it);
what is checked is that nothing *inside* it, and no ``step_N`` of a run directory, leads out.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_rlhf.utils import InputError


def require_inside(path: str | Path, root: str | Path) -> Path:
    """``path``, if its realpath lies inside ``root``'s realpath; else an InputError."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise InputError(
            f"{path}: resolves to {real}, outside {root}; a checkpoint is only read from inside "
            "its run directory and symlinks out of it are refused; copy the checkpoint in (or "
            "point --load at it directly)"
        )
    return Path(path)


def require_contained(directory: str | Path) -> None:
    """Every file and folder under ``directory`` resolves inside it (no symlink leads out)."""
    for parent, folders, files in os.walk(directory):
        for name in folders + files:
            require_inside(Path(parent) / name, directory)
