"""Reward Model and Advantage Model losses (paper §2 Eq. 1, §3.1 Eqs. 5-8): pure tensor math.

Tensors in, tensors out: no torch.distributed, no I/O. Every loss is the mean over the pairs it
is given and comes with detached metrics for logging. The model side (r read at the last token
of (x, y), e_τ(x) read at the last prompt token through its own scalar head, in the same forward
pass) lives in the training code; these functions only see the resulting scalars.

How this departs from, or pins down, the paper:
- Eq. 8's N is, as the paper says, a hyperparameter that weighs the current policy against the
  K policies that collected the comparisons; the paper gives no value. We default to N = K + 1
  (the current policy weighs as much as each collecting policy) and require N >= K, so the
  weight (N - K)/N of e_τ(x) is never negative.
- The importance weights w_k = π_φ(y|x) / π'_k(y|x) come from pre-computed per-response
  log-probs (data, so the gradient flows through r and e_τ only) and are clipped per weight:
  w_k <- min(w_k, w_max), w_max = ``max_weight`` (default 1, truncated importance sampling as
  in V-trace/Retrace). Unclipped, Eq. 8 reads a = (1 - S)·r - (N-K)/N·e_τ with S = Σ_k w_k/N,
  and one response that π_φ likes far more than its collecting policy (w_k in the hundreds for
  a sequence-level ratio) makes S > 1: a then *falls* as r rises and the ranking term of Eq. 6
  trains r the wrong way for that pair. We require K·w_max < N, so S <= K·w_max/N < 1 and a
  stays strictly increasing in r for every response (with the defaults N = K + 1, w_max = 1:
  S <= K/(K+1)). Weights at or below w_max, i.e. responses the current policy finds no more
  likely than the collecting one, are exactly the paper's; the clip only biases the rest
  downward. We chose a per-weight clip over renormalising Σ_k w_k per response because it
  changes nothing where Eq. 8 is well behaved and depends on no other response or batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_rlhf.reward.config import DEFAULT_MARGIN


def bradley_terry_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eq. 1: ``L_RM = -mean log σ(r(x, y_c) - r(x, y_r))`` over the pairs.

    chosen_rewards, rejected_rewards: (B,) scores of the chosen and rejected responses.
    Returns the scalar loss and detached metrics (accuracy counts ties as wrong).
    """
    _check_pair_shapes(chosen_rewards, rejected_rewards)
    reward_gap = chosen_rewards - rejected_rewards  # (B,)
    loss = -F.logsigmoid(reward_gap).mean()
    return loss, _pair_metrics(chosen_rewards, rejected_rewards)


