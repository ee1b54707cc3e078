"""From one input record to the texts of one example: field mapping, HH-RLHF split, validation.

Pure functions on dicts and strings (no tokenizer, no I/O). A record that cannot become an
example raises :class:`BadRecord` with a reason; the caller adds the file and line.

Fields per kind (``--json-keys ROLE=FIELD`` renames them):

- prompt: ``prompt``. Without a ``prompt`` field, a record with ``chosen`` and ``rejected``
  HH-RLHF transcripts gives the prompt part of the pair (so HH-RLHF also serves as PPO prompts).
- sft: ``prompt`` (may be empty) and ``response`` (must not be empty).
- preference: ``prompt``, ``chosen``, ``rejected``; optional ``task`` (a name, any JSON scalar)
  and optional ``chosen_logprobs`` / ``rejected_logprobs`` (a number or a list of K numbers:
  the summed log-prob of that response under each of the K behaviour policies, DESIGN.md §2).
  Without a ``prompt`` field, ``chosen``/``rejected`` are read as HH-RLHF transcripts.

A prompt or response is empty when it is only whitespace. Empty responses are always bad input;
empty prompts are bad input for prompt and preference data (generation and the Advantage Model's
expected-reward head need a last prompt token) and allowed for SFT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("prompt", "sft", "preference")
HH_ASSISTANT = "\n\nAssistant:"
# Summed log-probs computed in floating point may land a hair above 0 for near-certain responses.
LOGPROB_TOLERANCE = 1e-4

DEFAULT_KEYS = {
    "prompt": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "sft": {"prompt": "prompt", "response": "response"},
    "preference": {
        "prompt": "prompt",
        "chosen": "chosen",
        "rejected": "rejected",
        "task": "task",
        "chosen_logprobs": "chosen_logprobs",
        "rejected_logprobs": "rejected_logprobs",
    },
}


class BadRecord(ValueError):
    """A record that cannot become an example; the message is the reason (no file/line)."""


@dataclass
class Fields:
    """The texts (and side values) of one example before tokenization."""

    prompt: str
    """Prompt text; tokenized without special tokens."""
    responses: tuple[str, ...] = ()
    """() for prompt data, (response,) for SFT, (chosen, rejected) for preference data."""
    task: str | None = None
    """Task/category name of a preference pair, when the record has one."""
    logprobs: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """(chosen, rejected) behaviour-policy log-probs, K values each, when the record has them."""


@dataclass
class Example:
    """One tokenized example, ready to write: ids already truncated, EOS already appended."""

    prompt_ids: list[int]
    """Prompt token ids (no special tokens added)."""
    response_ids: tuple[list[int], ...] = ()
    """() for prompt data, (response,) for SFT, (chosen, rejected) for preference data."""
    task: str | None = None
    """Task/category name (preference data only)."""
    logprobs: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """(chosen, rejected) behaviour-policy log-probs, K values each (preference data only)."""


def parse_json_keys(pairs: list[str] | None, kind: str) -> dict[str, str]:
    """Turn ``["prompt=question", ...]`` into the role -> field map for ``kind``."""
    keys = dict(DEFAULT_KEYS[kind])
    for pair in pairs or []:
        role, sep, field = pair.partition("=")
        if not sep or not field:
            raise ValueError(f"--json-keys {pair!r}: write ROLE=FIELD, e.g. prompt=question")
        if role not in keys:
            raise ValueError(
                f"--json-keys {pair!r}: unknown role {role!r} for --kind {kind}; "
                f"roles are {', '.join(keys)}"
            )
        keys[role] = field
    return keys


def split_hh_pair(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Split two HH-RLHF transcripts into (prompt, chosen response, rejected response).

    The prompt is the longest common prefix that ends with the last "\\n\\nAssistant:" marker
    lying wholly inside the common prefix; the responses are what follows it in each transcript
    (their leading space kept, so prompt + response re-forms the transcript exactly).
    """
    common = 0
    limit = min(len(chosen), len(rejected))
    while common < limit and chosen[common] == rejected[common]:
        common += 1
    cut = chosen.rfind(HH_ASSISTANT, 0, common)
    if cut < 0 or cut + len(HH_ASSISTANT) > common:
        if HH_ASSISTANT not in chosen:
            raise BadRecord("not an HH-RLHF transcript (no '\\n\\nAssistant:' in 'chosen')")
        raise BadRecord("'chosen' and 'rejected' share no prefix ending in '\\n\\nAssistant:'")
    end = cut + len(HH_ASSISTANT)
    return chosen[:end], chosen[end:], rejected[end:]


