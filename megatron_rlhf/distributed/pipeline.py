"""Forward-only pipeline execution (scoring, reference log-probs, generation).

Training goes through Megatron-Core's ``get_forward_backward_func()`` schedules; inference needs
only activations to flow stage to stage, which is two blocking p2p calls per stage here. All
ranks of a pipeline hold the same ``input_ids``/``padding_mask`` (every stage needs the mask),
so activation shapes are known without a handshake.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlhf.distributed.parallel import (
    compute_device,
    is_first_stage,
    is_last_stage,
    model_groups,
    stage_rank,
)


def pipeline_forward(model, input_ids: torch.Tensor, padding_mask: torch.Tensor, **kwargs):
    """Run ``model`` across its pipeline (its own groups); the last stage returns its output,
    others None. Inputs are moved to the compute device first (the model's forward takes them
    there)."""
    device, groups = compute_device(), model_groups(model)
    input_ids, padding_mask = input_ids.to(device), padding_mask.to(device)
    if groups.pp.size() == 1:
        return model(input_ids, padding_mask, **kwargs)
    config = model.config
    if not is_first_stage(groups):
        seq = input_ids.shape[1]
        if config.sequence_parallel:
            seq //= groups.tp.size()
        hidden = torch.empty(
            seq,
            input_ids.shape[0],
            config.hidden_size,
            dtype=config.params_dtype,
            device=compute_device(),
        )
        stage = groups.pp.rank()
        dist.recv(hidden, src=stage_rank(groups, stage - 1))
        model.set_input_tensor(hidden)
    output = model(input_ids, padding_mask, **kwargs)
    if not is_last_stage(groups):
        dist.send(output.contiguous(), dst=stage_rank(groups, groups.pp.rank() + 1))
        return None
    return output


def broadcast_from_last_stage(tensor: torch.Tensor | None, shape, dtype, groups) -> torch.Tensor:
    """Give every pipeline stage of ``groups`` (a model's groups) the last stage's ``tensor``
    (others pass None); the result lives on the compute device (NCCL broadcasts GPU tensors
    only)."""
    if groups.pp.size() == 1:
        return tensor
    if is_last_stage(groups):
        tensor = tensor.to(compute_device()).contiguous()
    else:
        tensor = torch.empty(shape, dtype=dtype, device=compute_device())
    dist.broadcast(tensor, src=stage_rank(groups, -1), group=groups.pp)
    return tensor


def gather_vocab_shards(logits_shard: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather the TP vocab shards of logits (..., V/tp) over ``tp_group`` into full logits
    (..., V)."""
    tp = tp_group.size()
    if tp == 1:
        return logits_shard
    shards = [torch.empty_like(logits_shard) for _ in range(tp)]
    dist.all_gather(shards, logits_shard.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)