def advantage(
    rewards: torch.Tensor,
    expected_rewards: torch.Tensor,
    policy_logprobs: torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_mask: torch.Tensor | None = None,
    num_policies: float | None = None,
    max_weight: float = 1.0,
) -> torch.Tensor:
    """Eq. 8: ``a = r - (N-K)/N · e_τ(x) - Σ_k (1/N) · w_k · r``,
    ``w_k = min(π_φ(y|x) / π'_k(y|x), max_weight)`` (clipped: see the module docstring).

    rewards:            (B,) r(x, y), the reward head at the last token of (x, y).
    expected_rewards:   (B,) e_τ(x) of Eq. 7, the expected-reward head at the last prompt token.
    policy_logprobs:    (B,) log π_φ(y|x) under the policy whose expected reward e_τ models.
    behaviour_logprobs: (B, K) log π'_k(y|x) under each of the K policies that collected the
                        comparison data. Give both log-prob tensors or neither; with neither,
                        K = 0 and ``a = r - e_τ(x)``.
    behaviour_mask:     (B, K) bool, True where log π'_k(y|x) is known; rows may hold fewer
                        than K (ragged), and each row then uses its own K. Default: all known.
    num_policies:       N of Eq. 8, a hyperparameter >= K; default K + 1 (see module docstring).
    max_weight:         w_max, the clip of each w_k; K · max_weight < N is required, so that
                        Σ_k w_k / N < 1 and a rises with r.
    Returns a: (B,).
    """
    if rewards.shape != expected_rewards.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and expected_rewards "
            f"{tuple(expected_rewards.shape)} must both have shape (B,)"
        )
    if (policy_logprobs is None) != (behaviour_logprobs is None):
        raise ValueError("give both policy_logprobs and behaviour_logprobs, or neither")
    if behaviour_logprobs is None:
        if behaviour_mask is not None or num_policies is not None:
            raise ValueError("behaviour_mask/num_policies need behaviour_logprobs")
        return rewards - expected_rewards
    batch, max_policies = behaviour_logprobs.shape
    if policy_logprobs.shape != rewards.shape or batch != rewards.shape[0]:
        raise ValueError(
            f"policy_logprobs {tuple(policy_logprobs.shape)} must be (B,) and "
            f"behaviour_logprobs {tuple(behaviour_logprobs.shape)} (B, K) with B = {len(rewards)}"
        )
    if behaviour_mask is None:
        behaviour_mask = torch.ones_like(behaviour_logprobs, dtype=torch.bool)
    elif behaviour_mask.shape != behaviour_logprobs.shape:
        raise ValueError(
            f"behaviour_mask {tuple(behaviour_mask.shape)} must match behaviour_logprobs "
            f"{tuple(behaviour_logprobs.shape)}"
        )
    num_policies = float(max_policies + 1 if num_policies is None else num_policies)
    if num_policies <= 0 or num_policies < max_policies:
        raise ValueError(f"num_policies N = {num_policies} must be > 0 and >= K = {max_policies}")
    if not 0 < max_weight or max_policies * max_weight >= num_policies:
        raise ValueError(
            f"max_weight = {max_weight} must be > 0 with K · max_weight < N (K = "
            f"{max_policies}, N = {num_policies}), or Σ_k w_k / N can reach 1 and invert r"
        )
    policies_per_row = behaviour_mask.sum(dim=-1).to(rewards.dtype)  # (B,) K of each row
    log_ratio = policy_logprobs.unsqueeze(-1) - behaviour_logprobs  # (B, K)
    log_ratio = log_ratio.masked_fill(~behaviour_mask, 0.0)  # unknown entries may hold NaN
    log_ratio = log_ratio.clamp(max=math.log(max_weight))  # w_k <= w_max, no overflow
    weights = torch.where(behaviour_mask, log_ratio.exp(), 0.0)  # (B, K) w_k
    weight_sum = weights.sum(dim=-1).to(rewards.dtype)  # (B,) Σ_k w_k
    expected_weight = (num_policies - policies_per_row) / num_policies  # (B,) (N-K)/N
    return rewards - expected_weight * expected_rewards - weight_sum / num_policies * rewards


def advantage_model_loss(
    chosen_advantages: torch.Tensor,
    rejected_advantages: torch.Tensor,
    margin: float | torch.Tensor = DEFAULT_MARGIN,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eq. 6: ``L_AM = -mean[log σ(a_c - a_r) + log σ(m(x) - a_c) + log σ(m(x) + a_r)]``.

    chosen_advantages, rejected_advantages: (B,) a(x, y_c), a(x, y_r) from :func:`advantage`.
    margin: m(x), a float or a (B,) tensor (one margin per prompt).
    e_τ cancels in the ranking term; it is learned only through the two bounding terms.
    Returns the scalar loss and detached metrics, including the ranking and bounding parts and
    the share of scores outside ±m.
    """
    _check_pair_shapes(chosen_advantages, rejected_advantages)
    if isinstance(margin, torch.Tensor) and margin.shape not in (
        torch.Size([]),
        chosen_advantages.shape,
    ):
        raise ValueError(f"margin {tuple(margin.shape)} must be a scalar or (B,)")
    ranking = -F.logsigmoid(chosen_advantages - rejected_advantages)  # (B,)
    bounding = -F.logsigmoid(margin - chosen_advantages) - F.logsigmoid(
        margin + rejected_advantages
    )  # (B,)
    loss = (ranking + bounding).mean()
    metrics = _pair_metrics(chosen_advantages, rejected_advantages)
    with torch.no_grad():
        scores = torch.stack([chosen_advantages, rejected_advantages])  # (2, B)
        metrics.update(
            ranking_loss=ranking.detach().mean(),
            bounding_loss=bounding.detach().mean(),
            outside_margin=(scores.abs() > margin).float().mean(),
        )
    return loss, metrics


def _check_pair_shapes(chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    if chosen.shape != rejected.shape or chosen.dim() != 1 or chosen.numel() == 0:
        raise ValueError(
            f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} scores must "
            "both have the same non-empty shape (B,)"
        )


def _pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {
            "accuracy": (chosen > rejected).float().mean(),
            "chosen_mean": chosen.float().mean(),
            "rejected_mean": rejected.float().mean(),
            "score_gap": (chosen - rejected).float().mean(),
        }
