"""``python -m megatron_rlhf score``: score (prompt, response) pairs with a trained RM or AM.

    torchrun --nproc-per-node N -m megatron_rlhf score --load RUN/step_0000100 \\
        --input generations.jsonl --output scored.jsonl [--tokenizer TOK] --tp T --pp P

Inputs, by form:

- JSONL of single responses (e.g. ``generate``'s output): ``prompt`` or ``prompt_token_ids``
  and ``response`` or ``response_token_ids`` per line; other fields are carried through. Each
  output line adds ``reward`` (r) and ``score``; an AM also adds ``expected_reward`` (e_τ(x))
  and ``advantage`` (a = r - e_τ(x)), and its ``score`` is a; an RM's ``score`` is r. Text is
  tokenized without special tokens and text responses get the tokenizer's EOS appended (as
  ``tools/preprocess_data.py`` does; ``--no-eos`` to skip); token ids are scored as given.
- A preference set, JSONL (``prompt``/``chosen``/``rejected`` or HH-RLHF transcripts, as the
  preprocessor reads them) or an indexed preference prefix (``tools/preprocess_data.py --kind
  preference``): one line per pair, ``{"chosen_score", "rejected_score", "task"}``, the input
  of ``eval-reward``.

The AM's score of a response is a = r - e_τ(x) (Eqs. 5, 7): Eq. 8's importance-weighted terms
belong to the training comparisons' collecting policies, not to a response scored later.
Sequences are split over data-parallel replicas (world size / (tp·pp)); rank 0 writes the
output, in input order, to a temporary name renamed at the end; an existing output is replaced
only with ``--overwrite``. Prompt + response must fit the model's sequence length: a longer
pair is an error naming its line, or with ``--truncate-prompts`` the prompt keeps its last
tokens (``--max-prompt-length`` caps prompts further; counts in the summary).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class ScoringInput:
    """What to score: token sequences and how their scores become output lines."""

    prompts: list[list[int]]
    """Prompt ids of each sequence."""
    responses: list[list[int]]
    """Response ids of each sequence (a pair is two consecutive sequences)."""
    records: list[dict] | None
    """Single responses: the input record of each sequence, carried into its output line."""
    tasks: list[str | None] | None
    """Pairs: the task of each pair (None where it has none)."""
    where: list[str]
    """Where each sequence came from (``file:line``, or ``prefix pair i``), for errors."""
    truncated: list[str] = field(default_factory=list)
    """``file:line`` of every record whose prompt was cut to fit (``--truncate-prompts``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf score", description=__doc__)
    parser.add_argument("--load", required=True, help="train-reward checkpoint (RM or AM)")
    parser.add_argument("--input", required=True, help="JSONL file or indexed preference prefix")
    parser.add_argument("--output", required=True, help="output JSONL (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    parser.add_argument("--tokenizer", help="HF tokenizer dir for text (default: --load)")
    add_parallel_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward")
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to text")
    parser.add_argument(
        "--max-prompt-length",
        type=int,
        help="longest prompt in tokens (default: what the sequence length leaves the response)",
    )
    parser.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="cut a too-long prompt from the left instead of an error (counted in the summary)",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return run_command("score", lambda: run(args), distributed=True)


def run(args) -> int:
    """Score ``args.input`` (parsed by :func:`build_parser`); collective over every rank."""
    import torch.distributed as dist
    from tqdm import tqdm

    from megatron_rlhf.checkpoint import checkpoint_architecture, is_hf_checkpoint, load_bloom
    from megatron_rlhf.checkpoint.dist import TOKENIZER_FILES, read_metadata
    from megatron_rlhf.checkpoint.hf_io import hf_reward_outputs
    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.runtime import locks

    parallel_from_args(args)  # args.tp, args.pp
    check_output_path(args.output, args.overwrite)
    locks.lock_output(args.output, "--output")
    if args.batch_size < 1:
        raise InputError(f"--batch-size {args.batch_size}: must be at least 1")
    if args.max_prompt_length is not None and args.max_prompt_length < 1:
        raise InputError(f"--max-prompt-length must be >= 1, got {args.max_prompt_length}")
    if is_hf_checkpoint(args.load):  # a BloomForSequenceClassification: its score head is r
        meta = {"head": "scalar", "num_scalar_outputs": hf_reward_outputs(args.load, "--load")}
    else:
        meta = read_metadata(args.load)
    num_outputs = meta.get("num_scalar_outputs", 0)
    if meta.get("head") != "scalar" or num_outputs not in (1, 2):
        raise InputError(
            f"{args.load}: holds a {meta.get('head')!r} head with {num_outputs} scalar outputs;"
            " score needs a reward model (1 output) or advantage model (2 outputs)"
        )
    arch = checkpoint_architecture(args.load)
    tokenizer_dir = args.tokenizer or (
        args.load if any((Path(args.load) / n).exists() for n in TOKENIZER_FILES) else None
    )
    _check_tokenizer(args, tokenizer_dir)
    scoring = read_input(args.input, tokenizer_dir, not args.no_eos, arch.vocab_size)
    fit_lengths(scoring, arch.max_sequence_length, args.max_prompt_length, args.truncate_prompts)

    initialize(args.tp, args.pp, arch=arch)
    model = load_bloom(args.load, head="scalar", num_scalar_outputs=num_outputs, init_weights=False)
    model.eval()
    groups = model.pg_collection
    dp_rank, dp_size = groups.dp.rank(), groups.dp.size()
    mine = list(range(dp_rank, len(scoring.prompts), dp_size))
    mine.sort(key=lambda i: len(scoring.prompts[i]) + len(scoring.responses[i]))  # less padding
    batches = [mine[i : i + args.batch_size] for i in range(0, len(mine), args.batch_size)]
    start = time.time()
    results: dict[int, tuple[float, float | None, float]] = {}
    for batch in tqdm(batches, desc="score", disable=not is_rank0()):
        results.update(score_batch(model, scoring, batch))
    reports = groups.pp.rank() == groups.pp.size() - 1 and groups.tp.rank() == 0
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results if reports else {})
    if is_rank0():
        merged = {index: value for part in gathered for index, value in part.items()}
        _refuse_nonfinite(merged, args)
        write_jsonl(args.output, output_lines(scoring, merged))
    print_summary(
        "score",
        model="am" if num_outputs == 2 else "rm",
        sequences=len(scoring.prompts),
        pairs=len(scoring.tasks) if scoring.tasks is not None else "-",
        truncated_prompts=len(scoring.truncated),
        seconds=round(time.time() - start, 1),
        output=args.output,
    )
    return 0


def fit_lengths(
    scoring: ScoringInput, max_sequence_length: int, max_prompt_length: int | None, truncate: bool
) -> None:
    """Make every prompt + response fit the model (and every prompt ``max_prompt_length``):
    with ``truncate`` cut prompts from the left, else raise naming the record."""
    for index, (prompt, response) in enumerate(zip(scoring.prompts, scoring.responses)):
        where = scoring.where[index]
        room = max_sequence_length - len(response)
        if room < 1:
            raise InputError(
                f"{where}: the response has {len(response)} tokens; with the prompt it must fit "
                f"the model's sequence length {max_sequence_length}; shorten it"
            )
        limit = room if max_prompt_length is None else min(room, max_prompt_length)
        if len(prompt) <= limit:
            continue
        if not truncate:
            raise InputError(
                f"{where}: prompt has {len(prompt)} tokens, more than {limit} (the model's "
                f"sequence length {max_sequence_length} minus the response, or "
                "--max-prompt-length); shorten it or pass --truncate-prompts"
            )
        scoring.prompts[index] = prompt[-limit:]
        if where not in scoring.truncated:
            scoring.truncated.append(where)


def score_batch(model, scoring: ScoringInput, batch: list[int]) -> dict:
    """{sequence index: (r, e_τ or None, score)} on the last pipeline stage, {} elsewhere."""
    import torch

    with torch.no_grad():
        return _score_batch(model, scoring, batch)


def _score_batch(model, scoring: ScoringInput, batch: list[int]) -> dict:
    import torch

    from megatron_rlhf.distributed.parallel import compute_device
    from megatron_rlhf.distributed.pipeline import pipeline_forward
    from megatron_rlhf.reward.model import advantage_scores, read_scalars

    sequences = [scoring.prompts[i] + scoring.responses[i] for i in batch]
    width = max(len(ids) for ids in sequences)
    input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # (B, S) right-padded
    padding_mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, S)
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        padding_mask[row, : len(ids)] = 1
    prompt_lengths = torch.tensor([len(scoring.prompts[i]) for i in batch])  # (B,)
    device = compute_device()
    input_ids, padding_mask = input_ids.to(device), padding_mask.to(device)
    prompt_lengths = prompt_lengths.to(device)
    output = pipeline_forward(model, input_ids, padding_mask)  # (B, S, n) on the last stage
    if output is None:
        return {}
    rewards, expected = read_scalars(output, padding_mask, prompt_lengths)  # (B,), (B,) | None
    scores = advantage_scores(rewards, expected).tolist()
    expected = [None] * len(batch) if expected is None else expected.tolist()
    return {i: row for i, row in zip(batch, zip(rewards.tolist(), expected, scores))}


