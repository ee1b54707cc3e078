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
    rollout_logprobs: torch.Tensor | None = None  # (B, N) log pi(a_t|s_t) as sampled, T = 1
    logprobs: torch.Tensor | None = None  # (B, N) log pi_old(a_t|s_t) of the actor
    ref_logprobs: torch.Tensor | None = None  # (B, N) log pi_ref(a_t|s_t)
    values: torch.Tensor | None = None  # (B, N) critic V(s_t)
    scores: torch.Tensor | None = None  # (B,) AM advantage a(x, y) or RM reward r(x, y)
    rewards: torch.Tensor | None = None  # (B, N) KL-shaped per-token rewards (Eq. 2)
    advantages: torch.Tensor | None = None  # (B, N) whitened GAE advantages
    returns: torch.Tensor | None = None  # (B, N) GAE returns (critic targets)
    kl: torch.Tensor | None = None  # (B, N) per-token KL estimate
    is_weights: torch.Tensor | None = None  # (B, N) truncated pi_old / mu (rollout correction)
    policy_version: torch.Tensor | None = None  # (B,) the step of the actor that generated it
    generate_s: float | None = None  # seconds the rollout ranks took (disaggregated placement)

    @property
    def responses(self) -> torch.Tensor:  # (B, N)
        return self.sequences[:, self.prompt_length :]

    def select(self, rows: torch.Tensor) -> Experience:
        """The experience of the given rows (for minibatches)."""
        picked = {}
        for field in fields(self):
            value = getattr(self, field.name)
            picked[field.name] = value[rows] if isinstance(value, torch.Tensor) else value
        return replace(self, **picked)
