"""Per-token log-probabilities and entropy from (vocab-parallel) logits without a full softmax.

``log p(y_t | y_<t) = z_t[y_t]/tau - logsumexp(z_t/tau)`` is the per-token policy log-probability
that the PPO ratio and the KL penalty of Eq. 2 of the paper are built from; the entropy
``H_t = logsumexp(z_t/tau) - E_p[z_t/tau]`` is logged beside it.

How this departs from the usual ``log_softmax(logits.float()).gather(...)``:
- Each rank reduces its vocabulary shard to four fp32 numbers per token (``STATS``): the max
  logit m, ``sum exp(x - m)``, the mean of ``x - m`` under the shard's softmax, and the target
  logit (0 when the target lives on another rank). Kept centred on m, they combine across pieces
  without cancellation (the entropy is ``log S - E[x - M]``, never a difference of two large
  log-sum-exps). The ranks' statistics are combined after ONE all-reduce over the TP group (each
  rank fills its slot of a ``(tp, 4, N)`` buffer). Nothing of size ``N x V`` is allocated: the
  PyTorch path works on a few rows at a time (about ``CHUNK_ELEMENTS`` values), the Triton path
  streams the vocabulary with an online max and sum-exp.
- The backward recomputes the softmax chunk by chunk from the saved logits and the saved global
  log-sum-exp (and entropy): ``d logp/dz = (onehot - p)/tau`` and
  ``d H/dz = -p * (log p + H)/tau``. It needs no collective: each rank writes its own shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import cpu_logprobs
from ._dispatch import use_triton

CHUNK_ELEMENTS = 1 << 22  # logits values one step of the PyTorch path holds in fp32 (16 MB)
MIN_LOG_PROB = -1000.0  # clamp for shifted logits: exp() of it is exactly 0 in fp32 and fp64
EMPTY_MAX = -1e30  # max logit of a piece without probability mass (finite: no inf - inf)
STATS = ("max", "sum_exp", "centred_mean", "target_logit")  # rows of a statistics tensor


def token_logprobs(
    logits: torch.Tensor,  # (B, T, V) or this rank's vocab shard (B, T, V/tp)
    targets: torch.Tensor,  # (B, T) global token ids
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(logits / temperature)[target]`` per position, and optionally the entropy.

    With ``tp_group``, ``logits`` is this rank's contiguous vocabulary shard (rank r holds ids
    ``[r*V/tp, (r+1)*V/tp)``, as Megatron's vocab-parallel output layer produces) and ``targets``
    are global ids; every rank gets the full result. Returns fp32 ``(B, T)`` tensors (fp64 for
    fp64 logits). Differentiable wrt ``logits``; targets must lie in ``[0, V)``: give padding
    positions any valid id and mask the result.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"token_logprobs: expected logits (B, T, V) and targets (B, T); got "
            f"{tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if not logits.is_floating_point() or targets.is_floating_point():
        raise ValueError("token_logprobs: logits must be floating point and targets integer ids")
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    check_targets("token_logprobs", targets, vocab_range(logits.shape[-1], tp_group)[1])
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    outputs = _TokenLogprobs.apply(logits, targets, temperature, tp_group, return_entropy)
    return outputs if return_entropy else outputs[0]


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, tp_group, return_entropy):
        batch, seq, vocab_local = logits.shape
        vocab_start, _ = vocab_range(vocab_local, tp_group)
        local_targets = shard_targets(targets.reshape(-1), vocab_start, vocab_local)  # (N,)
        inv_temp = 1.0 / temperature
        stats = torch.empty((4, batch * seq), dtype=stats_dtype(logits), device=logits.device)
        for start, rows in row_blocks(logits):
            stop = start + rows.shape[0]
            stats[:, start:stop] = merge_stats(
                local_stats(rows, local_targets[start:stop], inv_temp, return_entropy)
            )
        if tp_group is not None:
            stats = merge_stats(gather_tp_stats(stats, tp_group))
        logprobs, lse, entropy = finish_stats(stats)  # (N,) each
        ctx.save_for_backward(logits, local_targets, lse, entropy)
        ctx.inv_temp, ctx.return_entropy = inv_temp, return_entropy
        return logprobs.view(batch, seq), entropy.view(batch, seq) if return_entropy else None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_targets, lse, entropy = ctx.saved_tensors
        grad_lp = grad_logprobs.reshape(-1).to(lse.dtype).contiguous()  # (N,)
        grad_ent = None
        if ctx.return_entropy and grad_entropy is not None:
            grad_ent = grad_entropy.reshape(-1).to(lse.dtype).contiguous()
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_rows_all = grad_logits.view(-1, logits.shape[-1])  # (N, V)
        for start, rows in row_blocks(logits):
            rows_slice = slice(start, start + rows.shape[0])
            rows_grad(
                rows,
                grad_rows_all[rows_slice],
                local_targets[rows_slice],
                lse[rows_slice],
                entropy[rows_slice],
                grad_lp[rows_slice],
                None if grad_ent is None else grad_ent[rows_slice],
                ctx.inv_temp,
            )
        return grad_logits, None, None, None, None


def vocab_range(vocab_local: int, tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(first id held here, global vocabulary size)`` for equal contiguous shards."""
    if tp_group is None:
        return 0, vocab_local
    return dist.get_rank(tp_group) * vocab_local, dist.get_world_size(tp_group) * vocab_local


