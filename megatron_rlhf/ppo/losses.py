"""PPO-SR losses (paper Eqs. 2 and 9): pure tensor math, no torch.distributed, no I/O.

Every PPO loss is a token mean over its mask and comes with detached metrics. ``ppo_sr_loss``
is Eq. 9: the clipped PPO policy loss plus ``gamma`` times the NLL of a rehearsal batch drawn
from D_R, added before the single backward. The paper's NLL sums the log-likelihood over a
sequence's tokens and averages over sequences (``sft_nll(..., "sum")``, PPO's default), so its
γ = 0.01 weighs a rehearsal token 0.01 / (rehearsal rows): a 200-token response pulls 200 times
harder than a 1-token one, and the term is ~|y| times a token mean. ``"mean"`` (a token mean,
like the PPO loss) makes γ the weight of the per-token NLL; γ_mean ≈ γ_sum · (mean response
length) gives the same pull on average.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor, count=None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1 (0 when the mask is empty).

    ``count``: divide the masked sum by this instead (the token count of the global batch
    that this microbatch is a part of: the parts then add up to the global token mean).
    """
    mask = mask.to(x.dtype)
    denominator = mask.sum().clamp(min=1.0) if count is None else max(float(count), 1.0)
    return (x * mask).sum() / denominator


def policy_loss(
    logprobs: torch.Tensor,  # (B, N) log pi_theta(a_t|s_t), differentiable
    old_logprobs: torch.Tensor,  # (B, N) log pi_old(a_t|s_t) at rollout time
    advantages: torch.Tensor,  # (B, N)
    mask: torch.Tensor,  # (B, N) response mask
    clip_ratio: float = 0.2,
    count=None,
    weights: torch.Tensor | None = None,  # (B, N) behaviour correction, see below
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective (Schulman et al., 2017), negated to a loss; token means
    over ``mask`` (or sums divided by ``count``, see :func:`masked_mean`). ``weights``
    (constants from :func:`behaviour_correction`) multiply each token's clipped term: the
    decoupled objective for samples drawn from a behaviour policy mu != pi_old."""
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    surrogate = torch.maximum(unclipped, clipped)
    if weights is not None:
        surrogate = surrogate * weights
    loss = masked_mean(surrogate, mask, count)
    with torch.no_grad():
        metrics = {
            "clip_fraction": masked_mean((clipped > unclipped).float(), mask, count),
            # Schulman's k3 estimator of KL(pi_old || pi_theta): non-negative, low variance.
            "approx_kl": masked_mean(torch.expm1(-log_ratio) + log_ratio, mask, count),
        }
    return loss, metrics


ROLLOUT_CORRECTIONS = ("none", "token_tis", "seq_tis")
IS_MODES = ("clip", "mask")


def behaviour_correction(
    old_logprobs: torch.Tensor,  # (B, N) log pi_old(a_t|s_t), the proximal policy
    behaviour_logprobs: torch.Tensor,  # (B, N) log mu(a_t|s_t), the policy that sampled
    mask: torch.Tensor,  # (B, N) response mask
    mode: str,
    cap: float,
    above_cap: str = "clip",
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """Truncated importance weights toward the behaviour policy, and what they did.

    The rollout engine samples from mu (vLLM's kernels, bf16 decode, stale weights), which is
    not exactly pi_old. PPO's gradient at theta = theta_old is E_pi_old[A grad log pi]; on
    samples from mu it needs the weight pi_old / mu. ``token_tis``: per token,
    ``min(pi_old/mu, cap)``; ``seq_tis``: per sequence, ``min(prod_t pi_old/mu, cap)`` on
    every token of it (exact for sequence-level rewards, higher variance). Truncation bounds the
    variance at the cost of a bias where the ratio exceeds the cap. ``none``: no weights.
    ``above_cap``: what a ratio above ``cap`` becomes: ``clip``, the cap (TIS); ``mask``, 0
    (the token, or with ``seq_tis`` the sequence, leaves the policy term: AReaL's behaviour
    mask).
    Metrics (token means over ``mask``): the weights' mean, max and capped fraction, and
    ``kl_behaviour_old`` = KL(mu || pi_old) by Schulman's k3 on mu's samples."""
    valid = mask.bool()
    if mode == "none":
        return None, {}
    log_ratio = (old_logprobs - behaviour_logprobs).double() * mask
    if mode == "token_tis":
        raw = log_ratio.exp()
    elif mode == "seq_tis":
        raw = log_ratio.sum(dim=1, keepdim=True).exp().expand_as(log_ratio)
    else:
        raise ValueError(f"rollout correction must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    if above_cap not in IS_MODES:
        raise ValueError(f"above_cap must be one of {IS_MODES}, got {above_cap!r}")
    weights = raw.clamp(max=cap) if above_cap == "clip" else raw.masked_fill(raw > cap, 0.0)
    token_ratio = log_ratio.exp()
    k3 = token_ratio - 1 - log_ratio  # KL(mu || pi_old) on samples from mu
    count = valid.sum().clamp(min=1)
    metrics = {
        "is_weight_mean": float(weights[valid].sum() / count),
        "is_weight_max": float(weights[valid].max()) if valid.any() else 1.0,
        "is_capped_fraction": float((raw[valid] > cap).sum() / count),
        "kl_behaviour_old": float(k3[valid].sum() / count),
    }
    return weights.to(old_logprobs.dtype).masked_fill(~valid, 0.0), metrics


def value_loss(
    values: torch.Tensor,  # (B, N) V_phi(s_t), differentiable
    old_values: torch.Tensor,  # (B, N) values at rollout time
    returns: torch.Tensor,  # (B, N) GAE returns
    mask: torch.Tensor,  # (B, N)
    clip_range: float = 0.2,
    count=None,
    weights: torch.Tensor | None = None,  # (B, N) per-token weights of the targets, see below
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)``, a token
    mean over ``mask`` (or divided by ``count``); with ``weights`` (constants, e.g. the
    importance weights of ``advantages.suffix_is_targets``, mean 1) each token's term times
    its weight: a weighted least-squares fit of the targets."""
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)
    unclipped_error = (values - returns).square()
    clipped_error = (clipped_values - returns).square()
    error = torch.maximum(unclipped_error, clipped_error)
    if weights is not None:
        error = error * weights
    loss = 0.5 * masked_mean(error, mask, count)
    with torch.no_grad():
        # clipped: outside the band and worse for it; inside it, old + (V - old) is V up to
        # rounding, which must not count (a tie broken by the last bit)
        clipped = ((values - old_values).abs() > clip_range) & (clipped_error > unclipped_error)
        metrics = {"value_clip_fraction": masked_mean(clipped.float(), mask, count)}
    return loss, metrics


def sft_nll(
    logprobs: torch.Tensor,  # (B, T) log pi(x_t | x_<t) of each target token
    loss_mask: torch.Tensor,  # (B, T) 1 on response tokens of the rehearsal pair
    reduction: str,
    count=None,
) -> torch.Tensor:
    """Negative log-likelihood of a supervised (rehearsal) batch.

    ``sum`` (Eq. 9 as written: ``E_(x,y)~D_R Σ_t``): summed over each sequence's response
    tokens, averaged over the sequences. ``mean``: averaged over every response token of the
    batch (a per-token NLL, independent of response lengths). ``count``: the number of
    sequences (``sum``) or response tokens (``mean``) of the global batch this microbatch is a
    part of, to divide by instead of this microbatch's: the parts then add up to the global
    value.
    """
    mask = loss_mask.to(logprobs.dtype)
    if reduction == "sum":
        total = (logprobs * mask).sum()
        return -total / (max(float(count), 1.0) if count is not None else max(mask.shape[0], 1))
    if reduction == "mean":
        return -masked_mean(logprobs, loss_mask, count)
    raise ValueError(f"reduction must be sum or mean, got {reduction!r}")


def ppo_sr_loss(
    ppo_loss: torch.Tensor, rehearsal_nll: torch.Tensor | None, gamma: float
) -> torch.Tensor:
    """Eq. 9: ``L = L_PPO + gamma * NLL(D_R batch)`` (just ``L_PPO`` without rehearsal)."""
    if rehearsal_nll is None:
        return ppo_loss
    return ppo_loss + gamma * rehearsal_nll


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the mask: 1 is a perfect critic, <= 0 a useless one."""
    valid = mask.bool()
    residual, target = (returns - values)[valid].double(), returns[valid].double()
    if target.numel() < 2 or float(target.var()) == 0.0:
        return float("nan")
    return float(1.0 - residual.var() / target.var())
