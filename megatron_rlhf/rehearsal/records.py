"""Read and validate the scored (prompt, response) records that rehearsal curation starts from.

Each input line is ``{"prompt": str, "response": str, "score": float, ...}``: a PPO prompt, the
response of the initial (SFT) policy and its advantage (or reward) score. Extra fields are kept
and carried into ``OUT.selected.jsonl``. Everything is checked before any heavy work starts, so a
bad file fails in a second with its file and line, never after the embeddings.

Duplicate prompts (exact string equality) are an error by default, naming both lines: two
responses to one prompt mean the file is not "one SFT response per PPO prompt", and silently
keeping both would let one prompt fill a cluster's quota. With ``dedupe=True`` the record with the
highest score is kept (the earlier line on a tie) and the others are reported as duplicates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from megatron_rlhf.utils import InputError, read_jsonl, require_finite


@dataclass(kw_only=True)
class ScoredRecords:
    """The kept records of one scored JSONL file, in input order."""

    path: str
    """The file they were read from."""
    records: list[dict]
    """The input objects, unchanged (extra fields included)."""
    line_numbers: list[int]
    """1-based line of each kept record in ``path``."""
    scores: np.ndarray
    """(N,) float64 advantage/reward score of each record."""
    entropies: np.ndarray | None = None
    """(N,) float64 mean token entropy of each response, when requested and present."""
    duplicates: list[tuple[int, int]] = field(default_factory=list)
    """(dropped line, index of the kept record with the same prompt), when ``dedupe`` was on."""

    def __len__(self) -> int:
        return len(self.records)

    @property
    def prompts(self) -> list[str]:
        return [record["prompt"] for record in self.records]

    @property
    def responses(self) -> list[str]:
        return [record["response"] for record in self.records]


def load_scored_records(
    path: str | os.PathLike, *, dedupe: bool = False, entropy_field: str | None = None
) -> ScoredRecords:
    """Read ``path``; raise ``InputError`` naming ``file:line`` for any record that cannot be used.

    ``entropy_field``: when set, every record must carry a finite number under that key (used to
    filter or rank by entropy); otherwise the field is ignored.
    """
    kept: list[dict] = []
    lines: list[int] = []
    scores: list[float] = []
    entropies: list[float] = []
    duplicates: list[tuple[int, int]] = []
    index_of_prompt: dict[str, int] = {}
    for line, record in read_jsonl(path):
        where = f"{path}:{line}"
        prompt, response = record.get("prompt"), record.get("response")
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f"{where}: 'prompt' is missing or empty; every record needs a prompt")
        if not isinstance(response, str) or not response.strip():
            raise InputError(
                f"{where}: 'response' is missing or empty; there is nothing to rehearse, drop it"
            )
        if "score" not in record:
            raise InputError(f"{where}: no 'score'; score the responses first (`score` command)")
        score = require_finite(record["score"], f"{where}: 'score'")
        entropy = None
        if entropy_field is not None:
            if entropy_field not in record:
                raise InputError(
                    f"{where}: no {entropy_field!r} field, needed to filter or rank by entropy; "
                    "add it to every record or drop --rank-by entropy / --max-entropy"
                )
            entropy = require_finite(record[entropy_field], f"{where}: {entropy_field!r}")
        if prompt in index_of_prompt:
            first = index_of_prompt[prompt]
            if not dedupe:
                raise InputError(
                    f"{where}: duplicate prompt (same text as line {lines[first]}); keep one "
                    "response per prompt, or pass --dedupe to keep the highest-scored one"
                )
            if score > scores[first]:
                duplicates.append((lines[first], first))
                kept[first], lines[first], scores[first] = record, line, score
                if entropy is not None:
                    entropies[first] = entropy
            else:
                duplicates.append((line, first))
            continue
        index_of_prompt[prompt] = len(kept)
        kept.append(record)
        lines.append(line)
        scores.append(score)
        if entropy is not None:
            entropies.append(entropy)
    if not kept:
        raise InputError(f"{path}: no records; expected one JSON object per line")
    return ScoredRecords(
        path=str(path),
        records=kept,
        line_numbers=lines,
        scores=np.asarray(scores, dtype=np.float64),
        entropies=np.asarray(entropies, dtype=np.float64) if entropy_field else None,
        duplicates=duplicates,
    )


def response_finished(records: list[dict], eos_id: int | None) -> np.ndarray:
    """(N,) bool: did each response end on its own, rather than at the generation limit?

    A record's ``finished`` field (written by ``generate``) decides; without it, the last of its
    ``response_token_ids`` being EOS; without either (text from elsewhere, e.g. human SFT data)
    the response counts as complete.
    """
    flags = []
    for record in records:
        if isinstance(record.get("finished"), bool):
            flags.append(record["finished"])
        elif record.get("response_token_ids"):
            flags.append(eos_id is not None and record["response_token_ids"][-1] == eos_id)
        else:
            flags.append(True)
    return np.array(flags, dtype=bool)
