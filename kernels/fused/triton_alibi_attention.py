"""Triton flash-attention forward and backward with BLOOM's query-relative ALiBi bias.

One program of the forward holds a block of ``BLOCK_M`` queries of one (batch row, head) (grid
axis 0: batch x heads, which may pass axis 1's 65,535; axis 1: the blocks of the row) and
streams the keys it may see in blocks of ``BLOCK_N``: scores ``q . k * scale`` in fp32 plus
``slope_h * (pos_k - pos_q)`` in fp32, the mask, then an online softmax (running max ``m`` and
sum ``l``, the accumulator rescaled when the max grows). It writes the output and the row's
log-sum-exp ``m + log l`` (fp32, O(S)): nothing of size S x S is ever stored.

Which keys a query sees comes from three per-token arrays of the batch row (``alibi_attention``
builds them; queries are the last Sq of the Sk tokens): ``segments`` (0 = padding, else the id of
the sequence the token belongs to), ``first_key`` (the first key a query may see; the key loop
starts at the block's smallest) and ``last_query`` (the end, exclusive, of the queries that may
see a key; the backward's query loop stops at the block's largest). Query i sees key j when
``j <= i``, key j is real, and both are of one sequence or the query is padding (the mask
``BloomModel.attention_mask_for`` builds). A query that sees no key gets 0 and log-sum-exp +inf,
so every probability of its row is 0 in the backward; the caller adds what the PyTorch path gives
such a row.

The backward recomputes the probabilities from the saved log-sum-exp, ``p = exp(s - lse)``, and
runs two kernels so that no gradient needs atomics: one program per key block accumulates
``dv = p^T do`` and ``dk = scale * ds^T q`` over the query blocks that see it, one program per
query block accumulates ``dq = scale * ds k`` over its key blocks, where
``ds = p * (do . v - delta)`` and ``delta = rowsum(o * do)`` (computed by the caller).

Head dims that are not a power of two (80) are padded to the next one (``BLOCK_D``) and masked
on every load and store. Products of two fp32 tensors run in IEEE fp32 (no TF32); bf16/fp16
operands accumulate in fp32, and the probabilities are rounded to the input dtype before the
``p @ v`` and ``ds @ q`` products (as every flash-attention kernel does).

Only imported when triton is; see ``_dispatch.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import INTERPRET

BLOCK_M = 64  # queries a program holds (tests shrink both blocks to exercise block edges)
BLOCK_N = 64  # keys per step of the loop
NUM_STAGES = 2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """fp32-accumulated ``a @ b``; IEEE: fp32 operands (the interpreter's bf16 products are
    wrong in Triton 3.9, so there the caller upcasts bf16/fp16 operands, which are exact in
    fp32: the same products, only summed in another order)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _scores(
    q, k_t, slope, pos_q, pos_k, seg_q, seg_k, tok_q, tok_k, seq_k, scale, IEEE: tl.constexpr
):
    """(M, N) fp32 scores with the ALiBi bias, -inf where the query may not see the key."""
    s = _dot(q, k_t, IEEE) * scale
    s += slope * (pos_k[None, :] - pos_q[:, None])
    same = (seg_k[None, :] == seg_q[:, None]) | (seg_q[:, None] == 0)
    seen = (tok_k[None, :] <= tok_q[:, None]) & (seg_k[None, :] > 0) & same
    seen = seen & (tok_k[None, :] < seq_k)
    return tl.where(seen, s, float("-inf"))


