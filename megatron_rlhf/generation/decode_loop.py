"""Batched autoregressive generation with Megatron-Core's static KV cache, at any TP/PP.

Prompts are left-padded so every row's next token sits in the last column; ALiBi positions come
from the padding mask, so padding changes nothing. Each step the last pipeline stage turns the
TP-gathered logits of the last position into the next token (greedy, or temperature + top-p
sampling, identical on every TP rank). Rows stop at EOS and leave the decode batch: the rows
still decoding are moved to the front of their KV-cache slots (``DecodeRows.compact``, one copy
of the live rows' cache after a step in which some row ended), so a decode step computes only
them and a rollout costs about the sum of its rows' lengths, not batch x longest. The loop stops
when every row has ended. Nor is the prompts' left padding computed (``unpadded_prefill``):
rows are sorted by prompt length and prefilled in groups, each as wide as its longest prompt
(``decode.prefill_groups``), writing the same KV-cache columns the padded prefill would; the
outputs come back in the caller's row order.
``response_logprobs`` are the log-probabilities of the chosen tokens under the distribution they
were drawn from (``decode.sampled_logprobs``: the logits at the sampling temperature, cut to the
top-p nucleus and renormalised): the behaviour policy mu that PPO's importance weights divide by.

Sampling draws one uniform number per (step, row) up front, from a generator seeded with
``seed + data-parallel rank`` (or one generator per row, ``row_seeds``), and inverts the row's (top-p filtered) CDF at it: a row's token
depends only on its own logits and its own number, never on how the batch is cut, so the
pipelined path (``pipelined.py``: micro-batches in flight on every stage at PP > 1) gives the
very tokens of the plain one. One Megatron-Core ``StaticInferenceContext`` holds the KV cache
of the whole batch; a micro-batch addresses its rows through the context's
``batch_size_offset``, as Megatron-Core's own micro-batched inference does.

With ``sampling.decode_batch`` (PP = 1) the KV cache holds that many slots and a row that ends
hands its slot to a waiting prompt (continuous batching): ``refill.py``.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext

from megatron_rlhf.distributed.parallel import compute_device, model_groups
from megatron_rlhf.generation.decode import (
    DecodeRows,
    GenerationOutput,
    SamplingConfig,
    choose_for,
    collect,
    prefill_by_length,
    sampling_uniforms,
    sort_prompts,
    stage_forward,
)
from megatron_rlhf.generation.pipelined import generate_pipelined
from megatron_rlhf.generation.refill import generate_refill
from megatron_rlhf.models.precision import compute_precision


@torch.no_grad()
def generate(
    model,
    prompt_ids: torch.Tensor,  # (B, P) left-padded
    prompt_mask: torch.Tensor,  # (B, P) 1 on prompt tokens
    sampling: SamplingConfig,
) -> GenerationOutput:
    # a bf16 run's fp32 actor on a CPU: every step's products in bf16, each weight cast once
    # for the whole generation (models/precision.py)
    with compute_precision(model):
        return _generate(model, prompt_ids, prompt_mask, sampling)


def _generate(model, prompt_ids, prompt_mask, sampling: SamplingConfig) -> GenerationOutput:
    was_training = model.training
    model.eval()
    batch, prompt_length = prompt_ids.shape
    device = compute_device()
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    try:
        groups = model_groups(model)
        refill = bool(sampling.decode_batch)
        if refill:
            check_decode_batch(sampling, groups.pp.size())
        uniforms = sampling_uniforms(sampling, batch, device, groups.dp.rank())
        order = None
        if sampling.unpadded_prefill or refill:
            prompt_ids, prompt_mask, order = sort_prompts(prompt_ids, prompt_mask)
            uniforms = None if uniforms is None else uniforms[:, order]
        max_length = prompt_length + sampling.max_new_tokens  # sort_prompts may only trim
        context = None
        if sampling.use_kv_cache and not refill:
            context = StaticInferenceContext(batch, max_length)
        if refill:
            out = generate_refill(model, prompt_ids, prompt_mask, sampling, uniforms)
        elif groups.pp.size() > 1:
            out = generate_pipelined(model, prompt_ids, prompt_mask, sampling, context, uniforms)
        else:
            micro_batch = DecodeRows(slice(0, batch), prompt_ids, prompt_mask, sampling, device)
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


def check_decode_batch(sampling: SamplingConfig, pipeline_stages: int) -> None:
    """``decode_batch`` (refill, ``refill.py``) needs a KV cache and one pipeline stage."""
    if sampling.decode_batch < 1:
        raise ValueError(f"decode_batch must be >= 1 (or None), got {sampling.decode_batch}")
    if not sampling.use_kv_cache:
        raise ValueError("decode_batch refills KV-cache slots: it needs use_kv_cache=True")
    if pipeline_stages > 1:
        raise ValueError(
            f"decode_batch refills slots at PP = 1 only (this model has {pipeline_stages} "
            "pipeline stages); leave decode_batch unset at PP > 1"
        )