def shard_targets(targets: torch.Tensor, vocab_start: int, vocab_local: int) -> torch.Tensor:
    """Target ids relative to this shard, -1 where the target lives on another rank."""
    local = targets.long() - vocab_start
    return torch.where((local >= 0) & (local < vocab_local), local, -1).contiguous()


def check_targets(name: str, targets: torch.Tensor, vocab: int) -> None:
    """Raise unless every id lies in ``[0, vocab)`` (one device sync; no data on ``meta``)."""
    if targets.numel() == 0 or targets.is_meta:
        return
    low, high = torch.stack(torch.aminmax(targets)).tolist()
    if low < 0 or high >= vocab:
        raise ValueError(
            f"{name}: target ids must lie in [0, {vocab}); got [{low}, {high}] (give padding "
            "positions any valid id and mask the result)"
        )


def stats_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 accumulators (fp64 for fp64 inputs, so that gradcheck sees exact math)."""
    return torch.promote_types(x.dtype, torch.float32)


def row_blocks(tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(first flat token index, (n, V) view)`` pieces covering a (B, T, V) tensor, no copies."""
    batch, seq, vocab = tensor.shape
    try:
        return [(0, tensor.view(-1, vocab))]
    except RuntimeError:  # e.g. logits[:, :-1]: rows are evenly strided only within a sequence
        return [(b * seq, tensor[b]) for b in range(batch)]


def merge_stats(parts: torch.Tensor) -> torch.Tensor:
    """Combine ``(k, 4, n)`` statistics of disjoint vocabulary pieces into ``(4, n)`` (``STATS``)."""
    if parts.shape[0] == 1:
        return parts[0]
    maxes, sums, centred, targets = parts.unbind(1)  # (k, n) each
    top = maxes.amax(0)  # (n,)
    mass = sums * torch.exp(maxes - top)  # (k, n) each piece's sum_exp relative to top
    total = mass.sum(0)
    share = torch.where(mass > 0, mass / total, 0.0)  # (k, n)
    centred_all = (share * (centred + (maxes - top))).sum(0)
    return torch.stack([top, total, centred_all, targets.sum(0)])


def finish_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log p(target), log-sum-exp, entropy)`` from merged ``(4, n)`` statistics."""
    top, total, centred, target_logit = stats
    log_total = total.log()
    return (target_logit - top) - log_total, top + log_total, log_total - centred


def gather_tp_stats(stats: torch.Tensor, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``(4, n)`` statistics as ``(tp, 4, n)``, with a single all-reduce."""
    slots = stats.new_zeros((dist.get_world_size(tp_group), *stats.shape))
    slots[dist.get_rank(tp_group)] = stats
    dist.all_reduce(slots, group=tp_group)
    return slots


