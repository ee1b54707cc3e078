"""Triton kernels for per-token log-prob statistics over a (vocab shard of) logits.

Each row of ``x`` (n, V) is one token. The statistics kernel makes one pass over its slice of the
vocabulary with fp32 accumulators (online max and sum-exp, rescaled block by block) and writes, per
vocabulary split, the four numbers that ``logprobs.merge_stats`` combines across splits and TP
ranks (``logprobs.STATS``: max, sum-exp, centred mean, target logit or 0). The gradient kernel
recomputes the softmax block by block from the logits and the saved global log-sum-exp; nothing
of size V is ever stored besides the gradient itself.

Only imported when triton is; see ``_dispatch.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary entries a program holds at a time
TARGET_PROGRAMS = 1024  # split the vocabulary until about this many programs run


@triton.jit
def _stats_kernel(
    x_ptr,  # (n, V) logits, last dim contiguous
    targets_ptr,  # (n,) int64 target id inside this shard, or -1
    out_ptr,  # (n_split, 4, n) fp32
    n_rows,
    vocab,
    row_stride,
    blocks_per_program,
    inv_temp,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * row_stride
    target = tl.load(targets_ptr + row)
    first = split * blocks_per_program * BLOCK_V
    # sum_exp = sum exp(x - running_max); sum_exp_shift = sum exp(x - running_max)*(x - running_max)
    running_max = tl.full((), -1e30, tl.float32)  # logprobs.EMPTY_MAX
    sum_exp = 0.0
    sum_exp_shift = 0.0
    target_logit = 0.0
    for block in range(0, blocks_per_program):
        offs = first + block * BLOCK_V + tl.arange(0, BLOCK_V)
        valid = offs < vocab
        x = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        new_max = tl.maximum(running_max, tl.max(x, 0))
        rescale = tl.exp(running_max - new_max)
        shifted = x - new_max
        e = tl.exp(shifted)  # 0 on padding lanes and -inf logits
        if WITH_ENTROPY:
            moved = (running_max - new_max) * sum_exp  # re-centre the old terms on new_max
            block_term = tl.sum(tl.where(e > 0, e * shifted, 0.0), 0)
            sum_exp_shift = rescale * (sum_exp_shift + moved) + block_term
        sum_exp = sum_exp * rescale + tl.sum(e, 0)
        target_logit += tl.sum(tl.where(offs == target, x, 0.0), 0)
        running_max = new_max
    out = out_ptr + split * 4 * n_rows + row
    tl.store(out, running_max)
    tl.store(out + n_rows, sum_exp)
    tl.store(out + 2 * n_rows, tl.where(sum_exp > 0, sum_exp_shift / sum_exp, 0.0))
    tl.store(out + 3 * n_rows, target_logit)


@triton.jit
def _grad_kernel(
    x_ptr,  # (n, V) logits
    grad_ptr,  # (n, V) gradient wrt the logits, written in its dtype
    targets_ptr,  # (n,) int64 target id inside this shard, or -1
    lse_ptr,  # (n,) fp32 global log-sum-exp
    entropy_ptr,  # (n,) fp32 (entropy only)
    grad_logprob_ptr,  # (n,) fp32
    grad_entropy_ptr,  # (n,) fp32 (entropy only)
    vocab,
    x_row_stride,
    grad_row_stride,
    inv_temp,
    BLOCK_V: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < vocab
    row64 = row.to(tl.int64)
    x = tl.load(x_ptr + row64 * x_row_stride + offs, mask=valid, other=0.0).to(tl.float32)
    x = x * inv_temp
    log_p = x - tl.load(lse_ptr + row)
    p = tl.exp(log_p)
    grad_logprob = tl.load(grad_logprob_ptr + row)
    # d log p(target) / dx = onehot(target) - p
    grad = tl.where(offs == tl.load(targets_ptr + row), grad_logprob, 0.0) - p * grad_logprob
    if WITH_ENTROPY:
        # d entropy / dx = -p * (log p + entropy)
        entropy = tl.load(entropy_ptr + row)
        grad -= tl.where(p > 0, p * (log_p + entropy), 0.0) * tl.load(grad_entropy_ptr + row)
    out = grad_ptr + row64 * grad_row_stride + offs
    tl.store(out, (grad * inv_temp).to(grad_ptr.dtype.element_ty), mask=valid)


def rows_stats(
    x: torch.Tensor,  # (n, V)
    local_targets: torch.Tensor,  # (n,) int64, -1 where the target is not in this shard
    inv_temp: float,
    with_entropy: bool,
) -> torch.Tensor:
    """Partial statistics ``(n_split, 4, n)`` of each row over vocabulary splits."""
    n_rows, vocab = x.shape
    block_v = min(BLOCK_V, triton.next_power_of_2(vocab))
    n_blocks = triton.cdiv(vocab, block_v)
    wanted_splits = max(1, min(n_blocks, triton.cdiv(TARGET_PROGRAMS, max(n_rows, 1))))
    blocks_per_program = triton.cdiv(n_blocks, wanted_splits)
    n_split = triton.cdiv(n_blocks, blocks_per_program)
    out = torch.empty((n_split, 4, n_rows), dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return out
    _stats_kernel[(n_rows, n_split)](
        x,
        local_targets,
        out,
        n_rows,
        vocab,
        x.stride(0),
        blocks_per_program,
        inv_temp,
        BLOCK_V=block_v,
        WITH_ENTROPY=with_entropy,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out


def rows_grad(
    x: torch.Tensor,  # (n, V)
    grad_out: torch.Tensor,  # (n, V) written
    local_targets: torch.Tensor,  # (n,)
    lse: torch.Tensor,  # (n,) fp32
    entropy: torch.Tensor,  # (n,) fp32
    grad_logprob: torch.Tensor,  # (n,) fp32
    grad_entropy: torch.Tensor | None,  # (n,) fp32
    inv_temp: float,
) -> None:
    """Write the gradient of ``sum(grad_logprob * logp + grad_entropy * H)`` wrt ``x``."""
    n_rows, vocab = x.shape
    if n_rows == 0:
        return
    block_v = min(BLOCK_V, triton.next_power_of_2(vocab))
    with_entropy = grad_entropy is not None
    _grad_kernel[(n_rows, triton.cdiv(vocab, block_v))](
        x,
        grad_out,
        local_targets,
        lse,
        entropy,
        grad_logprob,
        grad_entropy if with_entropy else grad_logprob,
        vocab,
        x.stride(0),
        grad_out.stride(0),
        inv_temp,
        BLOCK_V=block_v,
        WITH_ENTROPY=with_entropy,
        num_warps=8 if block_v >= 2048 else 4,
    )
