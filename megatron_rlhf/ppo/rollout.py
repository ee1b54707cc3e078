"""Stage 1, rollout: sample responses of the actor with the KV-cached generation engine."""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_rlhf.distributed.handoff import for_each_dp_shard
from megatron_rlhf.generation import GenerationOutput, SamplingConfig
from megatron_rlhf.ppo.experience import Experience


def rollout(engine, prompts: dict, sampling: SamplingConfig) -> Experience:
    """One response per prompt of this rank's ``prompts`` (``collate_prompts`` output) from a
    :class:`~megatron_rlhf.generation.rollout_engines.RolloutEngine`."""
    out = engine.generate(prompts["input_ids"], prompts["attention_mask"], sampling)
    return experience_of(prompts, out.response_ids, out.response_mask, out.response_logprobs)


def rollout_global(engine, prompts: dict, sampling: SamplingConfig, row_seeds) -> Experience:
    """The global batch's responses on every rank: each DP rank of ``engine.groups`` generates
    its rows (row ``i`` sampled from ``row_seeds[i]``), then the rows are gathered back."""

    def generate(rows):
        out: GenerationOutput = engine.generate(
            prompts["input_ids"][rows],
            prompts["attention_mask"][rows],
            replace(sampling, row_seeds=tuple(int(row_seeds[row]) for row in rows)),
        )
        return {
            "ids": out.response_ids,
            "mask": out.response_mask,
            "logprobs": out.response_logprobs,
        }

    batch = prompts["input_ids"].shape[0]
    out = for_each_dp_shard(engine.groups.dp, batch, generate, {"ids": sampling.pad_id})
    return experience_of(prompts, out["ids"], out["mask"], out["logprobs"])


def step_row_seeds(seed: int, step: int, rows: int) -> list[int]:
    """The sampling seed of each row of a step's global batch: a function of (seed, step,
    global row) only, so every layout draws the same samples."""
    return [(seed * 1_000_003 + step) * 100_003 + row for row in range(rows)]


def experience_of(prompts: dict, response_ids, response_mask, rollout_logprobs) -> Experience:
    """The Experience of ``prompts`` (``collate_prompts`` output) and their responses."""
    device = response_ids.device  # the compute device: the experience stays there
    prompt_ids = prompts["input_ids"].to(device)  # (B, P)
    prompt_mask = prompts["attention_mask"].to(device)
    return Experience(
        sequences=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        response_mask=response_mask,
        prompt_index=prompts["index"],
        prompt_length=prompt_ids.shape[1],
        rollout_logprobs=rollout_logprobs,
    )
