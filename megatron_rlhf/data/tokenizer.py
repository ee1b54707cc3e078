"""Tokenizers: load any local Hugging Face tokenizer, or train a tiny BLOOM-like one offline.

The tiny tokenizer is what the tests and the demo use, since no tokenizer can be downloaded here.
It is a byte-level BPE with BLOOM's special tokens at BLOOM's ids (``<unk>`` 0, ``<s>`` 1,
``</s>`` 2, ``<pad>`` 3), left padding like BLOOM, and no post-processor: encoding a text never
adds special tokens, so ``tokenizer(text)["input_ids"]`` and ``tokenizer.encode(text)`` agree.
It is saved as a normal Hugging Face tokenizer directory (``tokenizer.json`` plus
``tokenizer_config.json``) that ``transformers.AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from megatron_rlhf.utils import InputError, is_rank0

# BLOOM's special tokens, in id order.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")


def train_tiny_tokenizer(
    texts: Iterable[str] | None,
    save_dir: str | os.PathLike,
    vocab_size: int = 1000,
    *,
    files: Iterable[str | os.PathLike] | None = None,
    min_frequency: int = 2,
    model_max_length: int = 2048,
) -> Path:
    """Train a byte-level BPE tokenizer on local text and save it as a HF tokenizer directory.

    ``texts`` is an iterable of strings, ``files`` a list of plain-text files (one or both); with
    neither, the built-in English corpus of :mod:`megatron_rlhf.data.synthetic` is used. Nothing
    is downloaded. Returns ``save_dir``. Every byte has a token, so no text maps to ``<unk>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least 260 tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if files is not None:
        tokenizer.train([str(path) for path in files], trainer)
    else:
        if texts is None:
            from megatron_rlhf.data.synthetic import english_sentences

            texts = english_sentences(20_000, seed=0)
        tokenizer.train_from_iterator(texts, trainer)

    unk, bos, eos, pad = SPECIAL_TOKENS
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token=unk,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        padding_side="left",
        model_max_length=model_max_length,
    )
    save_dir = Path(save_dir)
    wrapped.save_pretrained(save_dir)
    _portable_config(save_dir / "tokenizer_config.json")
    return save_dir


def _portable_config(config_path: Path) -> None:
    """Name the generic fast tokenizer class, which transformers 4.x and 5.x both load."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def load_tokenizer(tokenizer_dir: str | os.PathLike, flag: str = "--tokenizer"):
    """Load a local Hugging Face tokenizer directory (never downloads); ``flag``: the option or
    key that named it, for the error."""
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise InputError(
            f"{flag} {tokenizer_dir}: no such directory; give a local Hugging Face "
            "tokenizer directory (e.g. one written by save_pretrained or train_tiny_tokenizer)"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # the tokenizers library raises bare Exceptions on a bad file
        raise InputError(
            f"{flag} {tokenizer_dir}: cannot load a Hugging Face tokenizer ({err})"
        ) from None


def tokenizer_info(tokenizer, tokenizer_dir: str | os.PathLike | None = None) -> dict:
    """What the sidecar records about the tokenizer: where it is, vocab size, special ids.

    ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens), the bound every id
    stays below; ``pad_id`` falls back to ``eos_id`` for tokenizers without a pad token.
    """
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return {
        "path": str(Path(tokenizer_dir).resolve()) if tokenizer_dir is not None else None,
        "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "eos_id": eos_id,
        "pad_id": pad_id,
        "bos_id": tokenizer.bos_token_id,
        "fingerprint": tokenizer_fingerprint(tokenizer),
    }


def tokenizer_fingerprint(tokenizer) -> str:
    """``sha256:<16 hex>`` of the vocabulary (every token and its id, added tokens included)
    and the special ids: equal exactly when two tokenizers map text to the same ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    special = [
        getattr(tokenizer, f"{name}_token_id", None) for name in ("unk", "bos", "eos", "pad")
    ]
    payload = json.dumps([vocab, special], ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def print_rank0(message: str) -> None:
    if is_rank0():
        print(message, file=sys.stderr, flush=True)


def check_same_tokenizer(data: dict | None, data_what: str, model: dict | None, model_what: str):
    """Refuse data tokenized with another tokenizer than the model's.

    ``data`` is a dataset sidecar's ``tokenizer`` entry, ``model`` a checkpoint's (see
    ``checkpoint.dist.tokenizer_of``); either may be None or lack a fingerprint (made before
    fingerprints were recorded): then the check is skipped, with a warning for the data."""
    data_fp = (data or {}).get("fingerprint")
    model_fp = (model or {}).get("fingerprint")
    if model_fp is None:
        return
    if data_fp is None:
        print_rank0(
            f"[tokenizer] warning: {data_what} records no tokenizer fingerprint (preprocessed "
            f"before they were recorded); cannot check that it matches {model_what}"
        )
        return
    if data_fp != model_fp:
        data_name = data.get("path") or data.get("name_or_path") or "an unnamed tokenizer"
        raise InputError(
            f"{data_what} uses tokenizer {data_name} ({data_fp}) but {model_what} uses "
            f"{model.get('name') or 'another tokenizer'} ({model_fp}); preprocess the data with "
            "the model's tokenizer (or give that tokenizer)"
        )
