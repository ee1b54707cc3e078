"""Fixtures shared by the BLOOM tests and their torchrun worker (no pytest, no torch.distributed).

The tiny configs are chosen to hit BLOOM's awkward cases: head counts that are not powers of
two (6 = 4 + 2 and 12 = 8 + 4 ALiBi slopes; at TP=2 the second rank of the 12-head model holds
both kinds), and vocabularies that need padding (250 and 1000 -> 1024 rows). Weights use a
larger init std than BLOOM's 0.02 so attention is far from uniform and a wrong Q/K/V layout
cannot hide behind it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rlhf.models.bloom.config import BloomArchitecture
from megatron_rlhf.models.bloom.tiny import random_hf_bloom

ARCH_A = BloomArchitecture(vocab_size=250, hidden_size=48, num_layers=4, num_heads=6)
ARCH_B = BloomArchitecture(vocab_size=1000, hidden_size=96, num_layers=2, num_heads=12)
INIT_STD = 0.2
PAD_ID, EOS_ID = 3, 2


def save_hf_bloom(
    directory: str | Path, arch: BloomArchitecture, seed: int = 0, dtype=torch.float32
):
    """Save a random ``BloomForCausalLM`` (safetensors, no ``lm_head``); return the model."""
    model = random_hf_bloom(arch, seed=seed, init_std=INIT_STD).to(dtype)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def left_padded_batch(
    vocab_size: int, lengths: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded with PAD_ID: ids and 0/1 mask (B, S)."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(4, vocab_size, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def hf_greedy(hf_model, ids, mask, max_new_tokens: int, eos_id: int = EOS_ID):
    """transformers' greedy generate: new tokens (B, N) and their log-probs (B, N)."""
    out = hf_model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=PAD_ID,
        eos_token_id=eos_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, ids.shape[1] :]  # (B, N)
    logprobs = torch.stack([step.float().log_softmax(-1) for step in out.logits], dim=1)
    return tokens, logprobs.gather(-1, tokens[..., None]).squeeze(-1)


def hf_scalar_reference(hf_model, ids, mask, weight, bias) -> torch.Tensor:
    """What a scalar head computes on transformers' trunk: ln_f(hidden) @ W^T + b, (B, S, n)."""
    with torch.no_grad():
        hidden = hf_model.transformer(input_ids=ids, attention_mask=mask).last_hidden_state
    return hidden.double() @ weight.double().T + bias.double()
