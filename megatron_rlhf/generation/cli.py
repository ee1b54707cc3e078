"""``python -m megatron_rlhf generate``: batched generation from a JSONL of prompts.

    torchrun --nproc-per-node N -m megatron_rlhf generate --load DIR --tokenizer TOK \\
        --prompts in.jsonl --output out.jsonl --tp T --pp P --max-new-tokens K \\
        [--greedy | --temperature X --top-p Y --seed S] [--output-logprobs] [--decode-batch N]

Input lines hold ``{"prompt": str}`` or ``{"prompt_token_ids": [int]}`` (other fields are
carried through). Output lines add ``response``, ``response_token_ids``, ``finished`` (the
response ended with EOS rather than at ``--max-new-tokens``) and, with
``--output-logprobs``, ``response_logprobs`` (each token's log-prob under the distribution it
was sampled from: the temperature applied and the top-p nucleus renormalised; with
``--greedy``, at temperature 1). Prompts are split over data-parallel replicas
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
import time

from megatron_rlhf.distributed.layouts import add_parallel_arguments, parallel_from_args
from megatron_rlhf.generation.prompts import (
    add_generation_arguments,
    check_generation_arguments,
    engine_from_args,
    left_pad,
    read_prompts,
    resolve_tokenizer,
    sampling_from_args,
)
from megatron_rlhf.utils import (
    check_output_path,
    is_rank0,
    print_summary,
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


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_command("generate", lambda: _generate(args), distributed=True)


def _generate(args) -> int:
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_rlhf.checkpoint import checkpoint_architecture, load_bloom
    from megatron_rlhf.checkpoint.dist import check_tokenizer_matches
    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.runtime import locks

    parallel_from_args(args)  # args.tp, args.pp
    check_output_path(args.output, args.overwrite)
    locks.lock_output(args.output, "--output")
    arch = checkpoint_architecture(args.load)
    max_prompt_length = check_generation_arguments(args, arch.max_sequence_length, args.pp)
    check_tokenizer_matches(args.tokenizer, args.load)
    tokenizer = resolve_tokenizer(args.tokenizer, args.load)
    records = read_prompts(
        args.prompts, tokenizer, arch.vocab_size, max_prompt_length, args.truncate_prompts
    )
    sampling = sampling_from_args(args, tokenizer, use_kv_cache=not args.no_kv_cache)
    initialize(args.tp, args.pp, arch=arch)
    model = load_bloom(args.load, init_weights=False)
    engine = engine_from_args(args, model, max(len(ids) for _, ids in records))
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
