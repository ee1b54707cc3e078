"""Per-token log-probabilities and entropy straight from hidden states and the output weight.

The Cut-Cross-Entropy idea (Wijmans et al., 2024) applied to the log-probs of PPO (Eq. 2):
the logits ``hidden @ weight.T`` are formed one ``(token_chunk, vocab_chunk)`` tile at a time,
reduced to the same four statistics as ``logprobs.token_logprobs`` (max, sum-exp, centred mean,
target logit) and dropped, so no ``(N, V)`` tensor ever exists, in the forward or the backward.
The backward recomputes each tile (one extra matmul per tile: about a third more matmul work than
a plain logits + cross-entropy forward and backward) with the vocabulary in the outer loop, so
each slice of the weight gradient is finished in one go and only ``(N, H)`` and
``(vocab_chunk, H)`` fp32 accumulators are held.

With ``tp_group``, ``weight`` is this rank's contiguous vocabulary shard ``(V/tp, H)`` and
``hidden`` is replicated over the group (the input of Megatron's vocab-parallel output layer). The
backward all-reduces the gradient of ``hidden`` over the group itself, so the returned gradient is
the full one: do not route ``hidden`` through ``copy_to_tensor_model_parallel_region`` as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .logprobs import (
    check_targets,
    finish_stats,
    gather_tp_stats,
    local_stats,
    merge_stats,
    new_workspace,
    rows_grad,
    shard_targets,
    stats_dtype,
    vocab_range,
)


def token_logprobs_from_hidden(
    hidden: torch.Tensor,  # (B, T, H)
    weight: torch.Tensor,  # (V, H) or this rank's vocab shard (V/tp, H)
    targets: torch.Tensor,  # (B, T) global token ids
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    token_chunk: int = 1024,
    vocab_chunk: int = 8192,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs(hidden @ weight.T, targets, ...)`` without materialising the logits.

    Each logits tile is computed in the inputs' dtype (as the model's output layer would) and
    reduced with fp32 accumulators. Returns fp32 ``(B, T)`` tensors (fp64 for fp64 inputs).
    Differentiable wrt ``hidden`` and ``weight``.
    """
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"token_logprobs_from_hidden: expected hidden (B, T, H) and weight (V, H); got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:2] or targets.is_floating_point():
        raise ValueError(
            f"token_logprobs_from_hidden: targets must be integer ids of shape "
            f"{tuple(hidden.shape[:2])}, got {targets.dtype} {tuple(targets.shape)}"
        )
    if not temperature > 0 or token_chunk < 1 or vocab_chunk < 1:
        raise ValueError("token_logprobs_from_hidden: temperature and chunk sizes must be > 0")
    check_targets("token_logprobs_from_hidden", targets, vocab_range(weight.shape[0], tp_group)[1])
    outputs = _HiddenLogprobs.apply(
        hidden,
        weight,
        targets,
        temperature,
        tp_group,
        return_entropy,
        (token_chunk, vocab_chunk),
    )
    return outputs if return_entropy else outputs[0]


