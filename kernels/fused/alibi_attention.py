"""BLOOM's causal ALiBi attention as one fused Triton kernel (``triton_alibi_attention.py``).

    scores = (q . k) * scale + slope_h * (pos_k - pos_q)      (fp32, relative to the query)
    out    = softmax_fp32(scores where query i may see key j) @ v

the math of ``models/bloom/attention.py``'s ``alibi_attention`` (the PyTorch reference path),
with O(S) extra memory: the forward saves the log-sum-exp of each query row, the backward
recomputes the probabilities block by block. Two layouts, as the BLOOM model produces them:

- :func:`fused_alibi_attention`: (S, B, H, D) batches with per-token key positions (counted from
  each row's first real token, what ``BloomModel`` passes) and segment ids (the key mask: 0 =
  padding, 1, or a packed sequence's id). Query i (the last Sq tokens) sees key j when j <= i, j
  is real, and both belong to one sequence or the query is padding: ``attention_mask_for``'s mask.
  A query that sees no key (left padding before the first real token) gets the mean of every
  value, which is what the PyTorch path's fully masked softmax row gives.
- :func:`fused_packed_alibi_attention`: Megatron's THD rows with ``cu_seqlens``; positions restart
  at each sequence, and tokens after ``cu_seqlens[-1]`` get zeros (``packed_alibi_attention``).

Slopes are this tensor-parallel rank's (H,) fp32 slice. No dropout: callers take the PyTorch path
when attention dropout is active.
"""

from __future__ import annotations

import torch

from ._dispatch import use_triton


