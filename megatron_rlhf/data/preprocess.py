"""Tokenize JSONL / parquet / local HF datasets once into Megatron-Core indexed .bin/.idx files.

``python tools/preprocess_data.py --input data.jsonl --kind sft --tokenizer TOKENIZER_DIR
--output-prefix out/sft --workers 4 --max-length 2048``

Layout of what is written: :mod:`megatron_rlhf.data.indexed`; which fields are read and how HH-
RLHF transcripts are split: :mod:`megatron_rlhf.data.records`; tokenization and the truncation
policies: :mod:`megatron_rlhf.data.encode`.

Workers tokenize chunks of lines in parallel; the main process writes the results strictly in
input order, so the output does not depend on ``--workers``. Bad lines (malformed JSON, missing
key, empty response, invalid UTF-8, ...) stop the run with ``file:line: reason`` and leave no
final output behind; with ``--skip-bad`` they are skipped, counted by reason and listed (first
1,000) in the sidecar and the summary. Blank lines are skipped and counted, never an error.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from megatron_rlhf.data.encode import (
    BAD,
    BLANK,
    DROPPED,
    TRUNCATION_POLICIES,
    EncodeConfig,
    Encoder,
    encode_in_worker,
    init_worker,
    prompt_floor,
)
from megatron_rlhf.data.indexed import ExampleWriter
from megatron_rlhf.data.records import KINDS, BadRecord, parse_json_keys
from megatron_rlhf.data.sources import Source, count_items, expand_inputs, iter_items
from megatron_rlhf.utils import InputError, check_output_prefix, print_summary, run_command

MAX_LISTED_SKIPS = 1000


@dataclass(kw_only=True)
class PreprocessConfig:
    """Everything one preprocessing run needs."""

    inputs: list[str]
    """JSONL/parquet files or local datasets directories, read in this order."""
    output_prefix: str
    """Output prefix P: streams P<suffix>.bin/.idx and the sidecar P.json."""
    encode: EncodeConfig
    """Kind, field names, tokenizer and truncation."""
    workers: int = 1
    """Tokenizing processes; 1 tokenizes in the main process. Output is identical for any N."""
    skip_bad: bool = False
    """Skip and count bad lines instead of stopping at the first one."""
    split: str | None = None
    """Split to read from a saved DatasetDict."""
    chunk_size: int = 256
    """Lines per task sent to a worker (also the tokenizer's batch size)."""
    progress: bool = True
    """Show a tqdm progress bar on stderr."""


@dataclass
class Counts:
    """What happened to the input lines; goes into the sidecar and the summary."""

    lines_read: int = 0
    blank: int = 0
    bad_by_reason: Counter = field(default_factory=Counter)
    listed: list = field(default_factory=list)
    truncated_examples: int = 0
    prompt_tokens_removed: int = 0
    response_tokens_removed: int = 0
    responses_cut: int = 0
    logprob_responses_cut: int = 0
    dropped: int = 0

    def skip(self, source: Source, line: int, reason: str) -> None:
        if len(self.listed) < MAX_LISTED_SKIPS:
            self.listed.append({"file": str(source.path), "line": line, "reason": reason})


def preprocess(config: PreprocessConfig) -> dict:
    """Run the preprocessing; return the sidecar written beside the output."""
    from tqdm import tqdm

    from megatron_rlhf.data.tokenizer import load_tokenizer, tokenizer_info

    encode = config.encode
    _check_config(config)
    sources = expand_inputs(config.inputs, config.split)
    info = tokenizer_info(load_tokenizer(encode.tokenizer_dir), encode.tokenizer_dir)
    if encode.kind != "prompt" and encode.append_eos and info["eos_id"] is None:
        raise InputError(f"--tokenizer {encode.tokenizer_dir}: no eos_token; pass --no-eos")
    total = sum(count_items(source) for source in sources)
    counts = Counts()
    writer = ExampleWriter(config.output_prefix, encode.kind, info)
    started = time.perf_counter()
    with (
        writer,
        tqdm(total=total, unit="line", desc="preprocess", disable=not config.progress) as bar,
    ):
        for chunk in _encoded_chunks(config, sources):
            for source_index, line, status, value, truncation in chunk:
                counts.lines_read += 1
                _handle(
                    config, writer, counts, sources[source_index], line, status, value, truncation
                )
            bar.update(len(chunk))
        sidecar = writer.commit(**_sidecar_fields(config, sources, counts))
    seconds = time.perf_counter() - started
    tokens = sum(
        stream["num_values"]
        for name, stream in sidecar["streams"].items()
        if name in ("tokens", "prompt", "chosen", "rejected")
    )
    print_summary(
        "preprocess_data",
        kind=encode.kind,
        documents=writer.num_documents,
        tokens=tokens,
        lines=counts.lines_read,
        skipped_bad=sum(counts.bad_by_reason.values()),
        skipped_by_reason=",".join(
            f"{reason.replace(' ', '_')}:{n}" for reason, n in sorted(counts.bad_by_reason.items())
        )
        or "-",
        blank=counts.blank,
        truncated=counts.truncated_examples,
        prompt_tokens_removed=counts.prompt_tokens_removed,
        responses_cut=counts.responses_cut,
        dropped=counts.dropped,
        seconds=round(seconds, 2),
        docs_per_s=round(writer.num_documents / max(seconds, 1e-9)),
        tokens_per_s=round(tokens / max(seconds, 1e-9)),
        output=config.output_prefix,
    )
    return sidecar


def _handle(config, writer, counts, source, line, status, value, truncation) -> None:
    """Write one encoded line, or count (and list) why it was not written."""
    if status == BLANK:
        counts.blank += 1
        counts.skip(source, line, value)
        return
    if status == DROPPED:
        counts.dropped += 1
        counts.skip(source, line, value)
        return
    if status != BAD:
        try:
            writer.add(value)
        except BadRecord as err:
            status, value = BAD, str(err)
    if status == BAD:
        if not config.skip_bad:
            raise InputError(f"{source.where(line)}: {value} (pass --skip-bad to skip such lines)")
        counts.bad_by_reason[value.split(" (")[0]] += 1
        counts.skip(source, line, value)
        return
    if truncation is not None:
        counts.truncated_examples += 1
        counts.prompt_tokens_removed += truncation.prompt_tokens
        counts.response_tokens_removed += truncation.response_tokens
        counts.responses_cut += truncation.responses_cut
        if value.logprobs is not None:
            counts.logprob_responses_cut += truncation.responses_cut


def _encoded_chunks(config: PreprocessConfig, sources: list[Source]):
    """Encoded chunks in input order, from the main process or a pool of workers."""
    items = (
        (index, line, payload)
        for index, source in enumerate(sources)
        for line, payload in iter_items(source)
    )
    chunks = iter(lambda: list(itertools.islice(items, config.chunk_size)), [])
    if config.workers == 1:
        encoder = Encoder(config.encode)
        yield from map(encoder.encode_chunk, chunks)
        return
    from concurrent.futures import ProcessPoolExecutor

    # A worker that dies (e.g. killed for memory) fails the run instead of hanging it.
    with ProcessPoolExecutor(
        config.workers, initializer=init_worker, initargs=(config.encode,)
    ) as pool:
        # At most a few chunks in flight per worker: bounded memory, results kept in order.
        pending: deque = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(encode_in_worker, chunk))
                if len(pending) >= 4 * config.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _check_config(config: PreprocessConfig) -> None:
    encode = config.encode
    if config.workers < 1:
        raise InputError(f"--workers {config.workers}: must be at least 1")
    if encode.max_length is not None and encode.max_length < 1:
        raise InputError(f"--max-length {encode.max_length}: must be at least 1")
    if encode.max_prompt_length is not None:
        if encode.kind == "prompt":
            raise InputError("--max-prompt-length is for sft/preference; prompts use --max-length")
        if encode.max_length is None or not 0 < encode.max_prompt_length < encode.max_length:
            raise InputError(
                f"--max-prompt-length {encode.max_prompt_length}: needs --max-length and must be "
                "between 1 and --max-length - 1 (each response keeps at least one token)"
            )
    if encode.max_length is not None and encode.max_length < 2 and encode.kind != "prompt":
        raise InputError("--max-length must be at least 2 for sft/preference (prompt + response)")


