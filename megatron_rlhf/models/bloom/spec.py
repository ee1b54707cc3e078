"""BLOOM's transformer layer as a Megatron-Core ``ModuleSpec``.

Pre-LN block, every Linear with a bias, fused QKV with BLOOM's [heads, 3, head_dim] layout (the
same layout as Megatron's ``linear_qkv`` when ``num_query_groups == num_heads``), 4h MLP with
tanh GELU, and ALiBi core attention. Layer, attention and linears are Megatron-Core's with a
lean forward for inference (``lean.py``). The core attention is chosen by the attention backend
(``ATTENTION_BACKENDS``, resolved by :func:`resolve_attention_backend`); every layer gets the
model's one slopes tensor through the spec.
"""

from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_rlhf.kernels._dispatch import HAVE_TRITON, INTERPRET, triton_launches
from megatron_rlhf.models.bloom.attention import (
    AlibiDotProductAttention,
    FusedAlibiDotProductAttention,
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

ATTENTION_BACKENDS = ("auto", "triton", "te", "torch")
# From this head dim on ``auto`` gives an fp32 model PyTorch attention: compiled for sm_90, the
# fp32 kernels keep their values in registers at 16 and spill at 64 and 128.
FP32_TRITON_SPILLS_FROM_HEAD_DIM = 64
CORE_ATTENTION = {
    "torch": AlibiDotProductAttention,  # PyTorch, O(S^2) fp32 scores
    "triton": FusedAlibiDotProductAttention,  # fused Triton kernel, O(S)
    "te": TEAlibiDotProductAttention,  # TransformerEngine (unfused with ALiBi), O(S^2)
}


def bloom_layer_spec(backend: str = "torch", slopes: torch.Tensor | None = None) -> ModuleSpec:
    """One BLOOM decoder layer with the core attention of ``backend`` (a resolved one: triton,
    te or torch); ``slopes``: the model's ALiBi slopes of this TP rank, shared by every layer
    (None: each core attention computes its own)."""
    core_attention = ModuleSpec(module=CORE_ATTENTION[backend], params={"slopes": slopes})
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


def resolve_attention_backend(
    backend: str | None,
    device,
    use_te_attention: bool | None = None,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> str:
    """The core attention a model on ``device`` uses: triton, te or torch.

    ``auto`` (or None): on a GPU the fused Triton kernel when Triton compiles and launches there,
    else TransformerEngine when it imports, else PyTorch; on the CPU PyTorch (``triton`` is
    allowed there: the kernel runs under ``TRITON_INTERPRET=1``, and the PyTorch path otherwise).
    An fp32 model (``dtype``) with ``head_dim`` >= 64 takes PyTorch on a GPU too: the kernel's
    IEEE-fp32 dots spill 10-20 KB of local memory a thread there (sm_90, Triton 3.6), and its
    D=128 backward took 67 s to compile (``FP32_TRITON_SPILLS_FROM_HEAD_DIM``; ``triton`` still
    forces it).
    ``use_te_attention`` is the older switch: True means ``te``, False ``torch``.
    """
    if use_te_attention is not None:
        legacy = "te" if use_te_attention else "torch"
        if backend not in (None, "auto", legacy):
            raise ValueError(
                f"attention_backend={backend!r} contradicts use_te_attention={use_te_attention}; "
                "give attention_backend only"
            )
        backend = legacy
    backend = backend or "auto"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        spills = head_dim is not None and head_dim >= FP32_TRITON_SPILLS_FROM_HEAD_DIM
        if dtype == torch.float32 and spills:
            return "torch"
        if HAVE_TRITON and (INTERPRET or triton_launches()):
            return "triton"
        return "te" if te_attention_class() is not None else "torch"
    if backend == "te" and te_attention_class() is None:
        raise ImportError(
            "attention_backend='te' but transformer-engine is not importable; use 'triton', "
            "'torch' or 'auto'"
        )
    if backend == "triton" and not HAVE_TRITON:
        raise ImportError("attention_backend='triton' but triton is not installed; use 'torch'")
    return backend


def bloom_block_spec(
    num_layers_on_stage: int, backend: str = "torch", slopes: torch.Tensor | None = None
):
    """The layers of this pipeline stage plus BLOOM's final LayerNorm (``ln_f``)."""
    layer = bloom_layer_spec(backend, slopes)
    return TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers_on_stage, layer_norm=BloomLayerNorm
    )
