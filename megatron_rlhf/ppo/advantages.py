"""Stage 3, advantages: score normalisation, KL-shaped rewards (Eq. 2), the actor's GAE
advantages and whitening; and the estimators of the critic's targets that ppo/correction.py's
critic-target objects call: GAE's returns, :func:`vtrace` and :func:`suffix_is_targets`.

The per-token math of the synchronous step runs in the fused kernels; :func:`vtrace` and
:func:`suffix_is_targets` (the critic's targets on stale samples, ``async.value_targets``) are
plain PyTorch. ``train-ppo`` holds the global batch on every rank, so the statistics here are
global; the reductions (:func:`global_moments`) take a data-parallel group for a batch split
over one.
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
    experience: Experience, kl_controller: KLController, normalizer: RewardNormalizer, ppo
) -> Experience:
    """Fill kl, rewards and the actor's advantages of the global batch (every rank holds it),
    by the ``ppo`` section's ``kl.estimator``, ``gamma``, ``lam`` and ``whiten_advantages``:
    GAE(gamma, lam) with the current critic's values, on whichever policy's samples (the
    behaviour policy mu's when stale: the policy term's weight pi_old/mu corrects the action,
    ``losses.behaviour_correction``). The critic's targets (``returns``) are the critic-target
    object's (ppo/correction.py), filled after this."""
    shift, scale = normalizer(*global_mean_var(experience.scores, None))
    scores = (experience.scores - shift) / scale  # (B,)
    mask = experience.response_mask
    kl = kl_penalty(experience.logprobs, experience.ref_logprobs, ppo.kl.estimator) * mask  # (B, N)
    rewards = shaped_rewards(scores, kl, mask, kl_controller.coef)  # (B, N)
    advantages, _ = gae(rewards, experience.values, mask, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask)
    experience.kl, experience.rewards, experience.advantages = kl, rewards, advantages
    return experience