def _check_tokenizer(args, tokenizer_dir) -> None:
    """The input's tokenizer (an indexed set's sidecar, or --tokenizer) is the model's."""
    from megatron_rlhf.checkpoint.dist import check_tokenizer_matches, tokenizer_of
    from megatron_rlhf.data import read_sidecar
    from megatron_rlhf.data.tokenizer import check_same_tokenizer

    model = tokenizer_of(args.load)
    if not Path(args.input).is_file():
        sidecar = read_sidecar(args.input)
        check_same_tokenizer(sidecar.get("tokenizer"), args.input, model, f"--load {args.load}")
    else:
        check_tokenizer_matches(tokenizer_dir, args.load)


def _refuse_nonfinite(results: dict, args) -> None:
    """No NaN/inf score is ever written: name the first sequence that got one."""
    from megatron_rlhf.training.guards import NonFiniteError

    for index in sorted(results):
        if not all(math.isfinite(v) for v in results[index] if v is not None):
            raise NonFiniteError(
                f"{args.input}: sequence {index} (0-based; a pair's chosen is 2i, rejected 2i+1)"
                f" scored {results[index]} (NaN/inf) with {args.load}; nothing was written to "
                f"{args.output}; check that checkpoint (it may hold non-finite weights)"
            )


def output_lines(scoring: ScoringInput, results: dict):
    """The output records, in input order (see the module docstring)."""
    if scoring.records is None:
        for pair, task in enumerate(scoring.tasks):
            line = {
                "chosen_score": results[2 * pair][2],
                "rejected_score": results[2 * pair + 1][2],
            }
            if task is not None:
                line["task"] = task
            yield line
        return
    for index, record in enumerate(scoring.records):
        reward, expected, score = results[index]
        line = dict(record)
        line["reward"] = reward
        if expected is not None:
            line["expected_reward"] = expected
            line["advantage"] = score
        line["score"] = score
        yield line


