"""BLOOM architecture config and the Megatron-Core ``TransformerConfig`` it maps to."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rlhf.models.bloom.layers import gelu_tanh
from megatron_rlhf.utils import InputError


@dataclass(kw_only=True)
class BloomArchitecture:
    """The shape of a BLOOM model (the fields of a Hugging Face ``BloomConfig`` that matter)."""

    vocab_size: int
    """Real vocabulary size (250,880 for every released BLOOM); padded for TP at build time."""
    hidden_size: int
    """Model width h (1024 for 560m, 4096 for 7b1, 14336 for 176B)."""
    num_layers: int
    """Decoder layers (24, 30, 70)."""
    num_heads: int
    """Attention heads (16, 32, 112); need not be a power of two."""
    layer_norm_epsilon: float = 1e-5
    """LayerNorm epsilon of every norm."""
    max_sequence_length: int = 2048
    """Longest sequence the KV cache is sized for (BLOOM trained at 2048)."""

    @classmethod
    def from_hf(cls, hf_config) -> BloomArchitecture:
        """From a ``transformers.BloomConfig`` or its ``config.json`` dict. BigScience's own
        config files use the legacy keys ``n_embed`` and ``num_attention_heads``, which
        ``BloomConfig`` also accepts."""

        def get(*keys, default=None):
            for key in keys:
                if _hf_get(hf_config, key, None) is not None:
                    return _hf_get(hf_config, key, None)
            if default is None:
                raise InputError(f"config.json has none of {list(keys)}; is it a BLOOM config?")
            return default

        return cls(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size", "n_embed"),
            num_layers=get("n_layer", "num_hidden_layers"),
            num_heads=get("n_head", "num_attention_heads"),
            layer_norm_epsilon=get("layer_norm_epsilon", default=1e-5),
            max_sequence_length=get("seq_length", default=2048),
        )

    def to_hf_dict(self) -> dict:
        """The ``config.json`` of the equivalent ``BloomForCausalLM``."""
        return {
            "architectures": ["BloomForCausalLM"],
            "model_type": "bloom",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "n_layer": self.num_layers,
            "n_head": self.num_heads,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "seq_length": self.max_sequence_length,
            "apply_residual_connection_post_layernorm": False,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "unk_token_id": 0,
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _hf_get(hf_config, key, default):
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """The vocab rounded up to a multiple of ``lcm(1024, 128 * tp)``.

    Megatron pads to a multiple of 128*tp; padding to a multiple of 1024 as well makes the
    padded size the same for every tp in {1, 2, 4, 8}, so a checkpoint saved at one TP size
    loads at another. BLOOM's 250,880 = 1024 * 245 needs no padding at all.
    """
    step = math.lcm(1024, 128 * tp)
    return ((vocab_size + step - 1) // step) * step


def transformer_config(
    arch: BloomArchitecture,
    *,
    tp: int,
    pp: int,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
    recompute_activations: bool = False,
    device: torch.device | None = None,
) -> TransformerConfig:
    """Megatron-Core settings that reproduce transformers' BLOOM numerics.

    Dropouts are 0 (BLOOM's released configs), GELU is the tanh form, the softmax runs in fp32.
    Parameters are initialised on the GPU when ``device`` is one (default: when there is one),
    otherwise through Megatron's CPU initialisation on the default device (so TP=2 builds
    exactly the slices of the TP=1 weights for a seed; ``BloomModel`` sets the default device).
    """
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_heads,
        kv_channels=arch.hidden_size // arch.num_heads,
        ffn_hidden_size=4 * arch.hidden_size,
        layernorm_epsilon=arch.layer_norm_epsilon,
        normalization="LayerNorm",
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=False,
        activation_func=gelu_tanh,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=True,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not cuda,
        recompute_granularity="full" if recompute_activations else None,
        recompute_method="uniform" if recompute_activations else None,
        recompute_num_layers=1 if recompute_activations else None,
        cuda_graph_scope=[],  # the non-deprecated "whole layer" (its default "full" warns; no graphs)
    )
