"""Supervised fine-tuning on an indexed SFT dataset (the demo's "SFT policy" stage).

The loss is the token-mean NLL of response tokens (``loss_mask``), computed from this rank's
vocabulary shard of the logits with the fused ``token_logprobs`` kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron_rlhf.kernels import token_logprobs
from megatron_rlhf.ppo.losses import sft_nll


def sft_loss(logits: torch.Tensor, microbatch: dict):
    """NLL of ``input_ids[:, 1:]`` given the logits (B, S, V/tp), over ``loss_mask[:, 1:]``."""
    tp_group = None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    logprobs = token_logprobs(logits[:, :-1], microbatch["input_ids"][:, 1:], 1.0, tp_group)
    loss = sft_nll(logprobs, microbatch["loss_mask"][:, 1:])
    return loss, {"nll": loss.detach()}


@dataclass(kw_only=True)
class SFTRun:
    steps: int = 100
    micro_batch_size: int = 8
    num_microbatches: int = 1
    max_length: int = 256
    seed: int = 1234


def train_sft(model, dataset, engine, run: SFTRun, pad_id: int, progress=None) -> list[float]:
    """``run.steps`` optimizer steps over ``dataset`` (an SFTDataset); returns the losses."""
    from megatron_rlhf.data import ShardedSampler, collate_sft

    sampler = iter(
        ShardedSampler(
            len(dataset),
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
            seed=run.seed,
            micro_batch_size=run.micro_batch_size,
        )
    )
    losses = []
    for _ in range(run.steps):
        microbatches = []
        for _ in range(run.num_microbatches):
            samples = [dataset[next(sampler)] for _ in range(run.micro_batch_size)]
            for sample in samples:
                sample["input_ids"] = sample["input_ids"][: run.max_length]
                sample["loss_mask"] = sample["loss_mask"][: run.max_length]
            batch = collate_sft(samples, pad_id)
            microbatches.append(
                {
                    "input_ids": batch["input_ids"],
                    "padding_mask": batch["attention_mask"],
                    "loss_mask": batch["loss_mask"],
                }
            )
        width = max(mb["input_ids"].shape[1] for mb in microbatches)
        for mb in microbatches:
            pad = width - mb["input_ids"].shape[1]
            mb["input_ids"] = torch.nn.functional.pad(mb["input_ids"], (0, pad), value=pad_id)
            mb["padding_mask"] = torch.nn.functional.pad(mb["padding_mask"], (0, pad))
            mb["loss_mask"] = torch.nn.functional.pad(mb["loss_mask"], (0, pad))
        metrics = engine.step(microbatches, sft_loss)
        losses.append(metrics.get("loss", float("nan")))
        if progress is not None:
            progress(losses[-1])
    return losses
