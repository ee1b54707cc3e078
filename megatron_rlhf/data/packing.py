"""Sequence packing: the real tokens of several rows back to back in one row, no padding.

A packed row's key mask holds each sequence's id (``1 1 1 2 2 3``); ``BloomModel`` turns it into
block-diagonal causal attention with ALiBi positions restarting at each sequence, so every token
gets the output it has in its own (padded) row. Packs are formed from consecutive rows by a
token budget (deterministic); a row longer than the budget forms a pack alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pack_by_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive row indices grouped greedily into packs of at most ``budget`` tokens."""
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    packs: list[list[int]] = []
    used = budget  # start a new pack at the first row
    for row, length in enumerate(lengths):
        if used + length > budget:
            packs.append([])
            used = 0
        packs[-1].append(row)
        used += length
    return packs


@dataclass
class PackedRows:
    """Rows packed into one: ids and sequence-id mask (1, T), and where each row starts."""

    input_ids: torch.Tensor  # (1, T)
    segments: torch.Tensor  # (1, T) 1..k, the key mask BloomModel takes
    starts: torch.Tensor  # (k,) index of each row's first token in the pack
    lengths: torch.Tensor  # (k,) real tokens of each row


def pack_rows(input_ids: torch.Tensor, mask: torch.Tensor) -> PackedRows:
    """Pack rows (k, S) whose real tokens (``mask`` 1) are contiguous (left or right padding)."""
    real = mask.bool()
    lengths = real.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError("every packed row needs at least one real token")
    ids = input_ids[real][None]  # row-major: row 0's tokens, then row 1's, ...
    segments = torch.repeat_interleave(
        torch.arange(1, lengths.shape[0] + 1, device=ids.device), lengths
    )[None]
    starts = torch.cumsum(lengths, dim=0) - lengths
    return PackedRows(input_ids=ids, segments=segments, starts=starts, lengths=lengths)
