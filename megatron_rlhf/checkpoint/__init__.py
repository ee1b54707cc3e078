"""Checkpoints: Hugging Face <-> Megatron conversion and Megatron distributed checkpoints.

A megatron-rlhf checkpoint directory has ``megatron_rlhf.json``; its tensors are Megatron-Core
distributed-checkpoint shards, or, with ``"format": "hf"`` (``train-reward backend=deepspeed``),
one Hugging Face safetensors model read through the HF import path. Both load at any TP/PP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.utils import InputError

HF_FORMAT = "hf"
"""``megatron_rlhf.json`` ``format`` of a checkpoint whose tensors are HF safetensors."""


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


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory says about its model, read once (no tensors, no
    torch.distributed): a launch resolves every model it loads to one of these and passes it to
    :func:`load_bloom`."""

    path: str
    arch: object  # models.bloom.config.BloomArchitecture
    meta: dict | None
    """``megatron_rlhf.json`` (None for a Hugging Face directory)."""

    @property
    def is_hf(self) -> bool:
        return self.meta is None


def describe_checkpoint(directory: str | Path) -> CheckpointInfo:
    """Read an HF or megatron-rlhf checkpoint directory's architecture and metadata once."""
    from megatron_rlhf.checkpoint.dist import read_metadata
    from megatron_rlhf.models.bloom.config import BloomArchitecture

    if not Path(directory).is_dir():
        raise InputError(f"{directory}: checkpoint directory does not exist")
    if is_hf_checkpoint(directory):
        return CheckpointInfo(str(directory), checkpoint_architecture(directory), None)
    meta = read_metadata(directory)
    return CheckpointInfo(str(directory), BloomArchitecture(**meta["architecture"]), meta)


def load_bloom(
    directory: str | Path | CheckpointInfo,
    *,
    head: str = "lm",
    num_scalar_outputs: int = 1,
    params_dtype=None,
    trunk_only: bool = False,
    **model_kwargs,
):
    """Build a BloomModel for this rank's TP/PP slice and load an HF or Megatron checkpoint.

    ``directory`` may be a :class:`CheckpointInfo` already read. The model is built on
    ``model_kwargs["pg_collection"]`` (its layout's groups), or on the launch's only layout when
    none is given. A Megatron checkpoint's head type must
    match ``head``, unless ``trunk_only``: then only the trunk is loaded (a critic initialised
    from an SFT policy or from a 2-output Advantage Model keeps its fresh scalar head).
    ``params_dtype`` defaults to float32.
    """
    import torch

    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint.hf_io import HFReader, load_hf_into_model
    from megatron_rlhf.models.bloom import BloomModel

    info = directory if isinstance(directory, CheckpointInfo) else describe_checkpoint(directory)
    directory = Path(info.path)
    model = BloomModel(
        info.arch,
        head=head,
        num_scalar_outputs=num_scalar_outputs,
        params_dtype=torch.float32 if params_dtype is None else params_dtype,
        **model_kwargs,
    )
    if info.is_hf:
        load_hf_into_model(model, HFReader(directory, head=head))
        return model
    meta = info.meta
    role = ("actor" if head == "lm" else "critic") if "roles" in meta else None
    meta, prefix = role_view(meta, role, directory)
    if trunk_only:
        _load_trunk(model, directory, meta, prefix)
        return model
    hf_format = meta.get("format") == HF_FORMAT
    if meta["head"] != head or (
        head == "scalar" and meta["num_scalar_outputs"] != num_scalar_outputs
    ):
        raise InputError(
            f"{directory}: holds a {meta['head']!r} head with {meta['num_scalar_outputs']} "
            f"scalar outputs, but a {head!r} head with {num_scalar_outputs if head == 'scalar' else 0}"
            " was asked for; use a checkpoint of the right role"
        )
    if hf_format:
        load_hf_into_model(model, HFReader(directory, head=head))
        return model
    loaded = dist_ckpt.load(directory, model.sharded_state_dict(prefix=prefix))
    model.load_state_dict({name.removeprefix(prefix): value for name, value in loaded.items()})
    return model


def role_view(meta: dict, role: str | None, directory) -> tuple[dict, str]:
    """(metadata of one model, its key prefix). A train-ppo checkpoint holds the ``actor``
    (``actor.`` keys, LM head) and the ``critic`` (``critic.`` keys, scalar head); every other
    checkpoint holds one model (``role`` None)."""
    if "roles" not in meta:
        if role is not None:
            raise InputError(
                f"{directory}: holds one model, not a train-ppo actor/critic pair; drop --role"
            )
        return meta, ""
    return {**meta, **meta["roles"][role or "actor"]}, meta["roles"][role or "actor"]["prefix"]


def _load_trunk(model, directory, meta: dict, prefix: str = "") -> None:
    """Load every tensor but the head; an LM checkpoint's ``decoder.final_layernorm`` feeds a
    scalar model's ``final_layernorm``."""
    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint.hf_io import HFReader, load_hf_into_model

    if meta["head"] == "scalar" and model.head == "lm":
        raise InputError(f"{directory}: a scalar-head checkpoint cannot initialise an LM head")
    if meta.get("format") == HF_FORMAT:
        load_hf_into_model(model, HFReader(directory, head=model.head), skip_head=True)
        return
    sharded = {
        name.removeprefix(prefix): tensor
        for name, tensor in model.sharded_state_dict(prefix=prefix).items()
        if not name.removeprefix(prefix).startswith(("scalar_head.", "output_layer."))
    }
    if meta["head"] == "lm" and model.head == "scalar":
        for name, tensor in sharded.items():
            if name.startswith("final_layernorm."):
                tensor.key = "decoder." + tensor.key
    missing, unexpected = model.load_state_dict(dist_ckpt.load(directory, sharded), strict=False)
    if unexpected or any(not k.startswith(("scalar_head.", "output_layer.")) for k in missing):
        raise InputError(f"{directory}: trunk tensors missing {missing} / unexpected {unexpected}")
