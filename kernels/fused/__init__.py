"""Fused kernels for RLHF at BLOOM's vocabulary (250,880), installed as ``megatron_rlhf.kernels``.

- ``token_logprobs``: per-token log-probs (and entropy) from logits or their vocab-parallel shard,
  one pass over the vocabulary, one all-reduce over the TP group, a backward that recomputes.
- ``token_logprobs_from_hidden``: the same from hidden states and the (sharded) output weight,
  never materialising the logits (Cut-Cross-Entropy).
- ``kl_penalty``, ``shaped_rewards``, ``gae``, ``masked_whiten``: the per-token PPO quantities,
  one Triton kernel over the batch on GPU, vectorised (no loop over T) on CPU.
- ``fused_alibi_attention``, ``fused_packed_alibi_attention``: BLOOM's causal ALiBi attention as
  one Triton flash-attention kernel (forward and backward, O(S) memory), for padded and packed
  rows; Triton only (the PyTorch reference is ``models/bloom/attention.py``, which chooses).

Each has a PyTorch path (the reference, and the CPU path) and a Triton path, chosen per call
(``_dispatch.py``); ``pytorch_only()`` forces the former.
"""

from ._dispatch import pytorch_only
from .advantages import gae, kl_penalty, masked_whiten, shaped_rewards
from .alibi_attention import fused_alibi_attention, fused_packed_alibi_attention
from .hidden_logprobs import token_logprobs_from_hidden
from .logprobs import token_logprobs

__all__ = [
    "fused_alibi_attention",
    "fused_packed_alibi_attention",
    "gae",
    "kl_penalty",
    "masked_whiten",
    "pytorch_only",
    "shaped_rewards",
    "token_logprobs",
    "token_logprobs_from_hidden",
]
