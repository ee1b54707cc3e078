"""BLOOM shapes and their exact parameter counts (``l(12h^2 + 13h) + vh + 4h``, output tied).

Per model: word embedding ``v*h``; its LayerNorm ``2h``; per layer two LayerNorms ``4h``, fused
QKV ``3h^2 + 3h``, attention dense ``h^2 + h``, MLP ``4h^2 + 4h`` and ``4h^2 + h``; final
LayerNorm ``2h``. Per (TP, PP) rank, as ``BloomModel`` builds them: the column/row-parallel
weights and the column-parallel biases are split over TP, the LayerNorms and the row-parallel
biases are replicated, the (padded) vocabulary is split over TP, the first stage holds the
embedding, and with PP > 1 the last stage of an LM head holds its own copy of the tied
embedding (Megatron-Core keeps the two copies equal by an all-reduce of their gradients).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_rlhf.utils import InputError


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The fields of a BLOOM config that decide parameters, memory and FLOPs."""

    name: str
    """Preset name or config.json path (for tables)."""
    num_layers: int
    """Decoder layers l."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads a."""
    vocab_size: int = 250_880
    """Real vocabulary v (250,880 for every released BLOOM)."""


BLOOM_PRESETS = {
    "bloom-560m": (24, 1024, 16),
    "bloom-1b1": (24, 1536, 16),
    "bloom-1b7": (24, 2048, 16),
    "bloom-3b": (30, 2560, 32),
    "bloom-7b1": (30, 4096, 32),
    "bloom-176b": (70, 14336, 112),
}
"""name -> (layers, hidden, heads) of BigScience's released configs; ``bloomz-*`` share them."""


def model_shape(name_or_path: str) -> ModelShape:
    """A preset (``bloom-7b1``, ``bloomz-176b``, ``7b1``) or an HF ``config.json`` (or its dir)."""
    key = name_or_path.lower().replace("bloomz", "bloom")
    key = key if key.startswith("bloom-") else f"bloom-{key}"
    if key in BLOOM_PRESETS:
        layers, hidden, heads = BLOOM_PRESETS[key]
        return ModelShape(name=name_or_path, num_layers=layers, hidden_size=hidden, num_heads=heads)
    path = Path(name_or_path)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise InputError(
            f"{name_or_path}: neither a BLOOM preset ({', '.join(BLOOM_PRESETS)}) nor a "
            "config.json file or directory"
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a JSON config ({err})") from None

    def get(*keys):  # BigScience's own files use the legacy n_embed / num_attention_heads
        for key in keys:
            if isinstance(config.get(key), int):
                return config[key]
        raise InputError(f"{path}: no integer {' or '.join(keys)}; is it a BLOOM config.json?")

    return ModelShape(
        name=str(path),
        num_layers=get("n_layer", "num_hidden_layers"),
        hidden_size=get("hidden_size", "n_embed"),
        num_heads=get("n_head", "num_attention_heads"),
        vocab_size=get("vocab_size"),
    )


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary ``BloomModel`` builds: a multiple of ``lcm(1024, 128 * tp)``."""
    step = math.lcm(1024, 128 * tp)
    return -(-vocab_size // step) * step


def layer_params(h: int) -> int:
    """One decoder layer: 2 LayerNorms, QKV, dense, MLP (weights and biases)."""
    return 12 * h * h + 13 * h


def model_params(shape: ModelShape, head: str = "lm", num_scalar_outputs: int = 1) -> int:
    """Exact parameters of the model (the HF count; ``head="scalar"`` adds its Linear(h, k))."""
    h = shape.hidden_size
    trunk = shape.vocab_size * h + 2 * h + shape.num_layers * layer_params(h) + 2 * h
    return trunk + (num_scalar_outputs * (h + 1) if head == "scalar" else 0)


def layer_params_per_rank(h: int, tp: int) -> int:
    """One layer on one TP rank: split weights and QKV/fc1 biases; replicated norms, row biases."""
    split = 12 * h * h + 3 * h + 4 * h  # QKV, dense, fc1, fc2 weights; QKV and fc1 biases
    replicated = 4 * h + h + h  # two LayerNorms; dense and fc2 biases
    return split // tp + replicated


def rank_params(
    shape: ModelShape, tp: int, pp: int, stage: int, head: str = "lm", num_scalar_outputs: int = 1
) -> int:
    """Parameters held by one rank of pipeline ``stage`` (0-based) at TP=tp, PP=pp."""
    h = shape.hidden_size
    embedding = padded_vocab(shape.vocab_size, tp) // tp * h
    count = shape.num_layers // pp * layer_params_per_rank(h, tp)
    if stage == 0:
        count += embedding + 2 * h  # word embedding and its LayerNorm
    if stage == pp - 1:
        count += 2 * h  # final LayerNorm
        if head == "scalar":
            count += num_scalar_outputs * (h + 1)
        elif pp > 1:
            count += embedding  # the last stage's copy of the tied embedding
    return count


def max_rank_params(shape: ModelShape, tp: int, pp: int, head: str = "lm") -> int:
    """The most parameters any rank holds (the stage that decides the memory)."""
    return max(rank_params(shape, tp, pp, stage, head) for stage in range(pp))


def shape_of(arch) -> ModelShape:
    """The planner's shape of a ``BloomArchitecture`` (or anything with the same fields)."""
    return ModelShape(
        name=getattr(arch, "name", "model"),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_heads=arch.num_heads,
        vocab_size=arch.vocab_size,
    )
