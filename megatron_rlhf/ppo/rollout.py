"""Stage 1, rollout: sample responses of the actor with the KV-cached generation engine."""

from __future__ import annotations

import torch

from megatron_rlhf.generation import SamplingConfig, generate
from megatron_rlhf.ppo.experience import Experience


def rollout(actor, prompts: dict, sampling: SamplingConfig) -> Experience:
    """Generate one response per prompt; ``prompts`` is ``collate_prompts`` output."""
    prompt_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]  # (B, P)
    out = generate(actor, prompt_ids, prompt_mask, sampling)
    device = out.response_ids.device  # the compute device: the experience stays there
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    return Experience(
        sequences=torch.cat([prompt_ids, out.response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, out.response_mask], dim=1),
        response_mask=out.response_mask,
        prompt_index=prompts["index"],
        prompt_length=prompt_ids.shape[1],
    )
