"""Stage 3, advantages: score normalisation, KL-shaped rewards (Eq. 2), GAE, whitening.

All per-token math runs in the fused kernels. ``train-ppo`` holds the global batch on every
rank, so statistics are global; with a batch split over a data-parallel group, pass the group
and the mean/variance reductions span it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rlhf.kernels import gae, kl_penalty, masked_whiten, shaped_rewards
from megatron_rlhf.ppo.control import KLController, RewardNormalizer
from megatron_rlhf.ppo.experience import Experience


def global_mean_var(x: torch.Tensor, group) -> tuple[float, float]:
    """Mean and (population) variance of ``x`` over every data-parallel rank."""
    mean, var, _ = global_moments(x, group)
    return mean, var


def global_moments(x: torch.Tensor, group) -> tuple[float, float, int]:
    """Mean, (population) variance and element count of ``x`` over every data-parallel rank."""
    moments = torch.stack(
        [
            x.double().sum(),
            x.double().square().sum(),
            torch.tensor(x.numel(), dtype=torch.float64, device=x.device),
        ]
    )
    if group is not None:
        dist.all_reduce(moments, group=group)
    total, total_sq, count = moments.tolist()
    mean = total / count
    return mean, max(total_sq / count - mean * mean, 0.0), int(count)


def compute_advantages(
    experience: Experience,
    kl_controller: KLController,
    normalizer: RewardNormalizer,
    kl_kind: str,
    gamma: float,
    lam: float,
    whiten: bool = True,
    group=None,
) -> Experience:
    """Fill kl, rewards, advantages and returns. ``group``: the DP group whose ranks each hold
    a part of the batch (None: this rank holds the whole batch)."""
    shift, scale = normalizer(*global_mean_var(experience.scores, group))
    scores = (experience.scores - shift) / scale  # (B,)
    mask = experience.response_mask
    kl = kl_penalty(experience.logprobs, experience.ref_logprobs, kl_kind) * mask  # (B, N)
    rewards = shaped_rewards(scores, kl, mask, kl_controller.coef)  # (B, N)
    advantages, returns = gae(rewards, experience.values, mask, gamma, lam)
    if whiten:
        advantages = masked_whiten(advantages, mask, group=group)
    experience.kl, experience.rewards = kl, rewards
    experience.advantages, experience.returns = advantages, returns
    return experience
