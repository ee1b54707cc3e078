"""KL estimates, KL-shaped rewards, GAE and masked whitening for PPO (Eq. 2 of the paper).

All tensors are ``(B, T)`` over response positions; ``mask`` is nonzero on response tokens and
zero on padding, i.e. each row is ``0...0 1...1 0...0`` (left and/or right padding; a hole inside
a response is rejected, because peers disagree on what it should mean). On CUDA (or under
``TRITON_INTERPRET=1``) ``kl_penalty``, ``shaped_rewards`` and ``gae`` each run as one Triton
kernel over the whole batch; on CPU they are vectorised PyTorch with no Python loop over T.
``masked_whiten`` is two reductions and an all-reduce, left to PyTorch on every device. Outputs
are fp32 (fp64 for fp64 inputs, which always take the PyTorch path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._dispatch import use_triton

KL_KINDS = ("k1", "k2", "k3", "abs")
GAE_BLOCK = 32  # tokens per block of the CPU discounted sum (a (32, 32) matrix of powers)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_init) from the sampled tokens' log-probs (Eq. 2's term).

    With ``r = logprobs - ref_logprobs``: k1 = r, k2 = r^2 / 2, k3 = exp(-r) + r - 1 (Schulman's
    unbiased, non-negative estimator), abs = |r|. Computed in fp64 (k3 cancels badly in fp32).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl_penalty: kind must be one of {KL_KINDS}, got {kind!r}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty: logprobs {tuple(logprobs.shape)} and ref_logprobs "
            f"{tuple(ref_logprobs.shape)} differ in shape"
        )
    out_dtype = torch.promote_types(logprobs.dtype, torch.float32)
    if use_triton(logprobs) and out_dtype != torch.float64:
        from . import triton_advantages

        return triton_advantages.kl_penalty(logprobs.float(), ref_logprobs.float(), kind)
    log_ratio = logprobs.double() - ref_logprobs.double()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind == "k3":
        kl = torch.expm1(-log_ratio) + log_ratio
    else:
        kl = log_ratio.abs()
    return kl.to(out_dtype)


def shaped_rewards(
    scores: torch.Tensor,  # (B,) reward/advantage-model score of each response
    kl: torch.Tensor,  # (B, T) per-token KL estimate
    mask: torch.Tensor,  # (B, T) response mask
    beta: float,
) -> torch.Tensor:
    """Per-token rewards of Eq. 2: ``-beta * kl`` on response tokens, plus the score on the last.

    Padding gets 0; a row with no response token gets no score.
    """
    _check_rows("shaped_rewards", kl=kl, mask=mask)
    if scores.shape != kl.shape[:1]:
        raise ValueError(f"shaped_rewards: scores must be ({kl.shape[0]},), got {scores.shape}")
    dtype = torch.promote_types(kl.dtype, torch.float32)
    if kl.numel() == 0:
        return torch.zeros(kl.shape, dtype=dtype, device=kl.device)
    if use_triton(kl) and dtype != torch.float64:
        from . import triton_advantages

        return triton_advantages.shaped_rewards(scores, kl, mask, beta)
    valid = mask != 0
    rewards = torch.where(valid, -beta * kl.to(dtype), 0.0)  # (B, T)
    positions = torch.arange(kl.shape[1], device=kl.device)
    last = torch.where(valid, positions, -1).amax(1, keepdim=True)  # (B, 1), -1 when empty
    final_score = torch.where(last >= 0, scores.to(dtype)[:, None], 0.0)  # (B, 1)
    return rewards.scatter_add_(1, last.clamp(min=0), final_score)


def gae(
    rewards: torch.Tensor,  # (B, T)
    values: torch.Tensor,  # (B, T) critic values V(s_t)
    mask: torch.Tensor,  # (B, T) response mask
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016): ``(advantages, returns)``.

    ``delta_t = r_t + gamma*V_{t+1}*m_{t+1} - V_t`` (the value after the last response token is
    0), ``A_t = delta_t + gamma*lam*m_{t+1}*A_{t+1}``, ``returns = A + V``; both are 0 where the
    mask is 0. The CPU path evaluates the recursion as a discounted reverse cumulative sum with two
    small matmuls (exact: powers of gamma*lam only, no division), so there is no loop over T.
    """
    _check_rows("gae", rewards=rewards, values=values, mask=mask)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gae: gamma and lam must lie in [0, 1], got {gamma}, {lam}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    m = _nonzero_as(mask, dtype)  # (B, T) 1.0 on response tokens
    _check_mask_shape("gae", m)
    if use_triton(values) and dtype != torch.float64:
        from . import triton_advantages

        return triton_advantages.gae(rewards, values, mask, gamma, lam)
    v = values.to(dtype)
    deltas = rewards.to(dtype) - v  # (B, T), then + gamma * V_{t+1} m_{t+1} (0 after the end)
    deltas[:, :-1].addcmul_(v[:, 1:], m[:, 1:], value=gamma)
    deltas.mul_(m)
    # With the mask 0..01..10..0, A_t = sum_{j>=t} (gamma*lam)^(j-t) delta_j on response tokens.
    advantages = discounted_reverse_cumsum(deltas, gamma * lam).mul_(m)
    return advantages, torch.addcmul(advantages, v, m)