def _sidecar_fields(config: PreprocessConfig, sources: list[Source], counts: Counts) -> dict:
    encode = config.encode
    bad = sum(counts.bad_by_reason.values())
    return {
        "inputs": [{"path": str(s.path), "format": s.format, "split": s.split} for s in sources],
        "json_keys": encode.json_keys,
        "append_eos": encode.append_eos and encode.kind != "prompt",
        "prompt_special_tokens": encode.prompt_special_tokens,
        "truncation": {
            "policy": encode.truncation,
            "max_length": encode.max_length,
            "max_prompt_length": prompt_floor(encode) if encode.kind != "prompt" else None,
            "examples_truncated": counts.truncated_examples,
            "prompt_tokens_removed": counts.prompt_tokens_removed,
            "response_tokens_removed": counts.response_tokens_removed,
            "responses_cut": counts.responses_cut,
            "responses_cut_with_logprobs": counts.logprob_responses_cut,
            "dropped": counts.dropped,
        },
        "lines": {
            "read": counts.lines_read,
            "blank": counts.blank,
            "skipped_bad": bad,
            "dropped": counts.dropped,
        },
        "skipped": {
            "by_reason": dict(sorted(counts.bad_by_reason.items())),
            "lines": counts.listed,
            "lines_listed_max": MAX_LISTED_SKIPS,
        },
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/preprocess_data.py",
        description="Tokenize prompt / SFT / preference data into Megatron-Core indexed files.",
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSONL file(s), .parquet file(s) or local datasets directories",
    )
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer dir")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing dataset at the prefix"
    )
    parser.add_argument(
        "--json-keys",
        nargs="+",
        metavar="ROLE=FIELD",
        help="field names, e.g. prompt=question response=answer",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizing processes (output is identical for any number)",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="max tokens of prompt + response (+EOS); of the prompt for prompts",
    )
    parser.add_argument(
        "--max-prompt-length",
        type=int,
        default=None,
        help="prompt tokens always kept when truncating (default: max-length // 2 for sft, 1 for"
        " preference: its prompt is cut first and its responses keep their EOS)",
    )
    parser.add_argument(
        "--truncation",
        choices=TRUNCATION_POLICIES,
        default="truncate",
        help="over-long examples: cut (prompt from the left, responses from the "
        "right), drop, or treat as bad input; counts go to the sidecar",
    )
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS to responses")
    parser.add_argument(
        "--prompt-special-tokens",
        action="store_true",
        help="encode prompts with the tokenizer's default specials (e.g. BOS)",
    )
    parser.add_argument(
        "--skip-bad", action="store_true", help="skip and count bad lines instead of stopping"
    )
    parser.add_argument("--split", default=None, help="split of a saved DatasetDict")
    parser.add_argument("--chunk-size", type=int, default=256, help="lines per worker task")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def config_from_args(args: argparse.Namespace) -> PreprocessConfig:
    try:
        json_keys = parse_json_keys(args.json_keys, args.kind)
    except ValueError as err:
        raise InputError(str(err)) from None
    return PreprocessConfig(
        inputs=args.input,
        output_prefix=args.output_prefix,
        encode=EncodeConfig(
            kind=args.kind,
            json_keys=json_keys,
            tokenizer_dir=args.tokenizer,
            max_length=args.max_length,
            max_prompt_length=args.max_prompt_length,
            truncation=args.truncation,
            append_eos=not args.no_eos,
            prompt_special_tokens=args.prompt_special_tokens,
        ),
        workers=args.workers,
        skip_bad=args.skip_bad,
        split=args.split,
        chunk_size=args.chunk_size,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("preprocess_data", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    from megatron_rlhf.runtime import locks

    check_output_prefix(args.output_prefix, [".json"], args.overwrite, "--output-prefix")
    locks.lock_output(args.output_prefix, "--output-prefix")
    preprocess(config_from_args(args))
    return 0
