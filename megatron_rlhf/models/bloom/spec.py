"""BLOOM's transformer layer as a Megatron-Core ``ModuleSpec``.

Pre-LN block, every Linear with a bias, fused QKV with BLOOM's [heads, 3, head_dim] layout (the
same layout as Megatron's ``linear_qkv`` when ``num_query_groups == num_heads``), 4h MLP with
tanh GELU, and ALiBi core attention. Layer, attention and linears are Megatron-Core's with a
lean forward for inference (``lean.py``). Swapping the attention implementation is one line here.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_rlhf.models.bloom.attention import (
    AlibiDotProductAttention,
    TEAlibiDotProductAttention,
    te_attention_class,
)
from megatron_rlhf.models.bloom.layers import BloomLayerNorm
from megatron_rlhf.models.bloom.lean import (
    BloomColumnParallelLinear,
    BloomRowParallelLinear,
    BloomSelfAttention,
    BloomTransformerLayer,
)


def bloom_layer_spec(use_te_attention: bool = False) -> ModuleSpec:
    """One BLOOM decoder layer. ``use_te_attention`` selects TransformerEngine's fused ALiBi."""
    core_attention = TEAlibiDotProductAttention if use_te_attention else AlibiDotProductAttention
    return ModuleSpec(
        module=BloomTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=BloomLayerNorm,
            self_attention=ModuleSpec(
                module=BloomSelfAttention,
                params={"attn_mask_type": AttnMaskType.arbitrary},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=BloomColumnParallelLinear,
                    core_attention=core_attention,
                    linear_proj=BloomRowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=BloomLayerNorm,
            mlp=ModuleSpec(
                module=MLP,
                submodules=MLPSubmodules(
                    linear_fc1=BloomColumnParallelLinear, linear_fc2=BloomRowParallelLinear
                ),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def resolve_te_attention(use_te_attention: bool | None, device) -> bool:
    """``use_te_attention=None``: TransformerEngine's attention when the model is on a GPU and
    TE imports; True without TE is an error."""
    if use_te_attention is None:
        return device.type == "cuda" and te_attention_class() is not None
    if use_te_attention and te_attention_class() is None:
        raise ImportError("use_te_attention=True but transformer-engine is not importable")
    return bool(use_te_attention)


def bloom_block_spec(num_layers_on_stage: int, use_te_attention: bool = False):
    """The layers of this pipeline stage plus BLOOM's final LayerNorm (``ln_f``)."""
    layer = bloom_layer_spec(use_te_attention)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers_on_stage, layer_norm=BloomLayerNorm
    )
