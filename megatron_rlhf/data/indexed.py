"""Writing prompt, SFT and preference data as Megatron-Core IndexedDataset streams, atomically.

On-disk layout for an output prefix ``P`` (every stream is a Megatron-Core ``P<suffix>.bin`` /
``P<suffix>.idx`` pair written by ``IndexedDatasetBuilder``, one document = one sequence per
example, so ``IndexedDataset(P<suffix>)[i]`` is example i):

=========== =========================== ========= ============================================
kind        stream (suffix)             dtype     document i holds
=========== =========================== ========= ============================================
prompt      ``P``                       tokens    the prompt's ids (no EOS)
sft         ``P``                       tokens    prompt ids + response ids (+ EOS)
sft         ``P_loss_mask``             uint8     0 per prompt token, 1 per response token/EOS
preference  ``P_prompt``                tokens    the shared prompt's ids
preference  ``P_chosen``/``P_rejected`` tokens    response ids only (+ EOS)
preference  ``P_task`` (optional)       int32     one value: index into the sidecar's ``tasks``
preference  ``P_chosen_logprobs``,      float32   K values: the response's summed log-prob under
            ``P_rejected_logprobs``                each of the K behaviour policies (optional)
=========== =========================== ========= ============================================

"tokens" is uint16 when the tokenizer has fewer than 65,500 tokens and int32 otherwise (BLOOM),
Megatron-Core's own rule (``DType.optimal_dtype``). The JSON sidecar ``P.json`` records the kind,
tokenizer (path, vocab size, eos/pad ids), streams with dtypes, counts, truncation counts and
skipped lines; it is written last and is the mark of a complete output.

Atomicity: streams are written under hidden temporary names beside ``P`` and renamed onto the
final names only once every stream is complete (an old sidecar at ``P`` is removed first); any
error removes the temporary files, so a failed run never leaves a ``.bin``/``.idx`` set that looks
complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from megatron_rlhf.data.records import KINDS, BadRecord, Example
from megatron_rlhf.utils import InputError, write_json

SIDECAR_FORMAT = "megatron_rlhf.indexed_data/1"

# kind -> {stream name: suffix} of the streams every example writes.
REQUIRED_STREAMS = {
    "prompt": {"tokens": ""},
    "sft": {"tokens": "", "loss_mask": "_loss_mask"},
    "preference": {"prompt": "_prompt", "chosen": "_chosen", "rejected": "_rejected"},
}
OPTIONAL_STREAMS = {
    "task": "_task",
    "chosen_logprobs": "_chosen_logprobs",
    "rejected_logprobs": "_rejected_logprobs",
}


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 below 65,500 tokens, int32 above: Megatron-Core's ``DType.optimal_dtype``."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def sidecar_path(prefix: str | os.PathLike) -> Path:
    """The JSON sidecar of an output prefix: ``PREFIX.json``."""
    return Path(f"{prefix}.json")


def read_sidecar(prefix: str | os.PathLike) -> dict:
    """Read and check the sidecar of a preprocessed dataset."""
    path = sidecar_path(prefix)
    if not path.exists():
        raise InputError(
            f"{path}: no sidecar, so {prefix} is not a finished preprocessed dataset; "
            "run tools/preprocess_data.py (or the write_*_dataset functions) to create it"
        )
    sidecar = json.loads(path.read_text(encoding="utf-8"))
    if sidecar.get("format") != SIDECAR_FORMAT:
        raise InputError(f"{path}: format {sidecar.get('format')!r}, expected {SIDECAR_FORMAT!r}")
    return sidecar


class ExampleWriter:
    """Append :class:`Example` s of one kind to a set of streams; ``commit`` makes them final.

    The presence of the optional preference fields (task, behaviour log-probs and their count K)
    is fixed by the first example; a later example that disagrees raises :class:`BadRecord`.
    Use as a context manager: leaving the block with an exception removes every temporary file.
    """

    def __init__(self, prefix: str | os.PathLike, kind: str, tokenizer: dict):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.prefix = str(prefix)
        self.kind = kind
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer["vocab_size"])
        self.token_dtype = token_dtype(self.vocab_size)
        final = Path(self.prefix)
        final.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_prefix = str(final.with_name(f".{final.name}.tmp-{os.getpid()}"))
        self._builders: dict[str, object] = {}
        self._suffixes: dict[str, str] = {}
        self._values: dict[str, int] = {}
        self.num_documents = 0
        self.tasks: dict[str, int] = {}
        self.num_policies: int | None = None
        self._has_task: bool | None = None
        for name, suffix in REQUIRED_STREAMS[kind].items():
            dtype = np.uint8 if name == "loss_mask" else self.token_dtype
            self._open_stream(name, suffix, dtype)

    def __enter__(self) -> ExampleWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def add(self, example: Example) -> None:
        """Write one example (raises :class:`BadRecord` if it is inconsistent or empty)."""
        prompt = np.asarray(example.prompt_ids, dtype=np.int64)
        responses = [np.asarray(ids, dtype=np.int64) for ids in example.response_ids]
        self._check(prompt, responses)
        if self.kind == "preference":
            self._check_optional(example)
        if self.kind == "prompt":
            self._write("tokens", prompt)
        elif self.kind == "sft":
            (response,) = responses
            self._write("tokens", np.concatenate([prompt, response]))
            mask = np.zeros(prompt.size + response.size, dtype=np.uint8)
            mask[prompt.size :] = 1
            self._write("loss_mask", mask)
        else:
            self._write("prompt", prompt)
            self._write("chosen", responses[0])
            self._write("rejected", responses[1])
            if self._has_task:
                self._write("task", [self.tasks.setdefault(example.task, len(self.tasks))])
            if self.num_policies is not None:
                self._write("chosen_logprobs", example.logprobs[0])
                self._write("rejected_logprobs", example.logprobs[1])
        self.num_documents += 1

    def commit(self, **extra) -> dict:
        """Finalize every stream, move them onto their final names, then write the sidecar."""
        if self.num_documents == 0:
            raise InputError(f"{self.prefix}: no examples to write (every input line was skipped)")
        for name, builder in self._builders.items():
            builder.finalize(self._tmp_prefix + self._suffixes[name] + ".idx")
        old = sidecar_path(self.prefix)
        stale = _streams_of_old_output(old)
        old.unlink(missing_ok=True)
        for suffix in stale - set(self._suffixes.values()):
            for ext in (".bin", ".idx"):
                Path(self.prefix + suffix + ext).unlink(missing_ok=True)
        for suffix in self._suffixes.values():
            for ext in (".bin", ".idx"):
                os.replace(self._tmp_prefix + suffix + ext, self.prefix + suffix + ext)
        sidecar = self._sidecar(extra)
        write_json(sidecar_path(self.prefix), sidecar)
        return sidecar

    def abort(self) -> None:
        """Close and remove every temporary file."""
        for name, builder in self._builders.items():
            builder.data_file.close()
            for ext in (".bin", ".idx"):
                Path(self._tmp_prefix + self._suffixes[name] + ext).unlink(missing_ok=True)

    def _open_stream(self, name: str, suffix: str, dtype) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self._builders[name] = IndexedDatasetBuilder(self._tmp_prefix + suffix + ".bin", dtype)
        self._suffixes[name] = suffix
        self._values[name] = 0

    def _write(self, name: str, values: Sequence) -> None:
        builder = self._builders[name]
        array = np.asarray(values, dtype=builder.dtype)
        builder.add_document(array, [array.size])
        self._values[name] += array.size

    def _check(self, prompt: np.ndarray, responses: list[np.ndarray]) -> None:
        expected = {"prompt": 0, "sft": 1, "preference": 2}[self.kind]
        if len(responses) != expected:
            raise BadRecord(f"{self.kind} examples have {expected} responses, got {len(responses)}")
        if any(response.size == 0 for response in responses):
            raise BadRecord("empty response")
        if self.kind != "sft" and prompt.size == 0:
            raise BadRecord(f"empty prompt ({self.kind} data needs at least one prompt token)")
        for ids in (prompt, *responses):
            if ids.ndim != 1:
                raise BadRecord(f"token ids must be a flat list, got shape {ids.shape}")
            if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise BadRecord(f"token id out of range [0, {self.vocab_size})")

    def _check_optional(self, example: Example) -> None:
        has_task = example.task is not None
        num_policies = None if example.logprobs is None else len(example.logprobs[0])
        if self.num_documents == 0 and self._has_task is None:
            self._has_task = has_task
            if has_task:
                self._open_stream("task", OPTIONAL_STREAMS["task"], np.int32)
            if num_policies is not None:
                self.num_policies = num_policies
                for name in ("chosen_logprobs", "rejected_logprobs"):
                    self._open_stream(name, OPTIONAL_STREAMS[name], np.float32)
        if has_task != self._has_task:
            raise BadRecord(
                "task field present in some records and absent in others; "
                f"earlier records {'have' if self._has_task else 'lack'} it"
            )
        if num_policies != self.num_policies:
            raise BadRecord(
                f"{num_policies or 0} behaviour log-probs per response, but earlier records "
                f"have {self.num_policies or 0}; every record needs the same K"
            )

    def _sidecar(self, extra: dict) -> dict:
        streams = {
            name: {
                "suffix": self._suffixes[name],
                "dtype": np.dtype(self._builders[name].dtype).name,
                "num_values": self._values[name],
            }
            for name in self._builders
        }
        sidecar = {
            "format": SIDECAR_FORMAT,
            "kind": self.kind,
            "tokenizer": self.tokenizer,
            "num_documents": self.num_documents,
            "streams": streams,
        }
        if self.kind == "preference":
            sidecar["tasks"] = list(self.tasks) if self._has_task else None
            sidecar["num_behaviour_policies"] = self.num_policies or 0
        sidecar.update(extra)
        return sidecar


def _streams_of_old_output(old_sidecar: Path) -> set[str]:
    if not old_sidecar.exists():
        return set()
    try:
        streams = json.loads(old_sidecar.read_text(encoding="utf-8")).get("streams", {})
        return {str(stream["suffix"]) for stream in streams.values()}
    except (ValueError, AttributeError, KeyError, TypeError):
        return set()


def resolve_tokenizer_info(
    tokenizer_dir: str | os.PathLike | None,
    vocab_size: int | None,
    eos_id: int | None,
    pad_id: int | None,
) -> dict:
    """Tokenizer facts for the sidecar, from a tokenizer directory and/or explicit values."""
    if tokenizer_dir is not None:
        from megatron_rlhf.data.tokenizer import load_tokenizer, tokenizer_info

        info = tokenizer_info(load_tokenizer(tokenizer_dir), tokenizer_dir)
    else:
        if vocab_size is None:
            raise ValueError("give tokenizer_dir or vocab_size (it decides the token dtype)")
        info = {
            "path": None,
            "name_or_path": None,
            "class": None,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "pad_id": pad_id if pad_id is not None else eos_id,
            "bos_id": None,
        }
    for key, value in (("vocab_size", vocab_size), ("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None:
            info[key] = int(value)
    return info


def write_prompt_dataset(
    prefix: str | os.PathLike,
    prompts: Iterable[Sequence[int]],
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    metadata: dict | None = None,
) -> dict:
    """Write prompt token ids (no EOS is added) as a ``prompt`` dataset; return the sidecar.

    Tokenizer facts come from ``tokenizer_dir`` and/or the explicit ``vocab_size``/``eos_id``/
    ``pad_id`` (explicit values win). ``metadata`` is stored in the sidecar under ``metadata``.
    """
    examples = (Example(prompt_ids=list(ids)) for ids in prompts)
    info = resolve_tokenizer_info(tokenizer_dir, vocab_size, eos_id, pad_id)
    return _write_examples(prefix, "prompt", examples, info, metadata)


def write_sft_dataset(
    prefix: str | os.PathLike,
    examples: Iterable[tuple[Sequence[int], Sequence[int]]],
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    eos_id: int | None = None,
    pad_id: int | None = None,
    vocab_size: int | None = None,
    append_eos: bool = True,
    metadata: dict | None = None,
) -> dict:
    """Write ``(prompt_ids, response_ids)`` pairs as an ``sft`` dataset; return the sidecar.

    With ``append_eos`` (the default) the EOS id is appended to every response that does not
    already end with it, so responses generated with or without their stop token both end in
    exactly one EOS; with ``append_eos=False`` responses are written as given. The loss mask is
    1 on every response token (EOS included) and 0 on the prompt. Empty responses are refused.
    """
    info = resolve_tokenizer_info(tokenizer_dir, vocab_size, eos_id, pad_id)
    eos = _eos_for(info, append_eos)

    def to_example(prompt_ids, response_ids) -> Example:
        response = _ending_in(eos, response_ids) if append_eos else list(response_ids)
        return Example(prompt_ids=list(prompt_ids), response_ids=(response,))

    stream = (to_example(prompt, response) for prompt, response in examples)
    return _write_examples(prefix, "sft", stream, info, metadata, append_eos=append_eos)


def write_preference_dataset(
    prefix: str | os.PathLike,
    examples: Iterable[Example],
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    append_eos: bool = True,
    metadata: dict | None = None,
) -> dict:
    """Write :class:`Example` s with ``response_ids=(chosen, rejected)`` (optional ``task`` and
    ``logprobs``) as a ``preference`` dataset; return the sidecar. EOS as in
    :func:`write_sft_dataset`: appended to each response not already ending with it.
    """
    info = resolve_tokenizer_info(tokenizer_dir, vocab_size, eos_id, pad_id)
    eos = _eos_for(info, append_eos)

    def with_eos(example: Example) -> Example:
        responses = tuple(
            _ending_in(eos, ids) if append_eos else list(ids) for ids in example.response_ids
        )
        return Example(list(example.prompt_ids), responses, example.task, example.logprobs)

    stream = (with_eos(example) for example in examples)
    return _write_examples(prefix, "preference", stream, info, metadata, append_eos=append_eos)


def _eos_for(info: dict, append_eos: bool) -> int | None:
    if append_eos and info["eos_id"] is None:
        raise ValueError("append_eos=True needs an eos_id (give eos_id or a tokenizer with one)")
    return info["eos_id"]


def _ending_in(eos: int, ids: Sequence[int]) -> list[int]:
    """``ids`` with ``eos`` appended unless it already ends with it (empty stays empty)."""
    ids = list(ids)
    if ids and ids[-1] != eos:
        ids.append(eos)
    return ids


def _write_examples(prefix, kind, examples, tokenizer, metadata, **extra) -> dict:
    with ExampleWriter(prefix, kind, tokenizer) as writer:
        for position, example in enumerate(examples):
            try:
                writer.add(example)
            except BadRecord as err:
                raise ValueError(f"{prefix}: example {position}: {err}") from None
        return writer.commit(**extra, metadata=metadata or {})
