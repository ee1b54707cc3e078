"""The rollout engine: batched, left-padded, KV-cached generation at any TP/PP."""

from megatron_rlhf.generation.engine import GenerationOutput, SamplingConfig, generate

__all__ = ["GenerationOutput", "SamplingConfig", "generate"]
