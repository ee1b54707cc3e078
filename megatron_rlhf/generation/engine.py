"""Batched autoregressive generation with Megatron-Core's static KV cache, at any TP/PP.

Prompts are left-padded so every row's next token sits in the last column; ALiBi positions come
from the padding mask, so padding changes nothing. Each step the last pipeline stage turns the
TP-gathered logits of the last position into the next token (greedy, or temperature + top-p
sampling from a seeded generator, identical on every TP rank) and broadcasts it to the other
stages. Rows stop at EOS; the loop stops when every row has. ``response_logprobs`` are the
log-probabilities of the chosen tokens under the model at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_rlhf.distributed.parallel import compute_device
from megatron_rlhf.distributed.pipeline import broadcast_from_last_stage, pipeline_forward


@dataclass(kw_only=True)
class SamplingConfig:
    """How the next token is chosen."""

    max_new_tokens: int = 64
    """Most tokens generated per prompt (EOS included)."""
    greedy: bool = False
    """Take the argmax token (temperature and top_p are then ignored)."""
    temperature: float = 1.0
    """Divide logits by this before sampling."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0
    """Seed of the sampling generator (offset by the data-parallel rank)."""
    row_seeds: tuple[int, ...] | None = None
    """One seed per prompt row instead of ``seed``: each row samples from its own generator,
    so a row draws the same tokens whatever batch, rank or layout it is generated in."""
    eos_id: int = 2
    """End-of-sequence token (BLOOM: 2)."""
    pad_id: int = 3
    """Padding token written after EOS (BLOOM: 3)."""
    use_kv_cache: bool = True
    """Reuse the keys/values of earlier positions (False recomputes the prefix each step)."""


@dataclass
class GenerationOutput:
    response_ids: torch.Tensor  # (B, N) generated tokens, pad_id after EOS
    response_mask: torch.Tensor  # (B, N) 1 on generated tokens (EOS included), 0 after
    response_logprobs: torch.Tensor  # (B, N) log pi(token) at temperature 1, 0 on padding


def _choose(logits: torch.Tensor, sampling: SamplingConfig, generator) -> torch.Tensor:
    """Next token per row from full-vocab logits (B, V)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= sampling.top_p  # keep the first
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if isinstance(generator, list):  # one generator per row (SamplingConfig.row_seeds)
        rows = [torch.multinomial(p[None], 1, generator=g) for p, g in zip(probs, generator)]
        return torch.cat(rows).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _generators(sampling: SamplingConfig, batch: int, device):
    """The sampling generator of this rank, or one per row (``row_seeds``)."""
    if sampling.row_seeds is None:
        seed = sampling.seed + parallel_state.get_data_parallel_rank()
        return torch.Generator(device=device).manual_seed(seed)
    if len(sampling.row_seeds) != batch:
        raise ValueError(f"{len(sampling.row_seeds)} row_seeds for a batch of {batch} prompts")
    return [torch.Generator(device=device).manual_seed(seed) for seed in sampling.row_seeds]


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,  # (B, P) left-padded
    prompt_mask: torch.Tensor,  # (B, P) 1 on prompt tokens
    sampling: SamplingConfig,
) -> GenerationOutput:
    was_training = model.training
    model.eval()
    batch, prompt_length = prompt_ids.shape
    max_length = prompt_length + sampling.max_new_tokens
    context = StaticInferenceContext(batch, max_length) if sampling.use_kv_cache else None
    device = compute_device()
    generator = _generators(sampling, batch, device)
    tokens, mask = prompt_ids.to(device), prompt_mask.to(device).long()
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    new_tokens, new_logprobs, new_mask = [], [], []
    for step in range(sampling.max_new_tokens):
        step_input = tokens[:, -1:] if (context is not None and step > 0) else tokens
        logits = pipeline_forward(
            model, step_input, mask, inference_context=context, runtime_gather_output=True
        )
        if context is not None:
            context.sequence_len_offset += step_input.shape[1]
            context.enable_decode_mode()
        chosen, logprob = None, None
        if parallel_state.is_pipeline_last_stage():
            last = logits[:, -1, :].float()  # (B, V)
            chosen = _choose(last, sampling, generator)
            logprob = last.log_softmax(dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
        chosen = broadcast_from_last_stage(chosen, (batch,), torch.long)
        logprob = broadcast_from_last_stage(logprob, (batch,), torch.float32)
        alive = ~finished
        new_tokens.append(torch.where(alive, chosen, torch.full_like(chosen, sampling.pad_id)))
        new_logprobs.append(torch.where(alive, logprob, torch.zeros_like(logprob)))
        new_mask.append(alive.long())
        finished |= alive & (chosen == sampling.eos_id)
        tokens = torch.cat([tokens, new_tokens[-1][:, None]], dim=1)
        mask = torch.cat([mask, new_mask[-1][:, None]], dim=1)
        if bool(finished.all()):
            break
    model.train(was_training)
    return GenerationOutput(
        response_ids=torch.stack(new_tokens, dim=1),
        response_mask=torch.stack(new_mask, dim=1),
        response_logprobs=torch.stack(new_logprobs, dim=1),
    )
