"""Rejection sampling (paper Eqs. 3-4): best-of-K responses above a threshold, then SFT.

Reuses the PPO stages: rollout (K samples per prompt), score (the reward/advantage model), and
the actor's TrainEngine with a token-mean NLL on the kept responses.
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_rlhf.distributed.parallel import vocab_group
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.ppo.losses import sft_nll
from megatron_rlhf.ppo.microbatch import (
    Batching,
    MicroBatch,
    microbatch,
    response_logprobs_of,
    train_step,
)


def repeat_prompts(prompts: dict, times: int) -> dict:
    """Each prompt ``times`` times in a row (B*K rows)."""
    return {key: value.repeat_interleave(times, dim=0) for key, value in prompts.items()}


def select_best(scores: torch.Tensor, samples_per_prompt: int, threshold: float | None):
    """Row index of the best response of each prompt, kept if its score >= threshold."""
    grouped = scores.view(-1, samples_per_prompt)  # (B, K)
    best_score, best = grouped.max(dim=1)
    rows = torch.arange(grouped.shape[0], device=scores.device) * samples_per_prompt + best
    keep = torch.ones_like(best_score, dtype=torch.bool)
    if threshold is not None:
        keep = best_score >= threshold
    return rows[keep]


def nll_loss(temperature: float, tp_group, logits: torch.Tensor, mb: MicroBatch):
    logprobs = response_logprobs_of(mb, mb.lm_outputs(logits), temperature, tp_group)
    loss = sft_nll(logprobs, mb.response_mask, "mean")  # token mean of the kept responses
    return loss, {"nll": loss.detach()}


def rejection_update(experience: Experience, actor, batching: Batching) -> dict:
    """One optimizer step of NLL on the selected responses (Eq. 4); ``actor`` is the actor's
    :class:`~megatron_rlhf.ppo.roles.Role`, ``experience`` this DP rank's rows, cut into
    ``batching.micro_batch_size`` padded rows."""
    micro_batch_size = batching.micro_batch_size
    batch = experience.sequences.shape[0]
    usable = batch - batch % micro_batch_size
    if usable == 0:
        return {"kept": 0.0}
    microbatches = [
        microbatch(
            experience.select(torch.arange(i, i + micro_batch_size)), False, None, batching.pad_id
        )
        for i in range(0, usable, micro_batch_size)
    ]
    loss_fn = partial(nll_loss, 1.0, vocab_group(actor.pg))
    metrics = train_step(actor.engine, microbatches, loss_fn, lm_head=True)
    return {f"actor/{k}": v for k, v in metrics.items()} | {"kept": float(usable)}
