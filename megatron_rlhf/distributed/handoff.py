"""Hand tensors between roles' layouts: rows of the global batch scattered to, and gathered from,
a layout's data-parallel ranks.

A PPO step's batch is global (``rollout.prompts_per_step`` rows). In a layout with data-parallel
size ``dp``, DP rank ``d`` owns the contiguous rows ``[d * G/dp, (d + 1) * G/dp)``; every TP/PP
rank of that replica holds the same rows. Scatter is a slice (every rank already holds the
global batch); gather is an all-gather over the layout's DP group, which hands every rank of the
world the global tensor (each rank belongs to exactly one DP group of each layout). Rows of
different replicas may differ in width (responses end at different steps): they are padded to
the group's widest first. Nothing goes through the filesystem.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.parallel import compute_device


def dp_rows(global_rows: int, dp: int, dp_rank: int) -> slice:
    """The rows of the global batch owned by ``dp_rank`` of a ``dp``-way layout."""
    if global_rows % dp:
        raise ValueError(f"a global batch of {global_rows} rows does not split over dp={dp}")
    per_rank = global_rows // dp
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def pad_width(tensor: torch.Tensor, width: int, value, left: bool = False) -> torch.Tensor:
    """Pad dim 1 of ``tensor`` to ``width`` with ``value`` (on the left for left-padded rows)."""
    missing = width - tensor.shape[1]
    if missing == 0:
        return tensor
    pad = (0, 0) * (tensor.dim() - 2) + ((missing, 0) if left else (0, missing))
    return torch.nn.functional.pad(tensor, pad, value=value)


def gather_rows(tensor: torch.Tensor, group, pad_value=0, left: bool = False) -> torch.Tensor:
    """All-gather this rank's rows (b, ...) over the DP ``group`` into (dp * b, ...), in DP-rank
    order; for 2-D+ tensors dim 1 is first padded to the group's widest with ``pad_value``."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    device, local = tensor.device, tensor.to(compute_device()).contiguous()
    if local.dim() >= 2:
        width = torch.tensor([local.shape[1]], device=local.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
        local = pad_width(local, int(width), pad_value, left).contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts).to(device)


def dp_shard(rows, group):
    """This DP rank's (of ``group``) part of the global ``rows`` (a tensor or a list)."""
    return rows[dp_rows(len(rows), group.size(), group.rank())]


def for_each_dp_shard(group, batch, compute: Callable, pad_values: dict | None = None):
    """The replicated-batch contract in one call: every rank holds the global ``batch``; this
    DP rank (of ``group``) computes on its share and every rank of the world gets the global
    results back (each rank belongs to exactly one DP group of a layout).

    ``batch`` is either a row count (the rows split as :func:`dp_rows`; ``compute(row
    indices)`` returns ``{name: tensor (b, ...)}``, each gathered with :func:`gather_rows`,
    dim 1 padded with ``pad_values[name]``, default 0) or a list of items of any length
    (split into contiguous shares, the first ranks one longer; ``compute(items)`` returns one
    result per item; the results come back in the list's order).
    """
    if isinstance(batch, int):
        rows = dp_shard(torch.arange(batch), group)
        return {
            name: gather_rows(value, group, (pad_values or {}).get(name, 0))
            for name, value in compute(rows).items()
        }
    size = group.size()
    if size == 1:
        return compute(batch)
    base, longer = divmod(len(batch), size)
    starts = [d * base + min(d, longer) for d in range(size + 1)]
    rank = group.rank()
    parts = [None] * size
    dist.all_gather_object(parts, compute(batch[starts[rank] : starts[rank + 1]]), group=group)
    return [result for part in parts for result in part]
