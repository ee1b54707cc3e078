"""BLOOM's small building blocks that Megatron-Core does not provide as BLOOM needs them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's GELU: the tanh approximation. Megatron's unfused ``F.gelu`` is the erf form."""
    return F.gelu(x, approximate="tanh")


class BloomLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with Megatron's norm constructor signature, in
    ``config.params_dtype`` (CUDA's layer_norm wants the weights in the input's dtype).

    Megatron's ``WrappedTorchNorm`` refuses sequence parallelism; a LayerNorm works per token,
    so under SP it only needs its parameters tagged ``sequence_parallel`` (their gradients are
    then all-reduced over the TP group by Megatron's DDP / finalize_model_grads).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
