"""A BLOOM's weights as full Hugging Face tensors, streamed in memory from any TP/PP layout.

``hf_tensor_stream(model)`` yields ``(hf_name, tensor)`` for every tensor of the equivalent
``BloomForCausalLM`` (or ``BloomForSequenceClassification``), in global layer order, on every
rank of the model's layout: each tensor is all-gathered over the TP group (along the dim that
:mod:`~megatron_rlhf.checkpoint.hf_names` says TP splits), broadcast from its pipeline stage
to the other stages, and the padded vocabulary rows are cut. Nothing touches the filesystem.
It feeds an inference engine's ``load_weights`` (the vLLM rollout engine takes it every PPO
step) and is what the HF export writes, without the files.

Memory: one full tensor at a time beyond the model (the consumer copies it before the next is
gathered). At BLOOM-176B (TP 8, PP 8, bf16) the largest is the word embedding,
250,880 x 14,336 x 2 B = 7.2 GB; a layer's fc1 is 57,344 x 14,336 x 2 B = 1.6 GB. Traffic per
rank is the whole model (352 GB at 176B): over NVLink/IB at ~100 GB/s, ~4 s per sync; an engine
that shards the vocabulary and the layers the same way as the actor would move 1/(TP*PP) of it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_rlhf.checkpoint.hf_io import stage_layer_offset
from megatron_rlhf.checkpoint.hf_names import full_hf_name, mapping_for
from megatron_rlhf.distributed.parallel import compute_device, stage_rank


def hf_tensor_stream(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor of ``model`` (a ``BloomModel``), full-size, in ``dtype`` (default: the
    parameters' own), on every rank of its layout (collective over its TP and PP groups: every
    rank must drain the iterator)."""
    groups = model.pg_collection
    head, vocab_size = model.head, model.arch.vocab_size
    offset = stage_layer_offset(model)
    local = []
    for name, param in model.named_parameters():
        if name == "output_layer.weight":
            continue  # tied to the word embedding
        mapping = mapping_for(name, head, offset)
        local.append((mapping, param))
    tp, pp = groups.tp, groups.pp
    # Every stage learns the names and full shapes of the others' tensors, to receive them.
    described = [(m.hf_name, m.split_dim, m.is_vocab, tuple(p.shape), p.dtype) for m, p in local]
    stages = [None] * pp.size()
    if pp.size() > 1:
        dist.all_gather_object(stages, described, group=pp)
    else:
        stages = [described]
    mine = {m.hf_name: p for m, p in local}
    for stage, tensors in enumerate(stages):
        for hf_name, split_dim, is_vocab, shard_shape, shard_dtype in tensors:
            if stage == pp.rank():
                tensor = _gather_tp(mine[hf_name].detach(), split_dim, tp)
            else:
                shape = list(shard_shape)
                if split_dim is not None:
                    shape[split_dim] *= tp.size()
                tensor = torch.empty(shape, dtype=shard_dtype, device=compute_device())
            if pp.size() > 1:
                dist.broadcast(tensor, src=stage_rank(groups, stage), group=pp)
            if is_vocab:
                tensor = tensor[:vocab_size]
            if dtype is not None:
                tensor = tensor.to(dtype)
            yield full_hf_name(hf_name), tensor


def _gather_tp(shard: torch.Tensor, split_dim: int | None, tp_group) -> torch.Tensor:
    if split_dim is None or tp_group.size() == 1:
        return shard.contiguous()
    parts = [torch.empty_like(shard) for _ in range(tp_group.size())]
    dist.all_gather(parts, shard.contiguous(), group=tp_group)
    return torch.cat(parts, dim=split_dim)