def extract_fields(record: dict, kind: str, keys: dict[str, str]) -> Fields:
    """Read the example's texts out of one record, or raise :class:`BadRecord`."""
    if not isinstance(record, dict):
        raise BadRecord("expected a JSON object per line (JSON Lines)")
    if kind == "sft":
        prompt = _text(record, keys, "prompt")
        response = _text(record, keys, "response")
        _require_nonempty(response, keys["response"], "response")
        return Fields(prompt=prompt, responses=(response,))

    if keys["prompt"] in record or "chosen" not in keys:
        prompt = _text(record, keys, "prompt")
        chosen = _text(record, keys, "chosen") if kind == "preference" else ""
        rejected = _text(record, keys, "rejected") if kind == "preference" else ""
    elif keys["chosen"] in record or keys["rejected"] in record:
        prompt, chosen, rejected = split_hh_pair(
            _text(record, keys, "chosen"), _text(record, keys, "rejected")
        )
    else:
        raise BadRecord(_missing(record, keys["prompt"], "prompt"))
    _require_nonempty(prompt, keys["prompt"], "prompt")
    if kind == "prompt":
        return Fields(prompt=prompt)

    _require_nonempty(chosen, keys["chosen"], "response")
    _require_nonempty(rejected, keys["rejected"], "response")
    return Fields(
        prompt=prompt,
        responses=(chosen, rejected),
        task=_task(record, keys["task"]),
        logprobs=_logprobs(record, keys),
    )


def fit_to_length(
    prompt_len: int, response_lens: list[int], max_length: int, max_prompt_length: int
) -> tuple[int, list[int]]:
    """How many prompt and response tokens to keep so prompt + each response <= max_length.

    Policy ``truncate``: nothing is cut when everything fits. Otherwise the prompt keeps its
    *last* tokens, at least ``min(prompt_len, max_prompt_length)`` of them and more if the longest
    response leaves room; each response then keeps its *first* ``max_length - prompt_kept``
    tokens (a cut response loses its EOS). Requires ``max_prompt_length < max_length`` when there
    are responses, so every response keeps at least one token.
    """
    longest = max(response_lens, default=0)
    if prompt_len + longest <= max_length:
        return prompt_len, list(response_lens)
    if not response_lens:
        return max_length, []
    prompt_kept = min(prompt_len, max(max_prompt_length, max_length - longest))
    budget = max_length - prompt_kept
    return prompt_kept, [min(length, budget) for length in response_lens]


def _text(record: dict, keys: dict[str, str], role: str) -> str:
    field = keys[role]
    if field not in record:
        raise BadRecord(_missing(record, field, role))
    value = record[field]
    if not isinstance(value, str):
        raise BadRecord(f"field '{field}' must be a string, got {type(value).__name__}")
    return value


def _missing(record: dict, field: str, role: str) -> str:
    present = ", ".join(sorted(map(str, record))[:8]) or "none"
    return (
        f"missing key '{field}' (keys present: {present}; map another field with "
        f"--json-keys {role}=FIELD)"
    )


def _require_nonempty(text: str, field: str, what: str) -> None:
    if not text.strip():
        raise BadRecord(f"empty {what} in field '{field}'")


def _task(record: dict, field: str) -> str | None:
    if field not in record or record[field] is None:
        return None
    value = record[field]
    if isinstance(value, (dict, list)):
        raise BadRecord(f"field '{field}' (task) must be a name, got {type(value).__name__}")
    return str(value)


def _logprobs(record: dict, keys: dict[str, str]):
    fields = (keys["chosen_logprobs"], keys["rejected_logprobs"])
    present = [field in record and record[field] is not None for field in fields]
    if not any(present):
        return None
    if not all(present):
        missing = fields[present.index(False)]
        raise BadRecord(f"missing key '{missing}' (behaviour log-probs come in pairs)")
    chosen, rejected = (_floats(record[field], field) for field in fields)
    if len(chosen) != len(rejected):
        raise BadRecord(
            f"'{fields[0]}' has {len(chosen)} values but '{fields[1]}' has {len(rejected)}; "
            "give one value per behaviour policy in both"
        )
    return chosen, rejected


def _floats(value, field: str) -> tuple[float, ...]:
    values = value if isinstance(value, list) else [value]
    if not values:
        raise BadRecord(f"field '{field}' is an empty list; give one log-prob per policy")
    out = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise BadRecord(f"field '{field}' must hold numbers, got {item!r}")
        if not math.isfinite(item):
            raise BadRecord(f"field '{field}' holds {item} (NaN/inf); fix or drop that record")
        if item > LOGPROB_TOLERANCE:
            raise BadRecord(
                f"field '{field}' holds {item} > 0, which no log-probability can be; "
                "give summed log-probs (not probabilities)"
            )
        out.append(float(item))
    return tuple(out)
