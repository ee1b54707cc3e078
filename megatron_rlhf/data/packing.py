"""Sequence packing: the real tokens of several rows back to back in one row, no padding.

A packed row's key mask holds each sequence's id (``1 1 1 2 2 3``); ``BloomModel`` turns it into
causal attention within each sequence with ALiBi positions restarting at each one (Megatron-
Core's THD layout on the PyTorch attention path, a block-diagonal mask elsewhere), so every
token gets the output it has in its own (padded) row. Packs are formed by a token budget,
from consecutive rows (:func:`pack_by_budget`) or first-fit decreasing (:func:`pack_first_fit`),
after a global batch is split over data-parallel ranks by tokens (:func:`balance_by_tokens`);
all deterministic; a row longer than the budget forms a pack alone.
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
    # row-major: row 0's tokens, then row 1's, ...
    return _packed(input_ids[real][None], lengths)


def pack_sequences(sequences: list[torch.Tensor]) -> PackedRows:
    """Pack 1-D token sequences of any lengths (no padding to strip)."""
    lengths = torch.tensor([len(ids) for ids in sequences], device=sequences[0].device)
    return _packed(torch.cat(sequences)[None], lengths)


def _packed(ids: torch.Tensor, lengths: torch.Tensor) -> PackedRows:
    if bool((lengths == 0).any()):
        raise ValueError("every packed row needs at least one real token")
    segments = torch.repeat_interleave(
        torch.arange(1, lengths.shape[0] + 1, device=ids.device), lengths
    )[None]
    starts = torch.cumsum(lengths, dim=0) - lengths
    return PackedRows(input_ids=ids, segments=segments, starts=starts, lengths=lengths)


def balance_by_tokens(
    lengths: list[int], parts: int, loads: list[int] | None = None
) -> list[list[int]]:
    """Indices of ``lengths`` split into ``parts`` groups of about equal total length (the
    data-parallel ranks' shares of a global batch): longest first, each onto the group with the
    fewest tokens so far (ties: the lower group; ``loads``: tokens the groups start with);
    each group in index order. Deterministic, and every group gets an item when there are at
    least ``parts`` and no starting loads."""
    loads, groups = list(loads or [0] * parts), [[] for _ in range(parts)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        lightest = min(range(parts), key=lambda g: (loads[g], g))
        groups[lightest].append(index)
        loads[lightest] += lengths[index]
    return [sorted(group) for group in groups]


def pack_first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into packs of at most ``budget`` tokens, first-fit
    decreasing (fuller packs than :func:`pack_by_budget`, so fewer micro-batches); an item
    longer than the budget forms a pack alone. Each pack in index order; deterministic."""
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    packs: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = next((p for p, free in enumerate(room) if free >= lengths[index]), None)
        if fits is None:
            packs.append([])
            room.append(budget)
            fits = len(packs) - 1
        packs[fits].append(index)
        room[fits] -= lengths[index]
    return [sorted(pack) for pack in packs]


def pad_pack(packed: PackedRows, width: int, pad_id: int) -> PackedRows:
    """``packed`` right-padded to ``width`` tokens (segment id 0: attends to nothing, read by
    nothing), e.g. so that every micro-batch of a pipelined step has one shape."""
    extra = width - packed.input_ids.shape[1]
    if extra < 0:
        raise ValueError(f"a pack of {packed.input_ids.shape[1]} tokens is wider than {width}")
    pad = torch.nn.functional.pad
    return PackedRows(
        input_ids=pad(packed.input_ids, (0, extra), value=pad_id),
        segments=pad(packed.segments, (0, extra), value=0),
        starts=packed.starts,
        lengths=packed.lengths,
    )
