"""Stage 4, update: PPO epochs over minibatches, actor and critic, with Selective Rehearsal.

Each minibatch is one optimizer step of each engine (Megatron's forward-backward schedule over
its microbatches). With rehearsal on, every actor microbatch carries extra rows from D_R: one
forward pass computes the PPO rows' clipped loss and the rehearsal rows' NLL, and
``L_PPO + gamma * NLL`` (Eq. 9) goes through the same backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from megatron_rlhf.kernels import token_logprobs
from megatron_rlhf.ppo.experience import Experience
from megatron_rlhf.ppo.losses import masked_mean, policy_loss, ppo_sr_loss, sft_nll, value_loss
from megatron_rlhf.ppo.scoring import response_logprobs, tp_group_or_none


def right_pad(rows: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=value)


def actor_microbatch(experience: Experience, rehearsal: dict | None, pad_id: int) -> dict:
    """PPO rows, then (optionally) rehearsal rows from ``collate_sft``, in one batch."""
    sequences, mask = experience.sequences, experience.attention_mask
    microbatch = {
        "num_ppo_rows": sequences.shape[0],
        "prompt_length": experience.prompt_length,
        "old_logprobs": experience.logprobs,
        "advantages": experience.advantages,
        "response_mask": experience.response_mask,
    }
    if rehearsal is not None:
        rehearsal = {key: value.to(sequences.device) for key, value in rehearsal.items()}
        width = max(sequences.shape[1], rehearsal["input_ids"].shape[1])
        sequences = torch.cat(
            [right_pad(sequences, width, pad_id), right_pad(rehearsal["input_ids"], width, pad_id)]
        )
        mask = torch.cat(
            [right_pad(mask, width, 0), right_pad(rehearsal["attention_mask"], width, 0)]
        )
        microbatch["rehearsal_loss_mask"] = right_pad(rehearsal["loss_mask"], width, 0)
    microbatch["input_ids"], microbatch["padding_mask"] = sequences, mask
    return microbatch


def actor_loss(
    clip_ratio: float,
    rehearsal_gamma: float,
    temperature: float,
    logits: torch.Tensor,
    mb: dict,
    rehearsal_nll_reduction: str = "sum",
):
    """The actor's loss on one microbatch from its vocab-sharded logits (B, S, V/tp)."""
    ppo_rows = mb["num_ppo_rows"]
    logprobs, entropy = response_logprobs(
        logits[:ppo_rows],
        mb["input_ids"][:ppo_rows],
        mb["prompt_length"],
        mb["response_mask"].shape[1],
        temperature,
        return_entropy=True,
    )
    loss_ppo, metrics = policy_loss(
        logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"], clip_ratio
    )
    metrics["policy_loss"] = loss_ppo.detach()
    metrics["entropy"] = masked_mean(entropy, mb["response_mask"]).detach()
    nll = None
    if "rehearsal_loss_mask" in mb:
        rehearsal_logits = logits[ppo_rows:, :-1]  # (R, S - 1, V/tp)
        targets = mb["input_ids"][ppo_rows:, 1:]  # (R, S - 1)
        rehearsal_logprobs = token_logprobs(rehearsal_logits, targets, 1.0, tp_group_or_none())
        nll = sft_nll(rehearsal_logprobs, mb["rehearsal_loss_mask"][:, 1:], rehearsal_nll_reduction)
        metrics["rehearsal_nll"] = nll.detach()
    return ppo_sr_loss(loss_ppo, nll, rehearsal_gamma), metrics


def critic_loss(value_clip: float, values: torch.Tensor, mb: dict):
    """The critic's clipped value loss from its (B, S, 1) outputs."""
    p, n = mb["prompt_length"], mb["response_mask"].shape[1]
    predicted = values[:, p - 1 : p - 1 + n, 0]  # (B, N) V(s_t)
    loss, metrics = value_loss(
        predicted, mb["old_values"], mb["returns"], mb["response_mask"], value_clip
    )
    metrics["value_loss"] = loss.detach()
    return loss, metrics


def ppo_update(
    experience: Experience,
    actor_engine,
    critic_engine,
    ppo,
    temperature: float,
    generator: torch.Generator,
    rehearsal_batches: Iterator[dict] | None = None,
    rehearsal_gamma: float = 0.0,
    pad_id: int = 3,
    rehearsal_nll_reduction: str = "sum",
) -> dict:
    """Run ``ppo.epochs`` epochs of ``ppo.num_minibatches`` optimizer steps; mean metrics."""
    batch = experience.sequences.shape[0]
    if batch % (ppo.num_minibatches * ppo.micro_batch_size):
        raise ValueError(
            f"rollout batch {batch} is not divisible by ppo.num_minibatches * "
            f"ppo.micro_batch_size = {ppo.num_minibatches} * {ppo.micro_batch_size}"
        )
    totals: dict[str, list[float]] = {}
    minibatch_size = batch // ppo.num_minibatches
    for _ in range(ppo.epochs):
        order = torch.randperm(batch, generator=generator)
        for start in range(0, batch, minibatch_size):
            rows = order[start : start + minibatch_size]
            micro = [
                experience.select(rows[i : i + ppo.micro_batch_size])
                for i in range(0, minibatch_size, ppo.micro_batch_size)
            ]
            actor_mbs = [
                actor_microbatch(m, next(rehearsal_batches) if rehearsal_batches else None, pad_id)
                for m in micro
            ]
            _pad_to_common_width(actor_mbs, pad_id)
            loss_fn = partial(
                actor_loss,
                ppo.clip_ratio,
                rehearsal_gamma,
                temperature,
                rehearsal_nll_reduction=rehearsal_nll_reduction,
            )
            actor_metrics = actor_engine.step(actor_mbs, loss_fn)
            critic_mbs = [
                {
                    "input_ids": m.sequences,
                    "padding_mask": m.attention_mask,
                    "prompt_length": m.prompt_length,
                    "old_values": m.values,
                    "returns": m.returns,
                    "response_mask": m.response_mask,
                }
                for m in micro
            ]
            critic_metrics = critic_engine.step(critic_mbs, partial(critic_loss, ppo.value_clip))
            for prefix, metrics in (("actor", actor_metrics), ("critic", critic_metrics)):
                for key, value in metrics.items():
                    totals.setdefault(f"{prefix}/{key}", []).append(value)
    return {key: sum(values) / len(values) for key, values in totals.items()}


def _pad_to_common_width(microbatches: list[dict], pad_id: int) -> None:
    """Megatron's schedules send fixed-shape activations: pad every microbatch of a step."""
    width = max(mb["input_ids"].shape[1] for mb in microbatches)
    for mb in microbatches:
        mb["input_ids"] = right_pad(mb["input_ids"], width, pad_id)
        mb["padding_mask"] = right_pad(mb["padding_mask"], width, 0)
        if "rehearsal_loss_mask" in mb:
            mb["rehearsal_loss_mask"] = right_pad(mb["rehearsal_loss_mask"], width, 0)
