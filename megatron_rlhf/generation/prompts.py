"""What a command that generates from a JSONL of prompts needs (``generate``, ``eval-policy``,
and ``score`` reading prompts): the batching, length and sampling flags and their checks, the
prompts read and tokenized with errors naming their line, left padding, and the engine that
generates (``generation/rollout_engines.py``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from megatron_rlhf.utils import InputError, read_jsonl


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """Batching, length and sampling flags shared by ``generate`` and ``eval-policy``."""
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--max-prompt-length",
        type=int,
        help="longest prompt in tokens (default: the model's sequence length - max-new-tokens)",
    )
    parser.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="keep the last --max-prompt-length tokens of a longer prompt instead of an error",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per forward batch")
    parser.add_argument(
        "--decode-batch",
        type=int,
        help="decode slots (continuous batching, --engine megatron at PP 1): at most this many "
        "of a batch's rows decode at once and a row that ends hands its slot to the next "
        "waiting prompt; the tokens are those of the whole batch decoded at once (default: the "
        "whole batch, no refill)",
    )
    parser.add_argument("--greedy", action="store_true", help="argmax decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="> 0 (0: use --greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine",
        choices=("megatron", "vllm"),
        default="megatron",
        help="megatron: our KV-cached decode; vllm: vLLM (pip install -e '.[vllm]'), the "
        "weights copied to it in memory, at --tp (needs --pp 1)",
    )


def check_generation_arguments(args, max_sequence_length: int, pipeline_stages: int = 1) -> int:
    """Refuse bad ``add_generation_arguments`` values before any model is built; return the
    prompt-length limit."""
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_new_tokens >= max_sequence_length:
        raise InputError(
            f"--max-new-tokens {args.max_new_tokens}: prompt + response must fit the model's "
            f"sequence length {max_sequence_length}; use at most {max_sequence_length - 1}"
        )
    if getattr(args, "no_kv_cache", False) and args.engine == "vllm":
        raise InputError("--no-kv-cache applies to --engine megatron only (vLLM always caches)")
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    _check_decode_batch(args, pipeline_stages)
    if not args.greedy and args.temperature == 0:
        raise InputError("--temperature 0: use --greedy for argmax decoding (or a value > 0)")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise InputError(f"--temperature must be a finite number > 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")
    room = max_sequence_length - args.max_new_tokens
    limit = room if args.max_prompt_length is None else args.max_prompt_length
    if not 1 <= limit <= room:
        raise InputError(
            f"--max-prompt-length {limit}: must be in [1, {room}] (the model's sequence length "
            f"{max_sequence_length} minus --max-new-tokens {args.max_new_tokens})"
        )
    return limit


def _check_decode_batch(args, pipeline_stages: int) -> None:
    slots = getattr(args, "decode_batch", None)
    if slots is None:
        return
    if slots < 1:
        raise InputError(f"--decode-batch must be >= 1, got {slots} (or leave it out)")
    if args.engine == "vllm":
        raise InputError("--decode-batch applies to --engine megatron (vLLM batches itself)")
    if getattr(args, "no_kv_cache", False):
        raise InputError("--decode-batch refills KV-cache slots: it cannot run with --no-kv-cache")
    if pipeline_stages > 1:
        raise InputError(
            f"--decode-batch refills slots at PP 1 only (this layout has {pipeline_stages} "
            "pipeline stages): leave --decode-batch out or use pp=1"
        )


def sampling_from_args(args, tokenizer, **overrides):
    """The SamplingConfig of ``add_generation_arguments`` flags; EOS/pad from the tokenizer
    (BLOOM's 2/3 without one)."""
    from megatron_rlhf.generation.decode_loop import SamplingConfig

    eos = getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    return SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=2 if eos is None else eos,
        pad_id=3 if pad is None else pad,
        decode_batch=getattr(args, "decode_batch", None),
        **overrides,
    )


def resolve_tokenizer(tokenizer_dir, model_dir):
    """``tokenizer_dir`` if given, else ``model_dir``'s tokenizer if it has one, else None
    (prompts must then be token ids)."""
    from megatron_rlhf.data.tokenizer import load_tokenizer

    if tokenizer_dir:
        return load_tokenizer(tokenizer_dir)
    if _has_tokenizer(model_dir):
        return load_tokenizer(model_dir, flag="--load")
    return None


def read_prompts(
    path, tokenizer, vocab_size: int | None = None, max_length: int | None = None,
    truncate: bool = False,
) -> list[tuple[dict, list[int]]]:  # fmt: skip
    """``(record, prompt ids)`` per line; an empty file, a prompt that is not a string or a list
    of ids in ``[0, vocab_size)``, and one over ``max_length`` tokens (unless ``truncate``: its
    last ``max_length`` tokens are kept) are errors naming the file and line."""
    records = []
    for line, record in read_jsonl(path):
        where = f"{path}:{line}"
        if "prompt_token_ids" in record:
            ids = record["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InputError(f"{where}: prompt_token_ids must be a list of ints")
        elif "prompt" in record:
            if not isinstance(record["prompt"], str):
                raise InputError(
                    f"{where}: prompt must be a string, got {type(record['prompt']).__name__}"
                )
            if tokenizer is None:
                raise InputError(f"{where}: a text prompt needs --tokenizer")
            ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        else:
            raise InputError(f"{where}: needs a 'prompt' or 'prompt_token_ids' field")
        if not ids:
            raise InputError(f"{where}: empty prompt")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in ids):
            raise InputError(f"{where}: token id out of range [0, {vocab_size}) for this model")
        if max_length is not None and len(ids) > max_length:
            if not truncate:
                raise InputError(
                    f"{where}: prompt has {len(ids)} tokens, more than --max-prompt-length "
                    f"{max_length}; shorten it or pass --truncate-prompts (keeps the last tokens)"
                )
            record = {**record, "prompt_tokens_dropped": len(ids) - max_length}
            ids = ids[-max_length:]
        records.append((record, ids))
    if not records:
        raise InputError(f"{path}: no prompts (the file is empty); give at least one line")
    return records


def left_pad(batch: list[list[int]], pad_id: int):
    """(B, P) left-padded ids and their (B, P) mask."""
    import torch

    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    return input_ids, mask


def engine_from_args(args, model, longest_prompt: int, groups=None):
    """The ``--engine`` generating with ``model`` on ``groups`` (default: the model's) as a
    rollout engine (``generation/rollout_engines.py``): vLLM gets the model's weights in memory
    before the first batch. To generate with another model of the same shape: set ``engine.actor``,
    then ``engine.refresh()``."""
    from megatron_rlhf.generation.rollout_engines import TrainingLayoutEngine, VLLMRolloutEngine

    if args.engine == "megatron":
        return TrainingLayoutEngine(model)
    engine = VLLMRolloutEngine(
        model,
        groups or model.pg_collection,
        max_model_len=longest_prompt + args.max_new_tokens,
        max_rows=args.batch_size,
        seed=args.seed,
    )
    engine.refresh()
    return engine


def _has_tokenizer(directory) -> bool:
    return (Path(directory) / "tokenizer.json").exists() or (
        Path(directory) / "tokenizer_config.json"
    ).exists()