@triton.jit
def _query_block(pos_ptr, seg_ptr, first_ptr, tokens, pid_m, seq_q, seq_k, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """A block of queries: indices, row mask, token indices, positions, segments, and the key
    range [lo, hi) its loop covers (lo from ``first_key``, hi causal)."""
    offset = seq_k - seq_q  # queries are the last seq_q tokens
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m < seq_q
    tok_q = offs_m + offset
    pos_q = tl.load(pos_ptr + tokens + tok_q, mask=rows, other=0.0)
    seg_q = tl.load(seg_ptr + tokens + tok_q, mask=rows, other=0)
    first = tl.min(tl.load(first_ptr + tokens + tok_q, mask=rows, other=seq_k), 0)
    lo = (first // BLOCK_N) * BLOCK_N
    hi = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + offset)
    return offs_m, rows, tok_q, pos_q, seg_q, lo, hi


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,  # (S, B, H, D) each, any strides with a unit last one
    lse_ptr,  # (B, H, Sq) fp32
    slopes_ptr,  # (H,) fp32
    pos_ptr, seg_ptr, first_ptr,  # (B, Sk) fp32, int32, int32
    q_ss, q_sb, q_sh, k_ss, k_sb, k_sh, v_ss, v_sb, v_sh, o_ss, o_sb, o_sh,
    heads, seq_q, seq_k, head_dim, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(0)  # batch x heads on axis 0 (up to 2**31 - 1; axis 1 stops at 65,535)
    pid_m = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    tokens = b.to(tl.int64) * seq_k
    offs_m, rows, tok_q, pos_q, seg_q, lo, hi = _query_block(
        pos_ptr, seg_ptr, first_ptr, tokens, pid_m, seq_q, seq_k, BLOCK_M, BLOCK_N
    )
    offs_d = tl.arange(0, BLOCK_D)
    dims = offs_d < head_dim
    slope = tl.load(slopes_ptr + h)
    q_base = q_ptr + b.to(tl.int64) * q_sb + h.to(tl.int64) * q_sh
    k_base = k_ptr + b.to(tl.int64) * k_sb + h.to(tl.int64) * k_sh
    v_base = v_ptr + b.to(tl.int64) * v_sb + h.to(tl.int64) * v_sh
    q_offs = offs_m.to(tl.int64)[:, None] * q_ss + offs_d[None, :]
    q = tl.load(q_base + q_offs, mask=rows[:, None] & dims[None, :], other=0.0)  # (M, D)

    m_i = tl.full((BLOCK_M,), -1e30, tl.float32)  # finite: a row with no key stays NaN-free
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok_k = start + tl.arange(0, BLOCK_N)
        cols = tok_k < seq_k
        tok_k64 = tok_k.to(tl.int64)
        k_t = tl.load(  # (D, N)
            k_base + tok_k64[None, :] * k_ss + offs_d[:, None],
            mask=cols[None, :] & dims[:, None],
            other=0.0,
        )
        pos_k = tl.load(pos_ptr + tokens + tok_k, mask=cols, other=0.0)
        seg_k = tl.load(seg_ptr + tokens + tok_k, mask=cols, other=0)
        s = _scores(q, k_t, slope, pos_q, pos_k, seg_q, seg_k, tok_q, tok_k, seq_k, scale, IEEE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # 0 where masked
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + tok_k64[:, None] * v_ss + offs_d[None, :],
            mask=cols[:, None] & dims[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_base = o_ptr + b.to(tl.int64) * o_sb + h.to(tl.int64) * o_sh
    o_offs = offs_m.to(tl.int64)[:, None] * o_ss + offs_d[None, :]
    tl.store(o_base + o_offs, out.to(o_ptr.dtype.element_ty), mask=rows[:, None] & dims[None, :])
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + pid_bh.to(tl.int64) * seq_q + offs_m, lse, mask=rows)


@triton.jit
def _backward_kv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr,  # (S, B, H, D) each
    lse_ptr, delta_ptr,  # (B, H, Sq) fp32
    slopes_ptr, pos_ptr, seg_ptr, last_ptr,  # (H,) fp32; (B, Sk) fp32, int32, int32
    q_ss, q_sb, q_sh, k_ss, k_sb, k_sh, v_ss, v_sb, v_sh, do_ss, do_sb, do_sh,
    dk_ss, dk_sb, dk_sh, dv_ss, dv_sb, dv_sh,
    heads, seq_q, seq_k, head_dim, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dk and dv of one block of keys, over every query block that may see it."""
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    offset = seq_k - seq_q
    tok_k = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    cols = tok_k < seq_k
    dims = offs_d < head_dim
    tokens = b.to(tl.int64) * seq_k
    pos_k = tl.load(pos_ptr + tokens + tok_k, mask=cols, other=0.0)
    seg_k = tl.load(seg_ptr + tokens + tok_k, mask=cols, other=0)
    last = tl.max(tl.load(last_ptr + tokens + tok_k, mask=cols, other=0), 0)
    slope = tl.load(slopes_ptr + h)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    tok_k64 = tok_k.to(tl.int64)
    kv_mask = cols[:, None] & dims[None, :]
    k = tl.load(k_ptr + b64 * k_sb + h64 * k_sh + tok_k64[:, None] * k_ss + offs_d[None, :],
                mask=kv_mask, other=0.0)  # fmt: skip
    v = tl.load(v_ptr + b64 * v_sb + h64 * v_sh + tok_k64[:, None] * v_ss + offs_d[None, :],
                mask=kv_mask, other=0.0)  # fmt: skip
    k_t = tl.trans(k)  # (D, N)
    v_t = tl.trans(v)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    q_base = q_ptr + b64 * q_sb + h64 * q_sh
    do_base = do_ptr + b64 * do_sb + h64 * do_sh
    stats = pid_bh.to(tl.int64) * seq_q
    lo = (tl.maximum(pid_n * BLOCK_N - offset, 0) // BLOCK_M) * BLOCK_M  # causal
    hi = tl.minimum(last - offset, seq_q)
    for start in range(lo, hi, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        rows = offs_m < seq_q
        offs_m64 = offs_m.to(tl.int64)
        row_mask = rows[:, None] & dims[None, :]
        q = tl.load(q_base + offs_m64[:, None] * q_ss + offs_d[None, :], mask=row_mask, other=0.0)
        do = tl.load(
            do_base + offs_m64[:, None] * do_ss + offs_d[None, :], mask=row_mask, other=0.0
        )
        lse = tl.load(lse_ptr + stats + offs_m, mask=rows, other=float("inf"))
        delta = tl.load(delta_ptr + stats + offs_m, mask=rows, other=0.0)
        tok_q = offs_m + offset
        pos_q = tl.load(pos_ptr + tokens + tok_q, mask=rows, other=0.0)
        seg_q = tl.load(seg_ptr + tokens + tok_q, mask=rows, other=0)
        s = _scores(q, k_t, slope, pos_q, pos_k, seg_q, seg_k, tok_q, tok_k, seq_k, scale, IEEE)
        s = tl.where(rows[:, None], s, float("-inf"))
        p = tl.exp(s - lse[:, None])  # (M, N); 0 where masked (and on rows that see nothing)
        dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
        ds = p * (_dot(do, v_t, IEEE) - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    dk = dk * scale
    tl.store(dk_ptr + b64 * dk_sb + h64 * dk_sh + tok_k64[:, None] * dk_ss + offs_d[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)  # fmt: skip
    tl.store(dv_ptr + b64 * dv_sb + h64 * dv_sh + tok_k64[:, None] * dv_ss + offs_d[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)  # fmt: skip


@triton.jit
def _backward_q_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr,  # (S, B, H, D) each
    lse_ptr, delta_ptr,  # (B, H, Sq) fp32
    slopes_ptr, pos_ptr, seg_ptr, first_ptr,  # (H,) fp32; (B, Sk) fp32, int32, int32
    q_ss, q_sb, q_sh, k_ss, k_sb, k_sh, v_ss, v_sb, v_sh, do_ss, do_sb, do_sh,
    dq_ss, dq_sb, dq_sh,
    heads, seq_q, seq_k, head_dim, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dq of one block of queries, over the key blocks it may see (the forward's loop)."""
    pid_bh = tl.program_id(0)  # batch x heads on axis 0 (up to 2**31 - 1; axis 1 stops at 65,535)
    pid_m = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    tokens = b.to(tl.int64) * seq_k
    offs_m, rows, tok_q, pos_q, seg_q, lo, hi = _query_block(
        pos_ptr, seg_ptr, first_ptr, tokens, pid_m, seq_q, seq_k, BLOCK_M, BLOCK_N
    )
    offs_d = tl.arange(0, BLOCK_D)
    dims = offs_d < head_dim
    slope = tl.load(slopes_ptr + h)
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    offs_m64 = offs_m.to(tl.int64)
    row_mask = rows[:, None] & dims[None, :]
    q = tl.load(q_ptr + b64 * q_sb + h64 * q_sh + offs_m64[:, None] * q_ss + offs_d[None, :],
                mask=row_mask, other=0.0)  # fmt: skip
    do = tl.load(do_ptr + b64 * do_sb + h64 * do_sh + offs_m64[:, None] * do_ss + offs_d[None, :],
                 mask=row_mask, other=0.0)  # fmt: skip
    stats = pid_bh.to(tl.int64) * seq_q
    lse = tl.load(lse_ptr + stats + offs_m, mask=rows, other=float("inf"))
    delta = tl.load(delta_ptr + stats + offs_m, mask=rows, other=0.0)
    k_base = k_ptr + b64 * k_sb + h64 * k_sh
    v_base = v_ptr + b64 * v_sb + h64 * v_sh
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        tok_k = start + tl.arange(0, BLOCK_N)
        cols = tok_k < seq_k
        tok_k64 = tok_k.to(tl.int64)
        kv_mask = cols[:, None] & dims[None, :]
        k = tl.load(k_base + tok_k64[:, None] * k_ss + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + tok_k64[:, None] * v_ss + offs_d[None, :], mask=kv_mask, other=0.0)
        pos_k = tl.load(pos_ptr + tokens + tok_k, mask=cols, other=0.0)
        seg_k = tl.load(seg_ptr + tokens + tok_k, mask=cols, other=0)
        s = _scores(
            q, tl.trans(k), slope, pos_q, pos_k, seg_q, seg_k, tok_q, tok_k, seq_k, scale, IEEE
        )
        p = tl.exp(s - lse[:, None])
        ds = p * (_dot(do, tl.trans(v), IEEE) - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, IEEE)
    dq = dq * scale
    tl.store(dq_ptr + b64 * dq_sb + h64 * dq_sh + offs_m64[:, None] * dq_ss + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=row_mask)  # fmt: skip


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(token, batch, head) strides of an (S, B, H, D) tensor whose last stride is 1."""
    return x.stride(0), x.stride(1), x.stride(2)


def _launch_options(head_dim: int, dtype: torch.dtype) -> dict:
    block_d = max(16, triton.next_power_of_2(head_dim))
    return {
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": BLOCK_N,
        "BLOCK_D": block_d,
        "IEEE": dtype == torch.float32 or INTERPRET,
        "num_warps": 8 if block_d > 64 else 4,
        "num_stages": NUM_STAGES,
    }


def forward(q, k, v, slopes, positions, segments, first_key, scale):
    """(output (Sq, B, H, D) in q's dtype, log-sum-exp (B, H, Sq) fp32)."""
    seq_q, batch, heads, head_dim = q.shape
    seq_k = k.shape[0]
    out = torch.empty((seq_q, batch, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("inf"))
    grid = (batch * heads, triton.cdiv(seq_q, BLOCK_M))
    _forward_kernel[grid](
        q, k, v, out, lse, slopes, positions, segments, first_key,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        heads, seq_q, seq_k, head_dim, scale,
        **_launch_options(head_dim, q.dtype),
    )  # fmt: skip
    return out, lse


def backward(q, k, v, out, grad_out, lse, slopes, positions, segments, first_key, last_query,
             scale):  # fmt: skip
    """(dq, dk, dv), each (S, B, H, D) contiguous in its input's dtype."""
    seq_q, batch, heads, head_dim = q.shape
    seq_k = k.shape[0]
    delta = (out.float() * grad_out.float()).sum(-1).permute(1, 2, 0).contiguous()  # (B, H, Sq)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    options = _launch_options(head_dim, q.dtype)
    common = (
        *_strides(q), *_strides(k), *_strides(v), *_strides(grad_out),
    )  # fmt: skip
    _backward_kv_kernel[(batch * heads, triton.cdiv(seq_k, BLOCK_N))](
        q, k, v, grad_out, dk, dv, lse, delta, slopes, positions, segments, last_query,
        *common, *_strides(dk), *_strides(dv),
        heads, seq_q, seq_k, head_dim, scale, **options,
    )  # fmt: skip
    _backward_q_kernel[(batch * heads, triton.cdiv(seq_q, BLOCK_M))](
        q, k, v, grad_out, dq, lse, delta, slopes, positions, segments, first_key,
        *common, *_strides(dq),
        heads, seq_q, seq_k, head_dim, scale, **options,
    )  # fmt: skip
    return dq, dk, dv