def fused_alibi_available(query: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for ``query`` (a CUDA tensor with a working Triton, or any
    tensor under ``TRITON_INTERPRET=1``)."""
    return query.dtype in (torch.float32, torch.bfloat16, torch.float16) and use_triton(query)


def fused_alibi_attention(
    query: torch.Tensor,  # (Sq, B, H, D)
    key: torch.Tensor,  # (Sk, B, H, D)
    value: torch.Tensor,  # (Sk, B, H, D)
    key_positions: torch.Tensor,  # (B, Sk) positions from each row's (sequence's) first token
    key_segments: torch.Tensor,  # (B, Sk) 0 = padding, else the token's sequence id
    slopes: torch.Tensor,  # (H,) fp32, this TP rank's
    softmax_scale: float,
    loop_bounds: torch.Tensor | None = None,  # (B, 2, Sk): alibi_loop_bounds(key_segments)
) -> torch.Tensor:
    """Causal ALiBi attention of the last Sq of Sk tokens; returns (Sq, B, H*D).

    ``loop_bounds`` depends on the mask only: a model passes the one it built once per forward
    (:func:`alibi_loop_bounds`, any dtype that holds integers exactly) instead of every layer
    rebuilding it (about ten small kernels a layer)."""
    seq_q, batch, heads, dim = query.shape
    seq_k = key.shape[0]
    if key.shape != (seq_k, batch, heads, dim) or value.shape != key.shape or seq_q > seq_k:
        raise ValueError(
            f"fused_alibi_attention: query (Sq, B, H, D) and key/value (Sk, B, H, D) with "
            f"Sq <= Sk; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if slopes.shape != (heads,):
        raise ValueError(
            f"fused_alibi_attention: {heads} heads but {slopes.numel()} slopes; pass this "
            "tensor-parallel rank's slice (alibi_slopes_for_rank)"
        )
    segments = key_segments.to(torch.int32)
    if loop_bounds is None:
        loop_bounds = alibi_loop_bounds(segments)
    if loop_bounds.shape != (batch, 2, seq_k):
        raise ValueError(
            f"fused_alibi_attention: loop_bounds must be (B, 2, Sk) = {(batch, 2, seq_k)} "
            f"(alibi_loop_bounds of the key segments), got {tuple(loop_bounds.shape)}"
        )
    first_key, last_query = (b.to(torch.int32).contiguous() for b in loop_bounds.unbind(1))
    out = _FusedAlibiAttention.apply(
        *(_unit_last_stride(t) for t in (query, key, value)),
        slopes.float().contiguous(),
        key_positions.float().contiguous(),
        segments.contiguous(),
        first_key,
        last_query,
        softmax_scale,
    )
    # the PyTorch path's fully masked row is uniform over all Sk keys (no host sync to skip it)
    blind = _queries_seeing_nothing(segments, seq_q)  # (B, Sq)
    mean = value.mean(0, dtype=torch.float32).to(value.dtype)  # (B, H, D), no fp32 copy of V
    out = torch.where(blind.T[:, :, None, None], mean[None], out)
    return out.reshape(seq_q, batch, heads * dim)


def fused_packed_alibi_attention(
    query: torch.Tensor,  # (T, H, D): sequences back to back (Megatron's THD layout)
    key: torch.Tensor,  # (T, H, D)
    value: torch.Tensor,  # (T, H, D)
    cu_seqlens: torch.Tensor,  # (k + 1,) where each sequence starts, then the end of the last
    slopes: torch.Tensor,  # (H,) fp32
    softmax_scale: float,
) -> torch.Tensor:
    """Each sequence's causal ALiBi attention alone; zeros after ``cu_seqlens[-1]``. Returns
    (T, 1, H*D)."""
    total, heads, dim = query.shape
    bounds = cu_seqlens.to(device=query.device, dtype=torch.long)
    real = int(bounds[-1])
    tokens = torch.arange(real, device=query.device)
    sequence = torch.bucketize(tokens, bounds[1:], right=True)  # 0-based sequence of each token
    positions = (tokens - bounds[sequence]).float()[None]  # (1, real)
    segments = (sequence + 1).to(torch.int32)[None]
    out = fused_alibi_attention(
        *(t[:real, None] for t in (query, key, value)), positions, segments, slopes, softmax_scale
    )  # (real, 1, H*D)
    if real < total:
        out = torch.cat([out, out.new_zeros(total - real, 1, heads * dim)])
    return out


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def alibi_loop_bounds(key_segments: torch.Tensor) -> torch.Tensor:
    """The kernel's loop bounds per token, (B, 2, Sk) int32: [:, 0] the first key a token may see
    as a query (its sequence's first token; 0 for padding), [:, 1] the end, exclusive, of the
    queries that may see it as a key (its sequence's end, or Sk when a padding token follows it,
    since padding queries see every real key before them; 0 for padding keys).

    Bounds only: the kernel still masks every score, so they may cover more than is seen, never
    less. A sequence starts where the id exceeds every id before it, as ``positions_from_mask``
    counts positions: a row with padding inside one sequence (``1 1 1 0 0 1 1``) is one sequence
    whose later tokens see the earlier ones (``attention_mask_for``). Starting a sequence at each
    run of an id made those queries skip keys they see (an output off by ~1 in the interpreter)."""
    segments = key_segments.to(torch.int32)
    batch, seq = segments.shape
    index = torch.arange(seq, device=segments.device).expand(batch, seq)
    real = segments > 0
    before = torch.nn.functional.pad(segments.cummax(-1).values[:, :-1], (1, 0))
    starts = real & (segments > before)
    first_key = torch.where(starts, index, 0).cummax(-1).values * real
    following = torch.nn.functional.pad(segments[:, 1:], (0, 1))
    ends = torch.where(real & (segments != following), index + 1, seq)
    seq_end = ends.flip(-1).cummin(-1).values.flip(-1)  # the end of the run holding j
    padding_after = (~real).flip(-1).long().cumsum(-1).flip(-1) > 0
    last_query = torch.where(padding_after, seq, seq_end) * real
    return torch.stack([first_key, last_query], 1).to(torch.int32)


def _queries_seeing_nothing(segments: torch.Tensor, seq_q: int) -> torch.Tensor:
    """(B, Sq) True for padding queries with no real key at or before them."""
    real_so_far = (segments > 0).long().cumsum(-1)[:, -seq_q:]
    return (segments[:, -seq_q:] == 0) & (real_so_far == 0)


class _FusedAlibiAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, positions, segments, first_key, last_query, scale):
        from . import triton_alibi_attention as kernel

        out, lse = kernel.forward(q, k, v, slopes, positions, segments, first_key, scale)
        ctx.save_for_backward(q, k, v, out, lse, slopes, positions, segments, first_key, last_query)
        ctx.scale = scale
        return out  # (Sq, B, H, D)

    @staticmethod
    def backward(ctx, grad_out):
        from . import triton_alibi_attention as kernel

        q, k, v, out, lse, slopes, positions, segments, first_key, last_query = ctx.saved_tensors
        dq, dk, dv = kernel.backward(
            q, k, v, out, grad_out.contiguous(), lse, slopes, positions, segments, first_key,
            last_query, ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None