def read_input(path: str, tokenizer_dir, append_eos: bool, vocab_size: int) -> ScoringInput:
    """Read any accepted input form (see the module docstring); errors name file and line."""
    if Path(path).is_file():
        first = next((record for _, record in read_jsonl(path)), None)
        if first is None:
            raise InputError(f"{path}: no records (the file is empty)")
        tokenizer = _tokenizer(tokenizer_dir)
        if "chosen" in first or "rejected" in first:
            return _read_jsonl_pairs(path, tokenizer, append_eos, vocab_size)
        return _read_jsonl_responses(path, tokenizer, append_eos, vocab_size)
    if Path(f"{path}.json").is_file():
        return _read_indexed_pairs(path)
    raise InputError(f"{path}: neither a JSONL file nor an indexed dataset prefix (no {path}.json)")


def _read_jsonl_responses(path, tokenizer, append_eos, vocab_size) -> ScoringInput:
    from megatron_rlhf.generation.prompts import read_prompts

    prompts, responses, records, places = [], [], [], []
    prompt_rows = read_prompts(path, tokenizer)
    for (line, record), (_, prompt_ids) in zip(read_jsonl(path), prompt_rows):
        where = f"{path}:{line}"
        if "response_token_ids" in record:
            response = record["response_token_ids"]
            if not isinstance(response, list) or not all(isinstance(t, int) for t in response):
                raise InputError(f"{where}: response_token_ids must be a list of ints")
        elif "response" in record:
            response = _encode(tokenizer, record["response"], append_eos, where, "response")
        else:
            raise InputError(
                f"{where}: needs a 'response' or 'response_token_ids' field (or 'chosen' and "
                "'rejected' in every line for a preference set)"
            )
        if not response:
            raise InputError(f"{where}: empty response")
        _check_ids(prompt_ids + response, vocab_size, where)
        prompts.append(prompt_ids)
        responses.append(response)
        records.append(record)
        places.append(where)
    return ScoringInput(prompts, responses, records, None, places)


