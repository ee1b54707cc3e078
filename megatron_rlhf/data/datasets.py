"""Map-style datasets over preprocessed prompt, SFT and preference data.

They read the streams through Megatron-Core's ``IndexedDataset`` (memory-mapped, no tokenizer)
and return dicts of 1-D int64 tensors (float32 for log-probs); the collators in
:mod:`megatron_rlhf.data.collate` pad them into batches. Every item carries its ``index``.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import torch

from megatron_rlhf.data.indexed import read_sidecar
from megatron_rlhf.utils import InputError


class _IndexedData(torch.utils.data.Dataset):
    """The streams of one preprocessed dataset, checked against its sidecar."""

    kind = ""

    def __init__(self, prefix: str | os.PathLike):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.prefix = str(prefix)
        self.sidecar = read_sidecar(prefix)
        if self.sidecar["kind"] != self.kind:
            raise InputError(
                f"{prefix}: holds {self.sidecar['kind']} data, not {self.kind} data; "
                f"use {_CLASS_OF_KIND[self.sidecar['kind']]} or preprocess with --kind {self.kind}"
            )
        tokenizer = self.sidecar["tokenizer"]
        self.pad_id: int | None = tokenizer["pad_id"]
        self.eos_id: int | None = tokenizer["eos_id"]
        self.vocab_size: int = tokenizer["vocab_size"]
        self.streams = {
            name: _open_stream(IndexedDataset, self.prefix + stream["suffix"])
            for name, stream in self.sidecar["streams"].items()
        }
        for name, stream in self.streams.items():
            if len(stream) != self.sidecar["num_documents"]:
                raise InputError(
                    f"{self.prefix}{self.sidecar['streams'][name]['suffix']}: {len(stream)} "
                    f"documents, but the sidecar says {self.sidecar['num_documents']}; "
                    "the files come from different runs, preprocess again"
                )

    def __len__(self) -> int:
        return self.sidecar["num_documents"]

    def _ints(self, name: str, index: int) -> torch.Tensor:
        return torch.from_numpy(self.streams[name][index].astype(np.int64))


class PromptDataset(_IndexedData):
    """Prompts to generate from: ``{"index", "input_ids"}`` (prompt ids, no EOS)."""

    kind = "prompt"

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "input_ids": self._ints("tokens", index)}


class SFTDataset(_IndexedData):
    """Prompt + response sequences: ``{"index", "input_ids", "loss_mask"}``.

    ``loss_mask[t]`` is 1 where token t is a response token (EOS included), i.e. a target of the
    language-model loss (predicted from position t - 1).
    """

    kind = "sft"

    def __getitem__(self, index: int) -> dict:
        return {
            "index": index,
            "input_ids": self._ints("tokens", index),
            "loss_mask": self._ints("loss_mask", index),
        }


class PreferenceDataset(_IndexedData):
    """Preference pairs: ``{"index", "prompt_ids", "chosen_ids", "rejected_ids"}``.

    Responses exclude the prompt. With a task stream, ``task_id`` (an int indexing
    ``task_names``); with behaviour log-probs, ``chosen_logprobs`` and ``rejected_logprobs``
    (float32, shape (K,), K = ``num_behaviour_policies``).
    """

    kind = "preference"

    def __init__(self, prefix: str | os.PathLike):
        super().__init__(prefix)
        self.task_names: list[str] | None = self.sidecar.get("tasks")
        self.num_behaviour_policies: int = self.sidecar.get("num_behaviour_policies", 0)

    def __getitem__(self, index: int) -> dict:
        item = {
            "index": index,
            "prompt_ids": self._ints("prompt", index),
            "chosen_ids": self._ints("chosen", index),
            "rejected_ids": self._ints("rejected", index),
        }
        if "task" in self.streams:
            item["task_id"] = int(self.streams["task"][index][0])
        if "chosen_logprobs" in self.streams:
            for name in ("chosen_logprobs", "rejected_logprobs"):
                item[name] = torch.from_numpy(self.streams[name][index].copy())
        return item


def stream_lengths(examples, stream: str, indices=None) -> np.ndarray:
    """Tokens of ``stream`` in each example of ``examples`` (one of these datasets or a
    ``Subset`` of one) at ``indices`` (None: all), read from the index, not the data."""
    dataset = getattr(examples, "dataset", examples)
    picked = np.asarray(getattr(examples, "indices", range(len(dataset))), dtype=np.int64)
    if indices is not None:
        picked = picked[np.asarray(indices, dtype=np.int64)]
    return dataset.streams[stream].sequence_lengths.astype(np.int64)[picked]


_CLASS_OF_KIND = {"prompt": "PromptDataset", "sft": "SFTDataset", "preference": "PreferenceDataset"}


def _open_stream(indexed_dataset, path_prefix: str):
    """Megatron-Core's ``IndexedDataset`` of ``path_prefix``; a missing or damaged ``.bin`` /
    ``.idx`` is an error naming the file."""
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(path_prefix + suffix):
            raise InputError(
                f"{path_prefix}{suffix}: missing; the dataset is incomplete, preprocess it again"
            )
    try:
        return indexed_dataset(path_prefix)
    except (AssertionError, ValueError, OSError, struct.error) as err:
        raise InputError(
            f"{path_prefix}.idx: unreadable ({type(err).__name__}: {err}); the index is "
            "truncated or damaged, preprocess the dataset again"
        ) from None
