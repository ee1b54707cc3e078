"""Checkpoints: Hugging Face <-> Megatron conversion and Megatron distributed checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf.utils import InputError


def is_hf_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / "config.json").exists() and not (
        Path(directory) / "megatron_rlhf.json"
    ).exists()


def checkpoint_architecture(directory: str | Path):
    """The BloomArchitecture of an HF or megatron-rlhf checkpoint directory (no torch.dist)."""
    import json

    from megatron_rlhf.checkpoint.dist import architecture_of
    from megatron_rlhf.models.bloom.config import BloomArchitecture

    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: checkpoint directory does not exist")
    if is_hf_checkpoint(directory):
        return BloomArchitecture.from_hf(json.loads((directory / "config.json").read_text()))
    return architecture_of(directory)


def load_bloom(
    directory: str | Path,
    *,
    head: str = "lm",
    num_scalar_outputs: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **model_kwargs,
):
    """Build a BloomModel for this rank's TP/PP slice and load an HF or Megatron checkpoint.

    Megatron-Core's parallel state must be initialised. A Megatron checkpoint's head type must
    match ``head`` (an LM checkpoint can seed a scalar-head model only through HF conversion).
    """
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint.hf_io import HFReader, load_hf_into_model
    from megatron_rlhf.models.bloom import BloomModel

    arch = checkpoint_architecture(directory)
    model = BloomModel(
        arch,
        head=head,
        num_scalar_outputs=num_scalar_outputs,
        params_dtype=params_dtype,
        **model_kwargs,
    )
    if is_hf_checkpoint(directory):
        load_hf_into_model(model, HFReader(directory, head=head))
        return model
    meta = dist_ckpt.read_metadata(directory)
    if meta["head"] != head or (
        head == "scalar" and meta["num_scalar_outputs"] != num_scalar_outputs
    ):
        raise InputError(
            f"{directory}: holds a {meta['head']!r} head with {meta['num_scalar_outputs']} "
            f"scalar outputs, but a {head!r} head with {num_scalar_outputs if head == 'scalar' else 0}"
            " was asked for; use a checkpoint of the right role"
        )
    dist_ckpt.load(directory, model.sharded_state_dict())
    return model
