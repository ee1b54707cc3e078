"""ALiBi (Press et al., 2022) exactly as transformers' ``build_alibi_tensor`` computes it.

BLOOM adds ``slope_h * pos_k`` to the attention scores of head h, where ``pos_k`` is the position
of key k counted from the first *real* token of its row: ``pos = (cumsum(mask) - 1) * mask``.
A left-padded row therefore gets the same bias as the same row without padding.
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The fp32 ALiBi slope of every head, shape (num_heads,).

    For ``n = 2**floor(log2(H))`` the first n slopes are ``base**1..n`` with
    ``base = 2**(-8/n)``; if H is not a power of two, the remaining ``H - n`` slopes are the odd
    powers ``(2**(-4/n))**(1, 3, 5, ...)`` (BLOOM-176B: 64 + 48 heads).
    """
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), dtype=torch.float32
        )
        num_remaining = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)
    return slopes


def alibi_slopes_for_rank(num_heads: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The slopes of the contiguous block of heads that tensor-parallel rank ``tp_rank`` holds."""
    heads_per_rank = num_heads // tp_size
    return alibi_slopes(num_heads)[tp_rank * heads_per_rank : (tp_rank + 1) * heads_per_rank]


def positions_from_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """Key positions (B, S) counted over the real tokens of each row, from 0 at its first; 0 on
    padding. ``key_mask`` is 0 on padding and 1, or, for sequences packed in one row, the
    sequence's id (increasing along the row), on real tokens: positions restart at each id."""
    segments = key_mask.to(torch.long)
    valid = (segments > 0).long()
    counted = valid.cumsum(dim=-1) - 1  # index among the row's real tokens
    seen = torch.cummax(segments, dim=-1).values  # the largest id so far
    before = torch.nn.functional.pad(seen[:, :-1], (1, 0))  # ... before this column
    starts = (segments > before) & (valid > 0)  # first token of a sequence
    first = torch.where(starts, counted, torch.zeros_like(counted))
    return (counted - torch.cummax(first, dim=-1).values) * valid
