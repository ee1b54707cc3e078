"""Turn chunks of input lines into tokenized examples (runs inside the preprocessing workers).

Tokenization is ``tokenizer(texts, add_special_tokens=False)["input_ids"]`` on the prompt and
each response separately, batched per chunk; the only special token added is the EOS appended
to responses (``append_eos``). For a tokenizer that adds no special tokens by default (BLOOM's,
the tiny test tokenizer) these are exactly ``tokenizer(text)["input_ids"]`` and
``tokenizer.encode(text)``. For tokenizers that add a BOS by default, ``--prompt-special-tokens``
encodes prompts with ``add_special_tokens=True`` (responses never get one; note that left
truncation of an over-long prompt then cuts that leading BOS too).

Truncation (``--max-length L``, counted in the sidecar and the summary), by policy:

- ``truncate``: prompt data keeps the last L tokens of the prompt. SFT and preference data apply
  :func:`megatron_rlhf.data.records.fit_to_length` (the prompt keeps its last tokens, at least
  ``--max-prompt-length`` of them; responses keep their first tokens). SFT: the floor defaults
  to L // 2 and a cut response loses its EOS, so the model is never taught to stop
  mid-sentence. Preference: the prompt is cut first (floor 1 token by default) and a response
  that still does not fit keeps its EOS as its last token, since the reward is read there.
  Behaviour log-probs, if any, still describe the whole response; such cuts are counted
  separately.
- ``drop``: an over-long example is not written (counted as dropped, listed in the sidecar).
- ``error``: an over-long example is bad input (stops the run, or is skipped with --skip-bad).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megatron_rlhf.data.records import BadRecord, Example, Fields, extract_fields, fit_to_length

TRUNCATION_POLICIES = ("truncate", "drop", "error")

# Outcome statuses of one input line.
OK, BAD, BLANK, DROPPED = "ok", "bad", "blank", "dropped"


@dataclass(kw_only=True)
class EncodeConfig:
    """How one record becomes one example."""

    kind: str
    """prompt | sft | preference."""
    json_keys: dict[str, str]
    """Role -> field name in the input records."""
    tokenizer_dir: str
    """Local Hugging Face tokenizer directory."""
    max_length: int | None = None
    """Maximum tokens of prompt + response (+ EOS); of the prompt alone for prompt data."""
    max_prompt_length: int | None = None
    """Prompt tokens always kept when a long example is truncated (default max_length // 2)."""
    truncation: str = "truncate"
    """What to do with over-long examples: truncate | drop | error."""
    append_eos: bool = True
    """Append the tokenizer's EOS to every response (SFT and preference data)."""
    prompt_special_tokens: bool = False
    """Encode prompts with the tokenizer's default special tokens (e.g. a BOS it adds)."""


@dataclass
class Truncation:
    """What truncation removed from one example."""

    prompt_tokens: int = 0
    """Prompt tokens removed (from the left)."""
    response_tokens: int = 0
    """Response tokens removed (from the right), summed over responses."""
    responses_cut: int = 0
    """Responses that lost tokens."""


class Encoder:
    """Parses, validates, tokenizes and truncates records; one instance per worker process."""

    def __init__(self, config: EncodeConfig):
        from megatron_rlhf.data.tokenizer import load_tokenizer

        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_dir)
        self.eos_id = self.tokenizer.eos_token_id
        if config.max_length is not None:
            self.max_prompt_length = prompt_floor(config)

    def encode_chunk(self, items: list[tuple[int, int, bytes | dict]]) -> list[tuple]:
        """``(source, line, payload)`` items -> ``(source, line, status, value, Truncation)``.

        ``value`` is an :class:`Example` for OK, the reason string for BAD and DROPPED.
        """
        parsed: list[Fields | tuple[str, str]] = []
        prompts: list[str] = []
        responses: list[str] = []
        for _, _, payload in items:
            try:
                fields = self._fields(payload)
            except BadRecord as err:
                parsed.append((BAD, str(err)))
                continue
            if fields is None:
                parsed.append((BLANK, "blank line"))
                continue
            parsed.append(fields)
            prompts.append(fields.prompt)
            responses.extend(fields.responses)
        prompt_ids = iter(self._tokenize(prompts, self.config.prompt_special_tokens))
        response_ids = iter(self._tokenize(responses, False))

        outcomes = []
        for (source, line, _), fields in zip(items, parsed):
            if isinstance(fields, tuple):
                outcomes.append((source, line, *fields, None))
                continue
            ids = [next(response_ids) for _ in fields.responses]
            outcomes.append((source, line, *self._example(fields, next(prompt_ids), ids)))
        return outcomes

    def _tokenize(self, texts: list[str], special_tokens: bool) -> list[list[int]]:
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]

    def _fields(self, payload: bytes | dict) -> Fields | None:
        if isinstance(payload, bytes):
            try:
                text = payload.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BadRecord(f"invalid UTF-8 ({err.reason} at byte {err.start})") from None
            if not text.strip():
                return None
            try:
                payload = json.loads(text)
            except json.JSONDecodeError as err:
                raise BadRecord(f"malformed JSON ({err.msg} at column {err.colno})") from None
        return extract_fields(payload, self.config.kind, self.config.json_keys)

    def _example(self, fields: Fields, prompt_ids: list[int], response_ids: list[list[int]]):
        if self.config.kind != "prompt" and self.config.append_eos:
            response_ids = [ids + [self.eos_id] for ids in response_ids]
        example = Example(prompt_ids, tuple(response_ids), fields.task, fields.logprobs)
        limit = self.config.max_length
        longest = max(map(len, response_ids), default=0)
        if limit is None or len(prompt_ids) + longest <= limit:
            return OK, example, None
        reason = f"too long ({len(prompt_ids) + longest} tokens > --max-length {limit})"
        if self.config.truncation == "drop":
            return DROPPED, reason, None
        if self.config.truncation == "error":
            return BAD, reason + "; or pass --truncation truncate|drop", None
        lengths = [len(ids) for ids in response_ids]
        prompt_kept, kept = fit_to_length(len(prompt_ids), lengths, limit, self.max_prompt_length)
        example.prompt_ids = prompt_ids[len(prompt_ids) - prompt_kept :]
        keep_eos = self.config.kind == "preference" and self.config.append_eos
        example.response_ids = tuple(
            ids[: n - 1] + ids[-1:] if keep_eos and n < len(ids) else ids[:n]
            for ids, n in zip(response_ids, kept)
        )
        truncation = Truncation(
            prompt_tokens=len(prompt_ids) - prompt_kept,
            response_tokens=sum(lengths) - sum(kept),
            responses_cut=sum(n < length for n, length in zip(kept, lengths)),
        )
        return OK, example, truncation


def prompt_floor(config: EncodeConfig) -> int | None:
    """Prompt tokens a truncated example always keeps (``--max-prompt-length``, else: all of L for
    prompt data, 1 for preference data, L // 2 for SFT); None without ``--max-length``."""
    if config.max_length is None:
        return None
    if config.max_prompt_length is not None:
        return config.max_prompt_length
    return {"prompt": config.max_length, "preference": 1}.get(config.kind, config.max_length // 2)


_WORKER_ENCODER: Encoder | None = None


def init_worker(config: EncodeConfig) -> None:
    """Pool initializer: one tokenizer per worker process."""
    global _WORKER_ENCODER
    # The workers already run in parallel; the tokenizer's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = Encoder(config)


def encode_in_worker(items: list[tuple[int, int, bytes | dict]]) -> list[tuple]:
    """Pool task: encode one chunk with this worker's encoder."""
    return _WORKER_ENCODER.encode_chunk(items)
