"""Core attention with ALiBi for Megatron-Core's ``SelfAttention`` (the ``core_attention`` slot).

Megatron-Core 0.16.1 has no ALiBi: its local ``DotProductAttention`` asserts ``attention_bias is
None`` and ``TEDotProductAttention`` never passes ``"alibi"``. :class:`AlibiDotProductAttention`
is a pure-PyTorch core attention computing what transformers' ``BloomAttention`` computes:

    scores = slope_h * pos_k + (q . k) / sqrt(d)        (pos_k from the padding mask)
    probs  = softmax_fp32(scores masked with the causal + padding mask)
    out    = probs @ v

Key positions come from the padding mask, so left-padded rows see the same biases as their
unpadded selves. ``BloomModel`` builds this rank's ``slope_h * pos_k`` once per forward and
passes it as Megatron's ``attention_bias`` (B, H/tp, 1, Sk) to every layer; the mask is
Megatron's boolean convention (True = masked), shape (B, 1, Sq, Sk). With a KV cache
(Sq = 1, Sk = cached + 1) the same holds.

:class:`TEAlibiDotProductAttention` (GPU, when transformer-engine imports) runs TE's fused
attention with ``core_attention_bias_type="alibi"`` and this rank's slopes passed explicitly.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from megatron_rlhf.models.bloom.alibi import alibi_slopes_for_rank


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
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
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
        attention_bias=None,  # (B, H/tp, 1, Sk) this rank's ALiBi, from BloomModel
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("ALiBi attention does not take packed sequences")
        if attention_mask is None or attention_bias is None:
            raise ValueError(
                "BLOOM attention needs the causal+padding mask and the ALiBi bias (BloomModel "
                "passes both)"
            )
        sq, batch, heads, dim = query.shape
        sk = key.shape[0]
        q = query.permute(1, 2, 0, 3).reshape(batch * heads, sq, dim)
        k = key.permute(1, 2, 3, 0).reshape(batch * heads, dim, sk)
        v = value.permute(1, 2, 0, 3).reshape(batch * heads, sk, dim)
        alibi = attention_bias.to(q.dtype).reshape(batch * heads, 1, sk)
        # slope * pos_k + (q . k) * scale in one call, as transformers' BloomAttention.
        scores = torch.baddbmm(alibi, q, k, alpha=self.softmax_scale)  # (B*H, Sq, Sk)
        scores = scores.view(batch, heads, sq, sk).masked_fill(
            attention_mask, torch.finfo(scores.dtype).min
        )
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        probs = self.dropout(probs)
        context = torch.bmm(probs.view(batch * heads, sq, sk), v)  # (B*H, Sq, D)
        return context.view(batch, heads, sq, dim).permute(2, 0, 1, 3).reshape(sq, batch, -1)

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
            return self.fallback(
                query, key, value, attention_mask, attention_bias=kwargs.get("attention_bias")
            )
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
