"""Reading the RM / AM scalars off the BLOOM trunk's scalar head: pure tensor ops.

The reward and advantage models are one :class:`~megatron_rlhf.models.bloom.BloomModel` with
``head="scalar"``: output channel 0 is r(x, y), read at the last token of (x, y); the AM has a
second channel 1, e_τ(x) of Eq. 7, read at the last prompt token (causal attention makes that
hidden state a function of x alone, so the same forward pass gives both). Sequences are
right-padded prompt + response rows; a preference pair is two rows (chosen, rejected) that share
the prompt, stacked as all chosen rows then all rejected rows so that one forward scores both.

No I/O and no torch.distributed: tensors in, tensors out.
"""

from __future__ import annotations

import torch

REWARD_CHANNEL = 0
"""Scalar-head output holding r(x, y)."""
EXPECTED_REWARD_CHANNEL = 1
"""Scalar-head output holding e_τ(x) (Advantage Model only)."""
NUM_OUTPUTS = {"rm": 1, "am": 2}
"""Scalar-head width per model type."""


def last_token_positions(padding_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last real token of each row of a (B, S) 0/1 mask (any padding side)."""
    positions = torch.arange(padding_mask.shape[1], device=padding_mask.device)  # (S,)
    if not bool(padding_mask.bool().any(dim=1).all()):
        raise ValueError("every row needs at least one real token")
    return torch.where(padding_mask.bool(), positions, -1).max(dim=1).values


def gather_positions(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """values (B, S) at one position per row, positions (B,) -> (B,)."""
    return values.gather(1, positions.long().unsqueeze(1)).squeeze(1)


def read_scalars(
    output: torch.Tensor, padding_mask: torch.Tensor, prompt_lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """r at the last real token and, for a 2-output head, e_τ at the last prompt token.

    output:         (B, S, n) scalar-head outputs, n = 1 (RM) or 2 (AM).
    padding_mask:   (B, S) 1 on prompt and response tokens, 0 on padding.
    prompt_lengths: (B,) tokens of x in each row, x first (needed when n = 2).
    Returns r (B,) and e_τ (B,) or None for an RM.
    """
    rewards = gather_positions(output[..., REWARD_CHANNEL], last_token_positions(padding_mask))
    if output.shape[-1] == 1:
        return rewards, None
    if prompt_lengths is None:
        raise ValueError("an Advantage Model output needs prompt_lengths to read e_τ(x)")
    expected = gather_positions(output[..., EXPECTED_REWARD_CHANNEL], prompt_lengths - 1)
    return rewards, expected


def read_packed_scalars(
    output: torch.Tensor, last_positions: torch.Tensor, prompt_ends: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`read_scalars` for sequences packed into one row (data/packing.py).

    output:         (1, T, n) scalar-head outputs of the packed row.
    last_positions: (k,) index of each sequence's last token in the row.
    prompt_ends:    (k,) index of each sequence's last prompt token (read when n = 2).
    Returns r (k,) and e_τ (k,) or None for an RM.
    """
    rewards = output[0, last_positions, REWARD_CHANNEL]
    if output.shape[-1] == 1:
        return rewards, None
    return rewards, output[0, prompt_ends, EXPECTED_REWARD_CHANNEL]


def advantage_scores(rewards: torch.Tensor, expected: torch.Tensor | None) -> torch.Tensor:
    """The score an RM/AM gives a response: r for an RM, a = r - e_τ(x) for an AM (Eqs. 5, 7).

    Eq. 8's importance-weighted terms correct for the policies that collected the training
    comparisons; a response scored later has no such terms, so its advantage is r - e_τ(x).
    """
    return rewards if expected is None else rewards - expected


def pair_rows(batch: dict) -> dict:
    """A :func:`~megatron_rlhf.data.collate_preference` batch of P pairs as one (2P, S) forward.

    Returns ``input_ids`` and ``padding_mask`` (2P, S), chosen rows first; ``prompt_lengths``
    (2P,); plus, when present, ``task_ids`` (P,) and ``chosen_logprobs`` /
    ``rejected_logprobs`` (P, K) unchanged.
    """
    rows = {
        "input_ids": torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]]),
        "padding_mask": torch.cat(
            [batch["chosen_attention_mask"], batch["rejected_attention_mask"]]
        ),
        "prompt_lengths": batch["prompt_lengths"].repeat(2),
    }
    for name in ("task_ids", "chosen_logprobs", "rejected_logprobs", "index"):
        if name in batch:
            rows[name] = batch[name]
    return rows


def split_pairs(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(2P,) stacked as in :func:`pair_rows` -> chosen (P,), rejected (P,)."""
    pairs = values.shape[0] // 2
    return values[:pairs], values[pairs:]


def pad_columns(rows: dict, width: int, pad_id: int) -> dict:
    """Right-pad ``input_ids`` (with pad_id) and ``padding_mask`` (with 0) to ``width`` columns.

    All microbatches of one pipelined step need the same shape.
    """
    extra = width - rows["input_ids"].shape[1]
    if extra < 0:
        raise ValueError(f"rows are {rows['input_ids'].shape[1]} wide, more than {width}")
    padded = dict(rows)
    padded["input_ids"] = torch.nn.functional.pad(rows["input_ids"], (0, extra), value=pad_id)
    padded["padding_mask"] = torch.nn.functional.pad(rows["padding_mask"], (0, extra), value=0)
    return padded


def pack_pairs(rows: dict) -> dict:
    """:func:`pair_rows` (2P, S) packed into one row (1, T): ``input_ids``, ``padding_mask``
    (each sequence's id), ``last_positions`` and ``prompt_ends`` (2P,) for
    :func:`read_packed_scalars`, and the pairs' other fields unchanged."""
    from megatron_rlhf.data.packing import pack_rows

    packed = pack_rows(rows["input_ids"], rows["padding_mask"])
    kept = {
        k: v for k, v in rows.items() if k not in ("input_ids", "padding_mask", "prompt_lengths")
    }
    return {
        **kept,
        "input_ids": packed.input_ids,
        "padding_mask": packed.segments,
        "last_positions": packed.starts + packed.lengths - 1,
        "prompt_ends": packed.starts + rows["prompt_lengths"] - 1,
    }


def collate_pairs(chunks: list[list[dict]], pad_id: int, width_multiple: int = 1) -> list[dict]:
    """PreferenceDataset items grouped per microbatch -> :func:`pair_rows` microbatches, all
    right-padded to one width (the longest pair, rounded up to ``width_multiple``)."""
    from megatron_rlhf.data import collate_preference

    rows = [pair_rows(collate_preference(chunk, pad_id)) for chunk in chunks]
    width = max(r["input_ids"].shape[1] for r in rows)
    width = -(-width // width_multiple) * width_multiple
    return [pad_columns(r, width, pad_id) for r in rows]
