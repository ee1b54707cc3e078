"""Batched autoregressive generation with Megatron-Core's static KV cache, at any TP/PP.

Prompts are left-padded so every row's next token sits in the last column; ALiBi positions come
from the padding mask, so padding changes nothing. Each step the last pipeline stage turns the
TP-gathered logits of the last position into the next token (greedy, or temperature + top-p
sampling, identical on every TP rank). Rows stop at EOS and leave the decode batch: the rows
still decoding are moved to the front of their KV-cache slots (``MicroBatch.compact``, one copy
of the live rows' cache after a step in which some row ended), so a decode step computes only
them and a rollout costs about the sum of its rows' lengths, not batch x longest. The loop stops
when every row has ended.
``response_logprobs`` are the log-probabilities of the chosen tokens under the model at
temperature 1.

Sampling draws one uniform number per (step, row) up front, from a generator seeded with
``seed + data-parallel rank`` (or one generator per row, ``row_seeds``), and inverts the row's (top-p filtered) CDF at it: a row's token
depends only on its own logits and its own number, never on how the batch is cut, so the
pipelined path (``pipelined.py``: micro-batches in flight on every stage at PP > 1) gives the
very tokens of the plain one. One Megatron-Core ``StaticInferenceContext`` holds the KV cache
of the whole batch; a micro-batch addresses its rows through the context's
``batch_size_offset``, as Megatron-Core's own micro-batched inference does.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_rlhf.distributed.parallel import compute_device, model_groups
from megatron_rlhf.generation.decode import (
    GenerationOutput,
    MicroBatch,
    SamplingConfig,
    choose_for,
    collect,
    sampling_uniforms,
    stage_forward,
)
from megatron_rlhf.generation.pipelined import generate_pipelined


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
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    try:
        groups = model_groups(model)
        if groups.pp.size() > 1:
            return generate_pipelined(model, prompt_ids, prompt_mask, sampling, context)
        micro_batch = MicroBatch(slice(0, batch), prompt_ids, prompt_mask, sampling, device)
        uniforms = sampling_uniforms(sampling, batch, device, groups.dp.rank())
        while not micro_batch.done:
            logits = stage_forward(model, micro_batch, context)
            micro_batch.append(*choose_for(micro_batch, logits, uniforms))
            if not micro_batch.done:
                micro_batch.compact(context)
        return collect([micro_batch])
    finally:
        model.train(was_training)
