"""Core attention with ALiBi for Megatron-Core's ``SelfAttention`` (the ``core_attention`` slot).

Megatron-Core 0.16.1 has no ALiBi: its local ``DotProductAttention`` asserts ``attention_bias is
None`` and ``TEDotProductAttention`` never passes ``"alibi"``. :class:`AlibiDotProductAttention`
is a pure-PyTorch core attention computing what transformers' ``BloomAttention`` computes:

    scores = slope_h * pos_k + (q . k) / sqrt(d)        (pos_k from the padding mask)
    probs  = softmax_fp32(scores masked with the causal + padding mask)
    out    = probs @ v

Key positions come from the attention mask, so left-padded rows see the same biases as their
unpadded selves. The mask is Megatron's boolean convention (True = masked), shape
(B, 1, Sq, Sk); the last query row of a causal+padding mask sees every valid key, which is how
the key-padding mask is recovered. With a KV cache (Sq = 1, Sk = cached + 1) the same holds.

:class:`TEAlibiDotProductAttention` (GPU, when transformer-engine imports) runs TE's fused
attention with ``core_attention_bias_type="alibi"`` and this rank's slopes passed explicitly.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from megatron_rlhf.models.bloom.alibi import alibi_slopes_for_rank, positions_from_mask


def _tp_rank_and_size() -> tuple[int, int]:
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


class AlibiDotProductAttention(MegatronModule):
    """ALiBi attention over this rank's heads; tensors are (S, B, heads_per_rank, head_dim)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        tp_rank, tp_size = _tp_rank_and_size()
        self.heads_per_rank = divide(config.num_attention_heads, tp_size)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.register_buffer(
            "slopes",
            alibi_slopes_for_rank(config.num_attention_heads, tp_rank, tp_size),
            persistent=False,
        )
        self.dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,  # (Sq, B, H/tp, D)
        key: torch.Tensor,  # (Sk, B, H/tp, D)
        value: torch.Tensor,  # (Sk, B, H/tp, D)
        attention_mask: torch.Tensor,  # (B, 1, Sq, Sk) bool, True = masked
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("ALiBi attention takes neither packed sequences nor a bias")
        if attention_mask is None:
            raise ValueError("BLOOM attention needs the causal+padding attention mask")
        q = query.permute(1, 2, 0, 3)  # (B, H, Sq, D)
        k = key.permute(1, 2, 3, 0)  # (B, H, D, Sk)
        v = value.permute(1, 2, 0, 3)  # (B, H, Sk, D)
        key_valid = ~attention_mask[:, 0, -1, :]  # (B, Sk)
        positions = positions_from_mask(key_valid)  # (B, Sk)
        alibi = self.slopes.to(q.device)[None, :, None, None] * positions[:, None, None, :]
        scores = torch.matmul(q, k) * self.softmax_scale + alibi.to(q.dtype)  # (B, H, Sq, Sk)
        scores = scores.masked_fill(attention_mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        probs = self.dropout(probs)
        context = torch.matmul(probs, v)  # (B, H, Sq, D)
        sq, batch = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, self.heads_per_rank * self.head_dim)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}


def _te_attention_class():
    """TransformerEngine's DotProductAttention, or None when TE is not importable."""
    try:
        from transformer_engine.pytorch import DotProductAttention
    except Exception:  # ImportError, or a CUDA/driver error inside TE's import
        return None
    return DotProductAttention


class TEAlibiDotProductAttention(MegatronModule):
    """GPU path: TE fused attention with ALiBi and this TP rank's slopes passed explicitly.

    TE's default slopes come from the *local* head count, which is wrong under TP, so the slice
    of the global slopes is passed on every call. TE's fused kernels reduce a padding mask to
    per-row valid-token counts (right-padding semantics), so left-padded batches (generation)
    take :class:`AlibiDotProductAttention`; training batches here are right-padded.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config=config)
        te_attention = _te_attention_class()
        if te_attention is None:
            raise ImportError("transformer-engine is not importable")
        tp_rank, tp_size = _tp_rank_and_size()
        self.heads_per_rank = divide(config.num_attention_heads, tp_size)
        self.register_buffer(
            "slopes",
            alibi_slopes_for_rank(config.num_attention_heads, tp_rank, tp_size),
            persistent=False,
        )
        self.fallback = AlibiDotProductAttention(
            config, layer_number, attn_mask_type, attention_type
        )
        self.te_attention = te_attention(
            num_attention_heads=self.heads_per_rank,
            kv_channels=config.kv_channels,
            attention_dropout=config.attention_dropout,
            qkv_format="sbhd",
            attn_mask_type="padding_causal",
            layer_number=layer_number,
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
        key_valid = ~attention_mask[:, 0, -1, :]  # (B, Sk)
        right_padded = bool((key_valid[:, :-1] >= key_valid[:, 1:]).all())
        if query.shape[0] != key.shape[0] or not right_padded:
            return self.fallback(query, key, value, attention_mask)
        te_mask = ~key_valid[:, None, None, :]  # TE: True = masked, (B, 1, 1, Sk)
        context = self.te_attention(
            query,
            key,
            value,
            attention_mask=te_mask,
            core_attention_bias_type="alibi",
            alibi_slopes=self.slopes.float(),
        )
        return context.reshape(query.shape[0], query.shape[1], -1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}