def suffix_is_targets(
    rewards: torch.Tensor,  # (B, T) r_t
    mask: torch.Tensor,  # (B, T) response mask, each row 0..0 1..1 0..0
    log_ratio: torch.Tensor,  # (B, T) log pi(a_t|x_t) - log mu(a_t|x_t) of the sampled tokens
    gamma: float,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Monte-Carlo returns of actions sampled by a behaviour policy mu and the weights that
    make a weighted least-squares fit of them estimate the target policy pi's value:
    ``(returns, weights, ess)``.

    - ``returns``: ``G_t = sum_{k>=t} gamma^(k-t) r_k`` to the end of the response (lambda 1,
      no bootstrap).
    - ``weights``: ``w_t = min(prod_{k=t}^{T-1} pi(a_k|x_k)/mu(a_k|x_k), cap)``, times one
      constant that makes their mean over the batch's response tokens 1. The product starts at
      t itself: V^pi(x_t) = E_pi[G_t | x_t] and every action from a_t on was drawn by mu, so
      E_mu[prod_{k>=t} (pi/mu)_k G_t | x_t] = V^pi(x_t) (importance sampling of the return
      over the suffix; per-decision IS, Precup et al. 2000, would weigh r_k by the product to k
      only, the same for the response's final score, which is most of G). The minimiser of
      ``sum w_t (V(x_t) - G_t)^2`` at a state is the self-normalised estimate ``sum w G /
      sum w`` over its visits, which any constant factor leaves as it is: normalising over all
      tokens (not per position, whose factor would differ between the visits of a state met
      at several positions) only keeps the weighted loss on the scale of the unweighted one.
      ``cap`` bounds the variance at the cost of a bias toward mu where the product passes it.
    - ``ess``: the weights' effective sample size per token, ``(sum w)^2 / (N sum w^2)`` over
      the N response tokens (1: all equal; 1.0 on an empty batch).

    At pi = mu the weights are exactly 1 and ``returns`` the plain Monte-Carlo returns. Both
    are 0 where the mask is 0; the weights are float64 products (exp of a float64 sum, so no
    product overflows before the cap).
    """
    if cap <= 0:
        raise ValueError(f"suffix_is_targets: cap must be > 0, got {cap}")
    m = (mask != 0).double()
    returns = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[1]  # values 0: G_t
    log_suffix = (log_ratio.double() * m).flip(1).cumsum(1).flip(1)  # sum_{k>=t} log(pi/mu)_k
    weights = log_suffix.exp().clamp(max=cap) * m
    count, total = float(m.sum()), float(weights.sum())
    if count == 0:
        return returns, weights.to(returns.dtype), 1.0
    ess = total * total / (count * float(weights.square().sum())) if total > 0 else 0.0
    scale = count / total if total > 0 else 0.0
    return returns, (weights * scale).to(returns.dtype), ess


def importance_weighted_kl(
    logprobs: torch.Tensor,  # (B, T) log pi_old(a_t|x_t)
    ref_logprobs: torch.Tensor,  # (B, T) log pi_ref(a_t|x_t)
    log_weights: torch.Tensor,  # (B, T) log pi_old/mu of the tokens (mu: who sampled them)
    mask: torch.Tensor,  # (B, T) response mask
) -> float:
    """KL(pi_old || pi_ref) per sequence, estimated on tokens sampled by a behaviour policy mu:
    Schulman's k3, ``k3_t = r_t - 1 - log r_t`` with ``r_t = pi_ref/pi_old``, weighted by
    ``w_t = pi_old/mu`` and self-normalised over the batch's response tokens,
    ``sum w k3 / sum w``, times the mean response length (tokens / rows), the per-sequence
    unit of ``kl/mean`` and of the adaptive controller's target.

    Why not the mean of the reward's k1, ``log pi_old - log pi_ref``, as on fresh samples: on
    mu's samples its expectation is KL(mu || pi_ref) - KL(mu || pi_old), which goes negative
    on stale batches. k3 >= 0 for every token, and so is any weighted mean of it; the weights
    make it an estimate under pi_old of the states mu visited (self-normalising trades a small
    bias for bounded variance). At w = 1 (staleness 0) it is the plain token mean of k3:
    unbiased, like k1, and never negative. Weights are computed relative to the largest, so
    that no exp overflows; the self-normalisation cancels the shift. float64 throughout."""
    m = (mask != 0).double()
    log_w = log_weights.double().masked_fill(m == 0, float("-inf"))
    if not bool(m.any()):
        return 0.0
    w = (log_w - log_w.max()).exp() * m
    log_r = (ref_logprobs.double() - logprobs.double()) * m
    k3 = torch.expm1(log_r) - log_r
    per_token = float((w * k3).sum() / w.sum())
    return per_token * float(m.sum()) / mask.shape[0]


def vtrace(
    rewards: torch.Tensor,  # (B, T) r_t
    values: torch.Tensor,  # (B, T) V(x_t), the current critic's
    mask: torch.Tensor,  # (B, T) response mask, each row 0..0 1..1 0..0
    log_ratio: torch.Tensor,  # (B, T) log pi(a_t|x_t) - log mu(a_t|x_t)
    gamma: float,
    lam: float,
    rho_bar: float,
    c_bar: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace (Espeholt et al., 2018, Eq. 1) with GAE's lambda: ``(advantages, returns)``
    for actions sampled from a behaviour policy mu, toward the target policy pi.

    With ``ratio_t = pi/mu``, ``rho_t = min(rho_bar, ratio_t)``, ``c_t = lam * min(c_bar,
    ratio_t)`` and ``delta_t = r_t + gamma * V(x_{t+1}) - V(x_t)`` (V after the last response
    token is 0):

    - value targets (``returns``): ``v_s = V(x_s) + sum_{t>=s} gamma^(t-s) (prod_{i=s}^{t-1}
      c_i) rho_t delta_t``, i.e. ``v_s - V(x_s) = rho_s delta_s + gamma c_s (v_{s+1} -
      V(x_{s+1}))``. Their fixed point is the value of pi_rho_bar ∝ min(rho_bar mu, pi),
      which is pi itself where rho_bar >= pi/mu (not mu's, which GAE on mu's samples learns).
    - policy advantages: ``A_s = delta_s + gamma lam (v_{s+1} - V(x_{s+1}))`` = ``r_s +
      gamma ((1 - lam) V(x_{s+1}) + lam v_{s+1}) - V(x_s)``: IMPALA's ``r_s + gamma v_{s+1} -
      V(x_s)`` with its bootstrap mixed with the one-step value by lambda, so that at ratio 1
      (rho = 1, c = lam) ``v_s - V(x_s)`` and ``A_s`` both are GAE(gamma, lam)'s advantage
      (returns = GAE's returns). The action a_s itself gets no rho_s here: the policy term
      weighs it (``losses.behaviour_correction``, the same truncation).

    Both are 0 where the mask is 0. A loop over T of (B,) operations (the per-step discount
    gamma * c_t varies, so GAE's discounted-sum matmuls do not apply); fp64 inputs stay fp64.
    """
    shapes = {tuple(t.shape) for t in (rewards, values, mask, log_ratio)}
    if len(shapes) != 1 or len(rewards.shape) != 2:
        raise ValueError(f"vtrace: expected tensors of one (B, T) shape, got {sorted(shapes)}")
    if min(rho_bar, c_bar) <= 0:
        raise ValueError(f"vtrace: rho_bar and c_bar must be > 0, got {rho_bar}, {c_bar}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    m = (mask != 0).to(dtype)
    v, ratio = values.to(dtype) * m, log_ratio.to(dtype).exp()
    rho, c = ratio.clamp(max=rho_bar), lam * ratio.clamp(max=c_bar)
    next_values = torch.nn.functional.pad(v[:, 1:], (0, 1))  # V(x_{t+1}) m_{t+1}, 0 at the end
    deltas = (rewards.to(dtype) + gamma * next_values - v) * m
    corrections = torch.zeros_like(v)  # v_t - V(x_t)
    advantages = torch.zeros_like(v)
    following = torch.zeros_like(v[:, 0])  # v_{t+1} - V(x_{t+1}), 0 past the response
    for t in range(v.shape[1] - 1, -1, -1):
        advantages[:, t] = (deltas[:, t] + gamma * lam * following) * m[:, t]
        following = (rho[:, t] * deltas[:, t] + gamma * c[:, t] * following) * m[:, t]
        corrections[:, t] = following
    return advantages, v + corrections
