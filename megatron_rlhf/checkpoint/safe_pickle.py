"""Torch distributed-checkpoint ``.metadata`` read without running any code from it.

Upstream (torch 2.13 ``FileSystemReader.read_metadata``) reads ``.metadata`` with a plain
``pickle.load``: a tampered file whose manifest entry was rewritten to match runs its payload on
load. Here it is read through an ``Unpickler`` whose ``find_class`` admits only what torch's
distributed-checkpoint metadata is made of (the dataclasses of
``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, the save-plan dataclasses Megatron
stores in it, ``torch.Size`` and torch's dtype / layout / memory-format constants); any other global is refused with the file's name before it is
looked up, so nothing in the file is ever called. :func:`install` makes every
``FileSystemReader`` (Megatron's cached reader included) read this way.

Megatron's ``common.pt`` and sharded-object files go through ``torch.load``, whose default is
``weights_only=True`` in torch >= 2.6; :func:`check_weights_only` reads ``common.pt`` that way
first so a refusal names the file, and :func:`require_weights_only_default` refuses to load while
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns that default off. DeepSpeed's checkpoint engine loads
its ``*_states.pt`` with ``weights_only=False``; ``train-reward backend=deepspeed`` resumes
through :func:`deepspeed_loader` instead (weights only, plus the three DeepSpeed classes those
files hold).
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem

from megatron_rlhf.utils import InputError

_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED_CLASSES = frozenset(
    {
        (_METADATA, "Metadata"),
        (_METADATA, "TensorStorageMetadata"),
        (_METADATA, "BytesStorageMetadata"),
        (_METADATA, "ChunkStorageMetadata"),
        (_METADATA, "TensorProperties"),
        (_METADATA, "StorageMeta"),
        (_METADATA, "MetadataIndex"),
        (_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # Megatron's save planner keeps its plan in Metadata.planner_data
        ("torch.distributed.checkpoint.planner", "SavePlan"),
        ("torch.distributed.checkpoint.planner", "WriteItem"),
        ("torch.distributed.checkpoint.planner", "WriteItemType"),
        ("torch.distributed.checkpoint.planner", "TensorWriteData"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a dict lookup: layout name -> torch.layout
    }
)
"""(module, name) of every global a ``.metadata`` written through Megatron-Core 0.16.1 on torch
2.13 refers to (read off train-reward and train-ppo checkpoints)."""

_CONSTANT_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(InputError, pickle.UnpicklingError):
    """A checkpoint pickle refers to something torch's checkpoint metadata never holds."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch-dcp metadata; any other global is refused, naming ``source``."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _CONSTANT_TYPES):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refers to {module}.{name}, which torch's distributed-checkpoint "
            "metadata never contains; refusing to unpickle it (nothing from it was run). The "
            "checkpoint was altered or is not a torch checkpoint: re-save it or use another"
        )


def load_metadata(path: str | Path):
    """The ``Metadata`` pickled in ``path``, read through :class:`MetadataUnpickler`."""
    with open(path, "rb") as handle:
        return MetadataUnpickler(handle, str(path)).load()


def _read_metadata(self, *args, **kwargs):
    """``FileSystemReader.read_metadata`` with the restricted unpickler (torch 2.13 body)."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = MetadataUnpickler(stream, str(path)).load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def install() -> None:
    """Make every torch ``FileSystemReader`` read ``.metadata`` through the restricted
    unpickler (idempotent)."""
    filesystem.FileSystemReader.read_metadata = _read_metadata


DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The non-tensor classes in DeepSpeed 0.19.8's ZeRO-1/2/3 ``*_states.pt`` (fp32 on the CPU)."""


def weights_only_load(path, map_location=None, allowed: tuple[str, ...] = ()):
    """``torch.load(path, weights_only=True)`` admitting also the classes named in ``allowed``
    (``module.Class``); anything else is refused with the file's name, nothing from it runs."""
    import importlib

    objects = []
    for name in allowed:
        module, _, attribute = name.rpartition(".")
        objects.append(getattr(importlib.import_module(module), attribute))
    try:
        with torch.serialization.safe_globals(objects):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = found.group(1) if found else "an object that is not tensors or plain data"
        raise UnsafeCheckpointError(
            f"{path}: refers to {what}, which a checkpoint's tensors and plain data never "
            "contain; refusing to unpickle it (nothing from it was run). The checkpoint was "
            "altered or is not ours: re-save it or use another"
        ) from None


def deepspeed_loader(path, map_location=None):
    """DeepSpeed's ``checkpoint_engine.load`` (upstream: ``weights_only=False``) made safe."""
    return weights_only_load(path, map_location, DEEPSPEED_GLOBALS)


def check_weights_only(path: str | Path) -> None:
    """Refuse ``path`` (e.g. Megatron's ``common.pt``) unless ``torch.load(weights_only=True)``
    reads it: the error names the file and the global it refers to."""
    weights_only_load(path, map_location="cpu")


def require_weights_only_default() -> None:
    """Refuse to load checkpoints while ``torch.load`` defaults to full unpickling."""
    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        raise InputError(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch.load would unpickle arbitrary code "
            "from common.pt; unset it to load checkpoints"
        )
