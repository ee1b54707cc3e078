"""BLOOM on Megatron-Core: ALiBi core attention, layer spec, trunk with LM or scalar head."""

from megatron_rlhf.models.bloom.alibi import alibi_slopes, alibi_slopes_for_rank
from megatron_rlhf.models.bloom.config import (
    BloomArchitecture,
    padded_vocab_size,
    transformer_config,
)
from megatron_rlhf.models.bloom.model import BloomModel, attention_mask_for

__all__ = [
    "BloomArchitecture",
    "BloomModel",
    "alibi_slopes",
    "alibi_slopes_for_rank",
    "attention_mask_for",
    "padded_vocab_size",
    "transformer_config",
]