def discounted_reverse_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``out_t = sum_{j >= t} discount^(j-t) * x_j`` along dim 1 of ``(B, T)``, without a loop.

    Blocks of ``GAE_BLOCK`` tokens: one matmul with a (b, b) matrix of powers gives the sums up to
    each block's end, one with an (n_blocks, n_blocks) matrix of powers of ``discount^b`` gives
    the value at every block start, and a broadcast adds the discounted next block start.
    """
    batch, seq_len = x.shape
    block = max(1, min(GAE_BLOCK, seq_len))
    n_blocks = -(-seq_len // block)
    padded = F.pad(x, (0, n_blocks * block - seq_len)) if seq_len % block else x
    blocks = padded.view(batch, n_blocks, block)
    within = blocks @ _upper_powers(discount, block, 1, x).T  # (B, nb, b) sums to block end
    heads = within[:, :, 0] @ _upper_powers(discount, n_blocks, block, x).T  # (B, nb)
    next_heads = F.pad(heads[:, 1:], (0, 1))  # (B, nb) value at the next block's start
    steps_to_next = torch.arange(block, 0, -1, device=x.device, dtype=torch.float64)  # (b,)
    within.addcmul_(next_heads[:, :, None], (discount**steps_to_next).to(x.dtype))
    out = within.view(batch, n_blocks * block)
    return out if seq_len % block == 0 else out[:, :seq_len].contiguous()


def _upper_powers(discount: float, size: int, stride: int, like: torch.Tensor) -> torch.Tensor:
    """``P[i, j] = discount^(stride*(j-i))`` for ``j >= i``, else 0 (powers taken in fp64)."""
    index = torch.arange(size, device=like.device, dtype=torch.float64)
    gap = index[None, :] - index[:, None]  # (size, size)
    powers = discount ** (stride * gap.clamp(0))
    return torch.where(gap >= 0, powers, 0.0).to(like.dtype)


def masked_whiten(
    x: torch.Tensor,  # (B, T)
    mask: torch.Tensor,  # (B, T)
    group: dist.ProcessGroup | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries, 0 where the mask is 0.

    ``var`` is the unbiased (n - 1) variance, as TRL, OpenRLHF and verl use. With ``group`` (the
    data-parallel group) mean and variance are taken over every rank's entries, from one
    all-reduce of ``(sum, sum of squares, count)`` accumulated in fp64. With
    ``shift_mean=False`` the mean is added back (only the scale is normalised).
    """
    if x.shape != mask.shape:
        raise ValueError(f"masked_whiten: x {tuple(x.shape)} and mask {tuple(mask.shape)} differ")
    valid = (mask != 0).double()
    x64 = x.double()
    moments = torch.stack([(x64 * valid).sum(), (x64 * x64 * valid).sum(), valid.sum()])
    if group is not None:
        dist.all_reduce(moments, group=group)
    total, total_sq, count = moments.tolist()
    if count < 2:
        raise ValueError(f"masked_whiten: need at least 2 unmasked entries, got {count:.0f}")
    mean = total / count
    var = max(total_sq - count * mean * mean, 0.0) / (count - 1)
    whitened = (x64 - mean) / (var + eps) ** 0.5
    if not shift_mean:
        whitened += mean
    return (whitened * valid).to(torch.promote_types(x.dtype, torch.float32))


def _check_rows(name: str, **tensors: torch.Tensor) -> None:
    shapes = {key: tuple(t.shape) for key, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"{name}: expected tensors of one (B, T) shape, got {shapes}")


def _nonzero_as(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1 where ``mask`` is nonzero, else 0, in ``dtype`` (floating masks avoid a bool pass)."""
    if mask.is_floating_point():
        return mask.to(dtype).abs().sign()
    return (mask != 0).to(dtype)


def _check_mask_shape(name: str, m: torch.Tensor) -> None:
    """Each row of the 0/1 ``m`` must be 0...0 1...1 0...0: at most one run start."""
    if m.numel() == 0:
        return
    starts = m[:, 0] + (m[:, 1:] - m[:, :-1]).clamp_(min=0).sum(1)  # (B,)
    if starts.numel() and int(starts.max()) > 1:
        row = int(starts.argmax())
        raise ValueError(
            f"{name}: mask row {row} has a hole inside the response; each row must be "
            "0...0 1...1 0...0 (padding only before and after the response)"
        )
