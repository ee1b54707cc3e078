"""Tiny random BLOOMs built with transformers: the demo's model and the tests' reference."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf.models.bloom.config import BloomArchitecture


def tiny_architecture(vocab_size: int = 512, **overrides) -> BloomArchitecture:
    """A BLOOM small enough for a CPU: 6 heads (not a power of two), hidden 48, 2 layers."""
    fields = dict(vocab_size=vocab_size, hidden_size=48, num_layers=2, num_heads=6)
    fields.update(overrides)
    return BloomArchitecture(**fields)


def random_hf_bloom(arch: BloomArchitecture, seed: int = 0, init_std: float = 0.02):
    """A ``transformers.BloomForCausalLM`` with random weights (LayerNorms and biases too)."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(**{**arch.to_hf_dict(), "initializer_range": init_std})
    torch.manual_seed(seed)
    model = BloomForCausalLM(config).eval()
    # Non-trivial LayerNorms and (otherwise zero) biases catch name-map mistakes.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm" in name or "ln_f" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_random_hf_bloom(directory: str | Path, arch: BloomArchitecture, seed: int = 0):
    """Save a random BLOOM as a Hugging Face safetensors checkpoint; return the model."""
    model = random_hf_bloom(arch, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return model