def local_stats(
    rows: torch.Tensor,  # (n, V)
    local_targets: torch.Tensor,  # (n,)
    inv_temp: float,
    with_entropy: bool,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partial statistics ``(k, 4, n)`` of each row over this shard (k pieces of the vocab).

    ``workspace`` (from ``new_workspace``) is scratch memory for the PyTorch path, for callers
    that call this many times; one is allocated when it is None.
    """
    if use_triton(rows) and rows.dtype != torch.float64:
        from . import triton_logprobs

        return triton_logprobs.rows_stats(rows, local_targets, inv_temp, with_entropy)
    if cpu_logprobs.applies(rows, dtypes=cpu_logprobs.LOGITS):
        return cpu_logprobs.rows_stats(rows, local_targets, inv_temp, with_entropy)[None]
    return _rows_stats_torch(rows, local_targets, inv_temp, with_entropy, workspace)[None]


def new_workspace(rows: torch.Tensor) -> torch.Tensor | None:
    """Scratch memory for repeated ``local_stats``/``rows_grad`` calls on rows shaped like these.

    None when the Triton path or the CPU kernel will run (they need none). Two fp32 buffers of
    about ``CHUNK_ELEMENTS`` values: reusing them spares a fresh, page-faulting allocation per
    chunk.
    """
    if (use_triton(rows) and rows.dtype != torch.float64) or cpu_logprobs.applies(
        rows, dtypes=cpu_logprobs.LOGITS
    ):
        return None
    chunk_rows = min(rows.shape[0], max(1, CHUNK_ELEMENTS // max(rows.shape[1], 1)))
    return torch.empty(2 * chunk_rows * rows.shape[1], dtype=stats_dtype(rows), device=rows.device)


def rows_grad(
    rows: torch.Tensor,  # (n, V)
    grad_rows: torch.Tensor,  # (n, V) written
    local_targets: torch.Tensor,  # (n,)
    lse: torch.Tensor,  # (n,)
    entropy: torch.Tensor,  # (n,)
    grad_lp: torch.Tensor,  # (n,)
    grad_ent: torch.Tensor | None,  # (n,)
    inv_temp: float,
    workspace: torch.Tensor | None = None,
) -> None:
    """Write d(sum grad_lp*logp + grad_ent*H)/d rows into ``grad_rows``, chunk by chunk."""
    if use_triton(rows) and rows.dtype != torch.float64:
        from . import triton_logprobs

        triton_logprobs.rows_grad(
            rows, grad_rows, local_targets, lse, entropy, grad_lp, grad_ent, inv_temp
        )
        return
    if cpu_logprobs.applies(rows, grad_rows, dtypes=cpu_logprobs.LOGITS):
        cpu_logprobs.rows_grad(
            rows, grad_rows, local_targets, lse, entropy, grad_lp, grad_ent, inv_temp
        )
        return
    workspace = new_workspace(rows) if workspace is None else workspace
    vocab = rows.shape[1]
    chunk = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows.shape[0], chunk):
        piece = slice(start, start + chunk)
        targets = local_targets[piece]
        size = targets.shape[0] * vocab
        log_p = workspace[:size].view(-1, vocab).copy_(rows[piece])  # (c, V)
        if inv_temp != 1.0:
            log_p.mul_(inv_temp)
        log_p.sub_(lse[piece, None])  # x/tau - lse
        scaled_lp = grad_lp[piece] * inv_temp  # (c,) the 1/tau of dx/dz folded in
        if grad_ent is None:
            grad = log_p.exp_().mul_(-scaled_lp[:, None])
        else:
            # p * (-g_H * (log p + H) - g_lp) / tau, as p * (slope * log p + offset)
            slope = -grad_ent[piece] * inv_temp
            offset = slope * entropy[piece] - scaled_lp
            prob = workspace[size : 2 * size].view(-1, vocab)
            torch.exp(log_p.clamp_(min=MIN_LOG_PROB), out=prob)
            grad = prob.mul_(log_p.mul_(slope[:, None]).add_(offset[:, None]))
        onehot_grad = torch.where(targets >= 0, scaled_lp, 0.0)[:, None]  # (c, 1)
        grad.scatter_add_(1, targets.clamp(min=0)[:, None], onehot_grad)
        grad_rows[piece].copy_(grad)


def _rows_stats_torch(
    rows: torch.Tensor,
    local_targets: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    workspace: torch.Tensor | None,
) -> torch.Tensor:
    """The PyTorch reference for one shard: ``(4, n)`` statistics, a few rows at a time."""
    n_rows, vocab = rows.shape
    dtype = stats_dtype(rows)
    workspace = new_workspace(rows) if workspace is None else workspace
    out = torch.zeros((4, n_rows), dtype=dtype, device=rows.device)
    chunk = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, n_rows, chunk):
        piece = slice(start, start + chunk)
        targets = local_targets[piece]
        size = targets.shape[0] * vocab
        x = workspace[:size].view(-1, vocab).copy_(rows[piece])  # (c, V) in fp32
        if inv_temp != 1.0:
            x.mul_(inv_temp)
        target_logit = x.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
        out[3, piece] = torch.where(targets >= 0, target_logit, 0.0)
        row_max = x.amax(1)  # (c,)
        row_max = torch.where(row_max > EMPTY_MAX, row_max, EMPTY_MAX)  # all -inf rows
        out[0, piece] = row_max
        shifted = x.sub_(row_max[:, None])  # x/tau - max
        if with_entropy:
            e = torch.exp(shifted, out=workspace[size : 2 * size].view(-1, vocab))
            sum_exp = e.sum(1)
            # nansum: a -inf logit gives 0 * -inf = nan, whose true contribution is 0
            centred = torch.nansum(shifted.mul_(e), 1) / sum_exp
            out[2, piece] = torch.where(sum_exp > 0, centred, 0.0)
        else:
            sum_exp = shifted.exp_().sum(1)
        out[1, piece] = sum_exp
    return out
