"""Forward-only pipeline execution (scoring, reference log-probs, generation).

Training goes through Megatron-Core's ``get_forward_backward_func()`` schedules; inference needs
only activations to flow stage to stage, which is two blocking p2p calls per stage here. All
ranks of a pipeline hold the same ``input_ids``/``padding_mask`` (every stage needs the mask),
so activation shapes are known without a handshake.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rlhf.distributed.parallel import compute_device


def pipeline_forward(model, input_ids: torch.Tensor, padding_mask: torch.Tensor, **kwargs):
    """Run ``model`` across the pipeline; the last stage returns its output, others None.
    Inputs are moved to the compute device first (the model's forward takes them there)."""
    device = compute_device()
    input_ids, padding_mask = input_ids.to(device), padding_mask.to(device)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return model(input_ids, padding_mask, **kwargs)
    config = model.config
    if not parallel_state.is_pipeline_first_stage():
        seq = input_ids.shape[1]
        if config.sequence_parallel:
            seq //= parallel_state.get_tensor_model_parallel_world_size()
        hidden = torch.empty(
            seq,
            input_ids.shape[0],
            config.hidden_size,
            dtype=config.params_dtype,
            device=compute_device(),
        )
        dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    output = model(input_ids, padding_mask, **kwargs)
    if not parallel_state.is_pipeline_last_stage():
        dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return output


def broadcast_from_last_stage(tensor: torch.Tensor | None, shape, dtype) -> torch.Tensor:
    """Give every pipeline stage the last stage's ``tensor`` (others pass None); the result
    lives on the compute device (NCCL broadcasts GPU tensors only)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return tensor
    if parallel_state.is_pipeline_last_stage():
        tensor = tensor.to(compute_device()).contiguous()
    else:
        tensor = torch.empty(shape, dtype=dtype, device=compute_device())
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast(tensor, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return tensor


def gather_vocab_shards(logits_shard: torch.Tensor) -> torch.Tensor:
    """All-gather the TP vocab shards of logits (..., V/tp) into full logits (..., V)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits_shard
    shards = [torch.empty_like(logits_shard) for _ in range(tp)]
    dist.all_gather(
        shards, logits_shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(shards, dim=-1)
