"""The typed batch that flows through a PPO step (rollout -> score -> advantages -> update)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class Experience:
    """One rollout batch of this data-parallel rank; every pipeline/TP rank holds a copy.

    Layout: ``sequences = [left-padded prompt (P) | response (N), padded after EOS]``; the
    response token at column ``P + t`` is predicted from position ``P + t - 1``, so every
    per-token tensor below is (B, N) and aligned with ``response_mask``.
    """

    sequences: torch.Tensor  # (B, P + N) prompt ids then response ids
    attention_mask: torch.Tensor  # (B, P + N) 1 on prompt and response tokens
    response_mask: torch.Tensor  # (B, N) 1 on generated tokens (EOS included)
    prompt_index: torch.Tensor  # (B,) index of each prompt in the prompt dataset
    prompt_length: int  # P, the padded prompt width
    # (B, N) log mu(a_t|s_t): under the distribution the rollout sampled from (temperature,
    # top-p renormalised; generation/decode.py sampled_logprobs)
    rollout_logprobs: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None  # (B, N) log pi_old(a_t|s_t) of the actor, at T
    # (B, N) log pi_old(a_t|s_t) under the sampler's transform (at T, cut to pi_old's top-p
    # nucleus and renormalised); None where rollout.top_p = 1: it is then ``logprobs``
    old_sampler_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # (B, N) log pi_ref(a_t|s_t)
    values: torch.Tensor | None = None  # (B, N) critic V(s_t)
    scores: torch.Tensor | None = None  # (B,) AM advantage a(x, y) or RM reward r(x, y)
    rewards: torch.Tensor | None = None  # (B, N) KL-shaped per-token rewards (Eq. 2)
    advantages: torch.Tensor | None = None  # (B, N) whitened GAE advantages
    returns: torch.Tensor | None = None  # (B, N) the critic's targets (ppo/correction.py)
    kl: torch.Tensor | None = None  # (B, N) per-token KL estimate
    is_weights: torch.Tensor | None = None  # (B, N) truncated pi_old / mu (rollout correction)
    value_weights: torch.Tensor | None = None  # (B, N) weights of the critic's targets, or None
    policy_version: torch.Tensor | None = None  # (B,) the step of the actor that generated it
    generate_s: float | None = None  # seconds the rollout ranks took (disaggregated placement)

    @property
    def responses(self) -> torch.Tensor:  # (B, N)
        return self.sequences[:, self.prompt_length :]

    def sampled_old_logprobs(self) -> torch.Tensor:
        """(B, N) log pi_old(a_t|s_t) under the sampler's transform, comparable with
        ``rollout_logprobs`` (mu): so pi_old/mu is 1 (to rounding) when the rollout's actor is
        pi_old. It is the numerator of the importance weight toward the behaviour policy (the
        decoupled objective, V-trace, the KL metric on stale samples)."""
        return self.logprobs if self.old_sampler_logprobs is None else self.old_sampler_logprobs

    def behaviour_log_ratio(self) -> torch.Tensor:
        """(B, N) log pi_old/mu of each token (:meth:`sampled_old_logprobs`)."""
        return self.sampled_old_logprobs() - self.rollout_logprobs

    def select(self, rows: torch.Tensor) -> Experience:
        """The experience of the given rows (for minibatches)."""
        picked = {}
        for field in fields(self):
            value = getattr(self, field.name)
            picked[field.name] = value[rows] if isinstance(value, torch.Tensor) else value
        return replace(self, **picked)