class _HiddenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, tp_group, return_entropy, chunks):
        batch, seq, _ = hidden.shape
        token_chunk, vocab_chunk = chunks
        vocab_local = weight.shape[0]
        hidden_rows = hidden.reshape(batch * seq, -1)  # (N, H)
        vocab_start, _ = vocab_range(vocab_local, tp_group)
        local_targets = shard_targets(targets.reshape(-1), vocab_start, vocab_local)  # (N,)
        inv_temp = 1.0 / temperature
        stats = torch.empty((4, batch * seq), dtype=stats_dtype(hidden), device=hidden.device)
        tile_buffer, workspace = _tile_buffers(hidden_rows, vocab_local, chunks)
        for t0 in range(0, batch * seq, token_chunk):
            tokens = slice(t0, t0 + token_chunk)
            pieces = []
            for v0 in range(0, vocab_local, vocab_chunk):
                tile_weight = weight[v0 : v0 + vocab_chunk]  # (cv, H)
                logits = _tile_matmul(hidden_rows[tokens], tile_weight.T, tile_buffer)  # (ct, cv)
                tile_targets = shard_targets(local_targets[tokens], v0, tile_weight.shape[0])
                pieces.append(
                    local_stats(logits, tile_targets, inv_temp, return_entropy, workspace)
                )
            stats[:, tokens] = merge_stats(torch.cat(pieces))
        if tp_group is not None:
            stats = merge_stats(gather_tp_stats(stats, tp_group))
        logprobs, lse, entropy = finish_stats(stats)  # (N,) each
        ctx.save_for_backward(hidden_rows, weight, local_targets, lse, entropy)
        ctx.hidden_shape, ctx.chunks, ctx.tp_group = hidden.shape, chunks, tp_group
        ctx.inv_temp, ctx.return_entropy = inv_temp, return_entropy
        return logprobs.view(batch, seq), entropy.view(batch, seq) if return_entropy else None

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden_rows, weight, local_targets, lse, entropy = ctx.saved_tensors
        token_chunk, vocab_chunk = ctx.chunks
        n_tokens = hidden_rows.shape[0]
        grad_lp = grad_logprobs.reshape(-1).to(lse.dtype).contiguous()  # (N,)
        grad_ent = None
        if ctx.return_entropy and grad_entropy is not None:
            grad_ent = grad_entropy.reshape(-1).to(lse.dtype).contiguous()
        accum_dtype = lse.dtype
        grad_hidden = torch.zeros(hidden_rows.shape, dtype=accum_dtype, device=lse.device)
        grad_weight = torch.empty_like(weight)
        tile_buffer, workspace = _tile_buffers(hidden_rows, weight.shape[0], ctx.chunks)
        grad_tile_buffer = torch.empty_like(tile_buffer)
        one_token_chunk = n_tokens <= token_chunk  # then each weight tile's gradient is one matmul
        for v0 in range(0, weight.shape[0], vocab_chunk):
            tile_weight = weight[v0 : v0 + vocab_chunk]  # (cv, H)
            if not one_token_chunk:
                tile_grad_weight = torch.zeros(
                    tile_weight.shape, dtype=accum_dtype, device=lse.device
                )
            for t0 in range(0, n_tokens, token_chunk):
                tokens = slice(t0, t0 + token_chunk)
                tile_hidden = hidden_rows[tokens]  # (ct, H)
                logits = _tile_matmul(tile_hidden, tile_weight.T, tile_buffer)  # recomputed
                grad_logits = grad_tile_buffer[: logits.numel()].view_as(logits)
                rows_grad(
                    logits,
                    grad_logits,
                    shard_targets(local_targets[tokens], v0, tile_weight.shape[0]),
                    lse[tokens],
                    entropy[tokens],
                    grad_lp[tokens],
                    None if grad_ent is None else grad_ent[tokens],
                    ctx.inv_temp,
                    workspace,
                )
                if ctx.needs_input_grad[0]:
                    grad_hidden[tokens] += grad_logits @ tile_weight
                if ctx.needs_input_grad[1] and one_token_chunk:
                    torch.matmul(grad_logits.T, tile_hidden, out=grad_weight[v0 : v0 + vocab_chunk])
                elif ctx.needs_input_grad[1]:
                    tile_grad_weight += grad_logits.T @ tile_hidden
            if ctx.needs_input_grad[1] and not one_token_chunk:
                grad_weight[v0 : v0 + vocab_chunk] = tile_grad_weight
        if ctx.tp_group is not None and ctx.needs_input_grad[0]:
            dist.all_reduce(grad_hidden, group=ctx.tp_group)
        grad_hidden = grad_hidden.to(hidden_rows.dtype).view(ctx.hidden_shape)
        if not ctx.needs_input_grad[0]:
            grad_hidden = None
        if not ctx.needs_input_grad[1]:
            grad_weight = None
        return grad_hidden, grad_weight, None, None, None, None, None


def _tile_buffers(
    hidden_rows: torch.Tensor, vocab_local: int, chunks: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A flat buffer for one logits tile and the PyTorch path's scratch, reused for every tile."""
    tile_rows = min(chunks[0], hidden_rows.shape[0])
    tile_cols = min(chunks[1], vocab_local)
    tile_buffer = hidden_rows.new_empty(tile_rows * tile_cols)
    return tile_buffer, new_workspace(tile_buffer.view(tile_rows, tile_cols))


def _tile_matmul(left: torch.Tensor, right: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``left @ right`` written into the front of ``buffer``."""
    return torch.matmul(
        left,
        right,
        out=buffer[: left.shape[0] * right.shape[1]].view(left.shape[0], right.shape[1]),
    )
