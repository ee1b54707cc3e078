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


def positions_from_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """Key positions (B, S) counted from each row's first valid token; 0 on padding."""
    key_valid = key_valid.to(torch.long)
    return (key_valid.cumsum(dim=-1) - 1) * key_valid
