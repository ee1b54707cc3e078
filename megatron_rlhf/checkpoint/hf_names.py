"""The literal name map between Hugging Face BLOOM and our Megatron-Core BLOOM.

Each Megatron parameter of layer i corresponds to one Hugging Face tensor; ``split_dim`` says
how tensor parallelism shards it (0: rows, as ColumnParallelLinear and the vocab-parallel
embedding; 1: columns, as RowParallelLinear; None: replicated). BLOOM's fused QKV is laid out
[heads, 3, head_dim] on dim 0, which is also Megatron's layout when num_query_groups ==
num_heads, so a TP rank's rows are a contiguous block of heads: no permutation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Megatron suffix inside a decoder layer -> (HF suffix inside ``h.{i}``, TP split dim)
LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "input_layernorm.bias": ("input_layernorm.bias", None),
    "self_attention.linear_qkv.weight": ("self_attention.query_key_value.weight", 0),
    "self_attention.linear_qkv.bias": ("self_attention.query_key_value.bias", 0),
    "self_attention.linear_proj.weight": ("self_attention.dense.weight", 1),
    "self_attention.linear_proj.bias": ("self_attention.dense.bias", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "pre_mlp_layernorm.bias": ("post_attention_layernorm.bias", None),
    "mlp.linear_fc1.weight": ("mlp.dense_h_to_4h.weight", 0),
    "mlp.linear_fc1.bias": ("mlp.dense_h_to_4h.bias", 0),
    "mlp.linear_fc2.weight": ("mlp.dense_4h_to_h.weight", 1),
    "mlp.linear_fc2.bias": ("mlp.dense_4h_to_h.bias", None),
}

# Megatron name outside the layers -> (HF name, TP split dim), per head type.
EMBEDDING_MAP = {
    "embedding.word_embeddings.weight": ("word_embeddings.weight", 0),
    "embedding.word_embeddings_layernorm.weight": ("word_embeddings_layernorm.weight", None),
    "embedding.word_embeddings_layernorm.bias": ("word_embeddings_layernorm.bias", None),
}
FINAL_NORM_MAP = {
    "lm": {
        "decoder.final_layernorm.weight": ("ln_f.weight", None),
        "decoder.final_layernorm.bias": ("ln_f.bias", None),
    },
    "scalar": {
        "final_layernorm.weight": ("ln_f.weight", None),
        "final_layernorm.bias": ("ln_f.bias", None),
        # Exported beside the trunk as BloomForSequenceClassification's ``score`` (+ a bias).
        "scalar_head.weight": ("score.weight", None),
        "scalar_head.bias": ("score.bias", None),
    },
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
HF_PREFIX = "transformer."


@dataclass(frozen=True)
class TensorMapping:
    megatron_name: str
    hf_name: str  # without the ``transformer.`` prefix for trunk tensors
    split_dim: int | None
    is_vocab: bool = False


def mapping_for(megatron_name: str, head: str, layer_offset: int) -> TensorMapping:
    """The HF tensor behind one Megatron parameter; ``layer_offset`` is this stage's first
    global layer. Raises KeyError for a name the map does not know."""
    match = _LAYER_RE.match(megatron_name)
    if match:
        local_index, suffix = int(match.group(1)), match.group(2)
        hf_suffix, split_dim = LAYER_MAP[suffix]
        return TensorMapping(
            megatron_name, f"h.{layer_offset + local_index}.{hf_suffix}", split_dim
        )
    table = {**EMBEDDING_MAP, **FINAL_NORM_MAP[head]}
    hf_name, split_dim = table[megatron_name]
    return TensorMapping(
        megatron_name, hf_name, split_dim, is_vocab=megatron_name.endswith("word_embeddings.weight")
    )


def hf_names(num_layers: int, head: str) -> list[str]:
    """Every HF tensor name (without ``transformer.``) a BLOOM of this head type has."""
    names = [hf for hf, _ in EMBEDDING_MAP.values()]
    for i in range(num_layers):
        names += [f"h.{i}.{hf}" for hf, _ in LAYER_MAP.values()]
    names += [hf for hf, _ in FINAL_NORM_MAP[head].values()]
    return names


def canonical_hf_name(name: str) -> str:
    """Strip the ``transformer.`` prefix that BloomForCausalLM checkpoints carry."""
    return name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else name


def full_hf_name(name: str) -> str:
    """The name as BloomForCausalLM / BloomForSequenceClassification save it."""
    return name if name.startswith("score.") else HF_PREFIX + name
