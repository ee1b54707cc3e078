"""Batched autoregressive generation with Megatron-Core's static KV cache, at any TP/PP.

Prompts are left-padded so every row's next token sits in the last column; ALiBi positions come
from the padding mask, so padding changes nothing. Each step the last pipeline stage turns the
TP-gathered logits of the last position into the next token (greedy, or temperature + top-p
sampling, identical on every TP rank). Rows stop at EOS and leave the decode batch: the rows
still decoding are moved to the front of their KV-cache slots (``MicroBatch.compact``, one copy
of the live rows' cache after a step in which some row ended), so a decode step computes only
them and a rollout costs about the sum of its rows' lengths, not batch x longest. The loop stops
when every row has ended. Nor is the prompts' left padding computed (``unpadded_prefill``):
rows are sorted by prompt length and prefilled in groups, each as wide as its longest prompt
(``decode.prefill_groups``), writing the same KV-cache columns the padded prefill would; the
outputs come back in the caller's row order.
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
    prefill_by_length,
    sampling_uniforms,
    sort_prompts,
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
    max_length = prompt_length + sampling.max_new_tokens  # sort_prompts may only trim
    context = StaticInferenceContext(batch, max_length) if sampling.use_kv_cache else None
    device = compute_device()
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    try:
        groups = model_groups(model)
        uniforms = sampling_uniforms(sampling, batch, device, groups.dp.rank())
        order = None
        if sampling.unpadded_prefill:
            prompt_ids, prompt_mask, order = sort_prompts(prompt_ids, prompt_mask)
            uniforms = None if uniforms is None else uniforms[:, order]
        if groups.pp.size() > 1:
            out = generate_pipelined(model, prompt_ids, prompt_mask, sampling, context, uniforms)
        else:
            micro_batch = MicroBatch(slice(0, batch), prompt_ids, prompt_mask, sampling, device)
            while not micro_batch.done:
                if micro_batch.step == 0 and order is not None and context is not None:
                    logits = prefill_by_length(model, micro_batch, context)
                else:
                    logits = stage_forward(model, micro_batch, context)
                micro_batch.append(*choose_for(micro_batch, logits, uniforms))
                if not micro_batch.done:
                    micro_batch.compact(context)
            out = collect([micro_batch])
        if order is not None:  # back to the caller's row order
            inverse = torch.argsort(order)
            out = GenerationOutput(
                response_ids=out.response_ids[inverse],
                response_mask=out.response_mask[inverse],
                response_logprobs=out.response_logprobs[inverse],
            )
        return out
    finally:
        model.train(was_training)
