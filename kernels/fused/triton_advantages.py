"""Triton kernels for the per-token PPO quantities: KL estimates, shaped rewards and GAE.

One program per sequence for the row-wise ones, all sequences in one launch. GAE walks the
sequence from its end in blocks of ``BLOCK_T`` tokens: inside a block the recurrence
``A_t = delta_t + gamma*lam*m_{t+1}*A_{t+1}`` is a composition of affine maps, evaluated with
``tl.associative_scan`` (log-depth, exact), and the advantage at the block's first token carries
into the next block. The block is loaded in descending position order so that a forward scan does
the backward recursion (no reliance on the ``reverse=`` operand order).

Only imported when triton is; see ``_dispatch.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KL_KIND_IDS = {"k1": 0, "k2": 1, "k3": 2, "abs": 3}
BLOCK_ELEMENTS = 1024  # elements per program of the elementwise KL kernel
BLOCK_T = 1024  # tokens per step of the row kernels


@triton.jit
def _kl_kernel(logprobs_ptr, ref_ptr, out_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    # fp64: k3 = exp(-r) + r - 1 cancels badly in fp32 for small log-ratios r
    log_ratio = tl.load(logprobs_ptr + offs, mask=valid, other=0.0).to(tl.float64) - tl.load(
        ref_ptr + offs, mask=valid, other=0.0
    ).to(tl.float64)
    if KIND == 0:
        kl = log_ratio
    elif KIND == 1:
        kl = 0.5 * log_ratio * log_ratio
    elif KIND == 2:
        # exp(-r) + r - 1; its Taylor series where the direct form would cancel
        r = log_ratio
        series = r * r * (0.5 - r * (1.0 / 6.0 - r * (1.0 / 24.0 - r / 120.0)))
        kl = tl.where(tl.abs(r) < 1e-2, series, tl.exp(-r) + r - 1.0)
    else:
        kl = tl.abs(log_ratio)
    tl.store(out_ptr + offs, kl.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _shaped_rewards_kernel(
    scores_ptr, kl_ptr, mask_ptr, out_ptr, seq_len, beta, BLOCK_T: tl.constexpr
):
    row = tl.program_id(0)
    base = row.to(tl.int64) * seq_len
    lanes = tl.arange(0, BLOCK_T)
    last = -1
    for start in range(0, seq_len, BLOCK_T):
        pos = start + lanes
        m = tl.load(mask_ptr + base + pos, mask=pos < seq_len, other=0.0)
        last = tl.maximum(last, tl.max(tl.where(m != 0, pos, -1), 0))
    score = tl.load(scores_ptr + row).to(tl.float32)
    for start in range(0, seq_len, BLOCK_T):
        pos = start + lanes
        valid = pos < seq_len
        m = tl.load(mask_ptr + base + pos, mask=valid, other=0.0)
        kl = tl.load(kl_ptr + base + pos, mask=valid, other=0.0).to(tl.float32)
        reward = tl.where(m != 0, -beta * kl, 0.0) + tl.where(pos == last, score, 0.0)
        tl.store(out_ptr + base + pos, reward, mask=valid)


@triton.jit
def _compose_affine(coef_later, value_later, coef_now, value_now):
    # A_now = value_now + coef_now * A_later, where A_later = value_later + coef_later * x
    return coef_later * coef_now, value_now + coef_now * value_later


@triton.jit
def _gae_kernel(
    rewards_ptr,
    values_ptr,
    mask_ptr,
    advantages_ptr,
    returns_ptr,
    discounts_ptr,  # (2,) fp64: gamma, gamma * lam
    seq_len,
    BLOCK_T: tl.constexpr,
):
    # fp64 inside: a product of up to T fp32-rounded gamma*lam would drift by ~T ulps
    row = tl.program_id(0)
    base = row.to(tl.int64) * seq_len
    lanes = tl.arange(0, BLOCK_T)
    gamma = tl.load(discounts_ptr)
    gamma_lam = tl.load(discounts_ptr + 1)
    carry = tl.full((), 0.0, tl.float64)  # advantage at the first token of the next block
    for block in range(0, tl.cdiv(seq_len, BLOCK_T)):
        pos = seq_len - 1 - block * BLOCK_T - lanes  # descending positions
        valid = pos >= 0
        has_next = valid & (pos + 1 < seq_len)
        m = tl.load(mask_ptr + base + pos, mask=valid, other=0.0).to(tl.float64)
        v = tl.load(values_ptr + base + pos, mask=valid, other=0.0).to(tl.float64)
        r = tl.load(rewards_ptr + base + pos, mask=valid, other=0.0).to(tl.float64)
        m_next = tl.load(mask_ptr + base + pos + 1, mask=has_next, other=0.0).to(tl.float64)
        v_next = tl.load(values_ptr + base + pos + 1, mask=has_next, other=0.0).to(tl.float64)
        delta = (r + gamma * v_next * m_next - v) * m
        coef, value = tl.associative_scan((gamma_lam * m_next, delta), 0, _compose_affine)
        advantage = value + coef * carry
        tl.store(advantages_ptr + base + pos, (advantage * m).to(tl.float32), mask=valid)
        tl.store(returns_ptr + base + pos, ((advantage + v) * m).to(tl.float32), mask=valid)
        carry = tl.sum(tl.where(lanes == BLOCK_T - 1, advantage, 0.0), 0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    logprobs, ref_logprobs = logprobs.contiguous(), ref_logprobs.contiguous()
    out = torch.empty_like(logprobs)
    n = logprobs.numel()
    if n:
        _kl_kernel[(triton.cdiv(n, BLOCK_ELEMENTS),)](
            logprobs, ref_logprobs, out, n, KIND=KL_KIND_IDS[kind], BLOCK=BLOCK_ELEMENTS
        )
    return out


def shaped_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    batch, seq_len = kl.shape
    out = torch.empty((batch, seq_len), dtype=torch.float32, device=kl.device)
    if out.numel():
        _shaped_rewards_kernel[(batch,)](
            scores.contiguous(),
            kl.contiguous(),
            mask.to(torch.float32).contiguous(),
            out,
            seq_len,
            beta,
            BLOCK_T=min(BLOCK_T, triton.next_power_of_2(seq_len)),
        )
    return out


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq_len = values.shape
    advantages = torch.empty((batch, seq_len), dtype=torch.float32, device=values.device)
    returns = torch.empty_like(advantages)
    if advantages.numel():
        _gae_kernel[(batch,)](
            rewards.to(torch.float32).contiguous(),
            values.to(torch.float32).contiguous(),
            (mask != 0).to(torch.float32),
            advantages,
            returns,
            torch.tensor([gamma, gamma * lam], dtype=torch.float64, device=values.device),
            seq_len,
            BLOCK_T=min(BLOCK_T, triton.next_power_of_2(seq_len)),
        )
    return advantages, returns
