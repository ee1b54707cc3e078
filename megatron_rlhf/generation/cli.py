"""``python -m megatron_rlhf generate``: batched generation from a JSONL of prompts.

    torchrun --nproc-per-node N -m megatron_rlhf generate --load DIR --tokenizer TOK \\
        --prompts in.jsonl --output out.jsonl --tp T --pp P --max-new-tokens K \\
        [--greedy | --temperature X --top-p Y --seed S] [--output-logprobs]

Input lines hold ``{"prompt": str}`` or ``{"prompt_token_ids": [int]}`` (other fields are
carried through). Output lines add ``response``, ``response_token_ids``, ``finished`` (the
response ended with EOS rather than at ``--max-new-tokens``) and, with
``--output-logprobs``, ``response_logprobs``. Prompts are split over data-parallel replicas
(world size / (tp*pp)); rank 0 writes the output in input order, to a temporary name renamed
at the end; an existing output is replaced only with ``--overwrite``.

Lengths: prompt + response must fit the model's sequence length (``seq_length`` of an HF
config.json, else 2048). A prompt longer than ``--max-prompt-length`` (default: that length
minus ``--max-new-tokens``) is an error naming its line, or with ``--truncate-prompts`` keeps
its last tokens (cut from the left; its output line gets ``prompt_tokens_dropped`` and the
summary counts them). ``--temperature 0`` is
refused: use ``--greedy`` for argmax decoding.
"""

from __future__ import annotations

import argparse
import math
import time

from megatron_rlhf.distributed.layouts import add_parallel_arguments, parallel_from_args
from megatron_rlhf.utils import (
    InputError,
    check_output_path,
    is_rank0,
    print_summary,
    read_jsonl,
    run_command,
    write_jsonl,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf generate", description=__doc__)
    parser.add_argument("--load", required=True, help="HF BLOOM dir or megatron-rlhf checkpoint")
    parser.add_argument("--tokenizer", help="HF tokenizer dir (default: --load)")
    parser.add_argument("--prompts", required=True, help="input JSONL")
    parser.add_argument("--output", required=True, help="output JSONL (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    add_parallel_arguments(parser)
    add_generation_arguments(parser)
    parser.add_argument("--output-logprobs", action="store_true")
    parser.add_argument("--no-kv-cache", action="store_true", help="recompute the prefix")
    return parser


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


def check_generation_arguments(args, max_sequence_length: int) -> int:
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


def sampling_from_args(args, tokenizer, **overrides):
    """The SamplingConfig of ``add_generation_arguments`` flags; EOS/pad from the tokenizer
    (BLOOM's 2/3 without one)."""
    from megatron_rlhf.generation.engine import SamplingConfig

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
        **overrides,
    )


def load_tokenizer(directory):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except Exception as err:
        raise InputError(f"{directory}: cannot load a Hugging Face tokenizer ({err})") from None


def resolve_tokenizer(tokenizer_dir, model_dir):
    """``tokenizer_dir`` if given, else ``model_dir``'s tokenizer if it has one, else None
    (prompts must then be token ids)."""
    if tokenizer_dir or _has_tokenizer(model_dir):
        return load_tokenizer(tokenizer_dir or model_dir)
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


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_command("generate", lambda: _generate(args), distributed=True)


def _generate(args) -> int:
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_rlhf.checkpoint import checkpoint_architecture, load_bloom
    from megatron_rlhf.checkpoint.dist import check_tokenizer_matches
    from megatron_rlhf.distributed import ParallelConfig, initialize
    from megatron_rlhf.runtime import locks

    parallel_from_args(args)  # args.tp, args.pp
    check_output_path(args.output, args.overwrite)
    locks.lock_output(args.output, "--output")
    arch = checkpoint_architecture(args.load)
    max_prompt_length = check_generation_arguments(args, arch.max_sequence_length)
    check_tokenizer_matches(args.tokenizer, args.load)
    tokenizer = resolve_tokenizer(args.tokenizer, args.load)
    records = read_prompts(
        args.prompts, tokenizer, arch.vocab_size, max_prompt_length, args.truncate_prompts
    )
    sampling = sampling_from_args(args, tokenizer, use_kv_cache=not args.no_kv_cache)
    initialize(
        ParallelConfig(tp=args.tp, pp=args.pp), num_heads=arch.num_heads, num_layers=arch.num_layers
    )
    model = load_bloom(args.load, init_weights=False)
    engine = build_engine(args, model, max(len(ids) for _, ids in records))
    dp_rank, dp_size = model.pg_collection.dp.rank(), model.pg_collection.dp.size()
    mine = list(range(dp_rank, len(records), dp_size))
    results: dict[int, dict] = {}
    start, generated = time.time(), 0
    batches = [mine[i : i + args.batch_size] for i in range(0, len(mine), args.batch_size)]
    idle = engine.idle_calls(len(batches))
    for batch in tqdm(batches, desc="generate", disable=not is_rank0()):
        input_ids, mask = left_pad([records[i][1] for i in batch], sampling.pad_id)
        out = engine.generate(input_ids, mask, sampling)
        for row, index in enumerate(batch):
            length = int(out.response_mask[row].sum())
            ids = out.response_ids[row, :length].tolist()
            generated += length
            result = dict(records[index][0])
            result["response_token_ids"] = ids
            result["finished"] = bool(ids) and ids[-1] == sampling.eos_id  # else cut at the limit
            if tokenizer is not None:
                result["response"] = tokenizer.decode(ids, skip_special_tokens=True)
            if args.output_logprobs:
                result["response_logprobs"] = out.response_logprobs[row, :length].tolist()
            results[index] = result
    for _ in range(idle):  # vLLM's replicas step together: as many calls as the busiest rank
        engine.idle_call()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    totals = [None] * dist.get_world_size()
    dist.all_gather_object(totals, generated)
    engine.close()  # vLLM's teardown also ends torch.distributed: after the last collective
    if is_rank0():
        merged = {index: rec for part in gathered for index, rec in part.items()}
        write_jsonl(args.output, (merged[i] for i in range(len(records))))
    seconds = time.time() - start
    tokens = sum(totals) // (args.tp * args.pp)  # each model-parallel rank counted its replica's
    print_summary(
        "generate",
        prompts=len(records),
        truncated_prompts=sum("prompt_tokens_dropped" in record for record, _ in records),
        tokens=tokens,
        tokens_per_s=round(tokens / max(seconds, 1e-9), 1),
        output=args.output,
    )
    return 0


def build_engine(args, model, longest_prompt: int, groups=None):
    """The ``--engine`` generating with ``model`` on ``groups`` (default: the model's) as a
    rollout engine (``ppo/rollout_engine.py``): vLLM gets the model's weights in memory before
    the first batch. To generate with another model of the same shape: set ``engine.actor``,
    then ``engine.refresh()``."""
    from megatron_rlhf.ppo.rollout_engine import TrainingLayoutEngine, VLLMRolloutEngine

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
    from pathlib import Path

    return (Path(directory) / "tokenizer.json").exists() or (
        Path(directory) / "tokenizer_config.json"
    ).exists()