def _read_jsonl_pairs(path, tokenizer, append_eos, vocab_size) -> ScoringInput:
    from megatron_rlhf.data.records import DEFAULT_KEYS, BadRecord, extract_fields

    prompts, responses, tasks, places = [], [], [], []
    for line, record in read_jsonl(path):
        where = f"{path}:{line}"
        try:
            fields = extract_fields(record, "preference", DEFAULT_KEYS["preference"])
        except BadRecord as err:
            raise InputError(f"{where}: {err}") from None
        prompt = _encode(tokenizer, fields.prompt, False, where, "prompt")
        pair = [
            _encode(tokenizer, text, append_eos, where, "response") for text in fields.responses
        ]
        if pair[0] == pair[1]:
            raise InputError(f"{where}: chosen and rejected are identical; no comparison")
        for response in pair:
            _check_ids(prompt + response, vocab_size, where)
            prompts.append(prompt)
            responses.append(response)
        tasks.append(fields.task)
        places += [where, where]
    return ScoringInput(prompts, responses, None, tasks, places)


def _read_indexed_pairs(prefix: str) -> ScoringInput:
    from megatron_rlhf.data import PreferenceDataset

    dataset = PreferenceDataset(prefix)
    prompts, responses, tasks = [], [], []
    for index in range(len(dataset)):
        item = dataset[index]
        for side in ("chosen_ids", "rejected_ids"):
            prompts.append(item["prompt_ids"].tolist())
            responses.append(item[side].tolist())
        task_id = item.get("task_id")
        tasks.append(None if task_id is None else dataset.task_names[task_id])
    where = [f"{prefix} pair {index // 2}" for index in range(len(prompts))]
    return ScoringInput(prompts, responses, None, tasks, where)


def _tokenizer(directory):
    if directory is None:
        return None
    from megatron_rlhf.data.tokenizer import load_tokenizer

    return load_tokenizer(directory)


def _encode(tokenizer, text, append_eos: bool, where: str, what: str) -> list[int]:
    if tokenizer is None:
        raise InputError(f"{where}: a text {what} needs --tokenizer (or token ids)")
    if not isinstance(text, str):
        raise InputError(f"{where}: {what} must be a string, got {type(text).__name__}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if append_eos and eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    if not ids:
        raise InputError(f"{where}: empty {what}")
    return ids


def _check_ids(ids: list[int], vocab_size: int, where: str) -> None:
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InputError(f"{where}: token id out of range [0, {vocab_size}) for this model")
