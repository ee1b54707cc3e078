"""Read and write Hugging Face BLOOM checkpoints one tensor at a time.

:class:`HFReader` opens ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` lazily (memory-mapped): a process reads only the tensors, and
within them only the TP slice, it needs, so a 176B conversion launched over tp*pp processes
never holds the whole model in one process. :func:`load_hf_into_model` copies this rank's slice
of every tensor into a :class:`~megatron_rlhf.models.bloom.BloomModel`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_rlhf.checkpoint.hf_names import canonical_hf_name, hf_names, mapping_for
from megatron_rlhf.models.bloom.config import BloomArchitecture
from megatron_rlhf.utils import InputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_LM_HEAD = "lm_head.weight"


class HFReader:
    """Lazy access to the tensors of a local Hugging Face BLOOM checkpoint directory."""

    def __init__(self, directory: str | Path, head: str = "lm"):
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.exists():
            raise InputError(f"{config_path}: missing; --load must be a Hugging Face model dir")
        self.hf_config = json.loads(config_path.read_text())
        if self.hf_config.get("model_type") != "bloom":
            raise InputError(
                f"{config_path}: model_type is {self.hf_config.get('model_type')!r}, "
                "expected 'bloom'"
            )
        self.arch = BloomArchitecture.from_hf(self.hf_config)
        self.head = head
        self._file_of = self._index()
        self._handles: dict[Path, object] = {}
        self._check_names()
        self._check_vocab_rows()

    def _index(self) -> dict[str, Path]:
        single, index = self.directory / SINGLE_FILE, self.directory / INDEX_FILE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {name: self.directory / file for name, file in weight_map.items()}
            for file in sorted(set(files.values())):
                if not file.exists():
                    raise InputError(f"{index}: lists shard {file.name}, which is missing")
            return {canonical_hf_name(name): file for name, file in files.items()}
        if single.exists():
            with safe_open(single, framework="pt") as handle:
                return {canonical_hf_name(name): single for name in handle.keys()}
        raise InputError(
            f"{self.directory}: no {SINGLE_FILE} or {INDEX_FILE}; re-save the model with "
            "`model.save_pretrained(dir, safe_serialization=True)`"
        )

    def _check_names(self) -> None:
        expected = set(hf_names(self.arch.num_layers, self.head))
        if self.head == "scalar":  # a trunk exported without a head is a valid starting point
            expected -= {"score.weight", "score.bias"}
        present = set(self._file_of)
        missing = sorted(expected - present)
        unknown = sorted(present - expected - {TIED_LM_HEAD, "score.weight", "score.bias"})
        if missing:
            raise InputError(f"{self.directory}: missing tensors {missing[:8]} ({len(missing)})")
        if unknown:
            raise InputError(f"{self.directory}: unknown tensors {unknown[:8]} ({len(unknown)})")

    def _check_vocab_rows(self) -> None:
        """The embedding must have exactly config.json's vocab_size rows (rows are zero-padded
        per TP rank when loading, so a shorter embedding would otherwise load silently)."""
        shape = tuple(self._view("word_embeddings.weight").get_shape())
        expected = (self.arch.vocab_size, self.arch.hidden_size)
        if shape != expected:
            raise InputError(
                f"{self.directory}: word_embeddings.weight has shape {shape} but config.json "
                f"gives vocab_size x hidden_size = {expected}; weights and config disagree"
            )

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _view(self, name: str):
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        handle = self._handles[file]
        return handle.get_slice(name if name in handle.keys() else "transformer." + name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor ``name`` (clipped to its length)."""
        return self._view(name)[start:stop]

    def get_slice(self, name: str, split_dim: int | None, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank`` of ``size`` equal slices of tensor ``name`` along ``split_dim``."""
        view = self._view(name)
        shape = view.get_shape()
        if split_dim is None or size == 1:
            return view[:]
        step = shape[split_dim] // size
        index = [slice(None)] * len(shape)
        index[split_dim] = slice(rank * step, (rank + 1) * step)
        return view[tuple(index)]

    def tokenizer_files(self) -> list[Path]:
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
        return [self.directory / n for n in names if (self.directory / n).exists()]


def load_hf_into_model(model, reader: HFReader, skip_head: bool = False) -> None:
    """Copy this rank's slice of every HF tensor into ``model`` (any TP/PP layout);
    ``skip_head``: leave the scalar head as initialised (a critic from an AM's trunk)."""
    tp_rank, tp = model.pg_collection.tp.rank(), model.pg_collection.tp.size()
    layer_offset = stage_layer_offset(model)
    for name, param in model.named_parameters():
        if name == "output_layer.weight":  # tied to the embedding on the last PP stage
            name = "embedding.word_embeddings.weight"
        mapping = mapping_for(name, model.head, layer_offset)
        if mapping.hf_name.startswith("score.") and (skip_head or not reader.has(mapping.hf_name)):
            continue  # a fresh scalar head on a converted trunk keeps its initialisation
        if mapping.is_vocab:
            tensor = _vocab_rows(reader, mapping.hf_name, param.shape[0], tp_rank)
        else:
            tensor = reader.get_slice(mapping.hf_name, mapping.split_dim, tp_rank, tp)
        if tuple(tensor.shape) != tuple(param.shape):
            raise InputError(
                f"{reader.directory}: {mapping.hf_name} slice has shape {tuple(tensor.shape)}, "
                f"model expects {tuple(param.shape)} for {name}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))


def _vocab_rows(reader: HFReader, hf_name: str, rows_per_rank: int, tp_rank: int):
    """This rank's rows of the (padded) embedding; rows past the real vocab are zero."""
    start = tp_rank * rows_per_rank
    real = reader.get_rows(hf_name, start, start + rows_per_rank)  # (<= rows_per_rank, H)
    out = torch.zeros(rows_per_rank, real.shape[1], dtype=real.dtype)
    out[: real.shape[0]] = real
    return out


def stage_layer_offset(model) -> int:
    """Global index of the first decoder layer of ``model``'s pipeline stage (layers split
    evenly over its PP group)."""
    pp_rank, pp = model.pg_collection.pp.rank(), model.pg_collection.pp.size()
    return pp_rank * (model.arch.num_layers // pp)


def hf_reward_outputs(directory: str | Path, key: str) -> int:
    """How many scalar outputs the reward model in a Hugging Face directory has: it must be a
    ``BloomForSequenceClassification`` with its ``score`` weights (an RM: 1 label, its logit is
    r; an AM exported by ``megatron-to-hf``: 2, r and e_tau). ``key`` names the flag or config
    key in errors."""
    config = json.loads((Path(directory) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if "BloomForSequenceClassification" not in architectures:
        raise InputError(
            f"{key}: {directory} is a Hugging Face {', '.join(architectures) or 'model'}, not a "
            "reward model (BloomForSequenceClassification); train one with `train-reward`"
        )
    if not HFReader(directory, head="scalar").has("score.weight"):
        raise InputError(f"{key}: {directory} holds no score.weight; re-save the reward model")
    return len(config.get("id2label") or {}) or config.get("num_labels", 2)
