"""torchrun worker (4 processes, gloo): BLOOM at TP=1/2/4 x PP=1/2/4 against transformers.

    torchrun --nproc-per-node 4 tests/dist_bloom_worker.py --out OUT_DIR \\
        --hf-a HF_DIR_A --hf-b HF_DIR_B --work SCRATCH_DIR [--checks logits ...]

Check groups: ``logits`` (LM logits at every layout, with sequence parallelism at TP=2),
``checkpoints`` (LM and scalar heads saved at TP2xPP2, loaded at the other layouts),
``generation`` (greedy with/without KV cache, EOS, seeded sampling across layouts; at PP=2 and
PP=4 pipelined with one micro-batch per stage, unpipelined, and 3 uneven micro-batches) and
``gradients`` (backward at TP=2, with and without sequence parallelism, equals TP=1) and
``placement`` (bf16 LM and scalar models built on the ``meta`` device at every layout: every
parameter and buffer there, every parameter bf16, only the ALiBi slopes fp32).

Every rank builds the transformers reference itself (tiny models), switches Megatron-Core's
layout between checks, and records the checks it can judge (the last pipeline stage judges
logits); a check passes only if every rank that judged it agrees (``torchrun_harness``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from dist_bloom_common import (
    ARCH_A,
    ARCH_B,
    EOS_ID,
    PAD_ID,
    hf_greedy,
    hf_scalar_reference,
    left_padded_batch,
)
from megatron.core import parallel_state
from torchrun_harness import Harness

from megatron_rlhf.checkpoint import dist as dist_ckpt
from megatron_rlhf.checkpoint import load_bloom
from megatron_rlhf.distributed import initialize
from megatron_rlhf.distributed.pipeline import gather_vocab_shards, pipeline_forward
from megatron_rlhf.generation import SamplingConfig, generate
from megatron_rlhf.utils import InputError

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
TOLERANCE = 1e-4
harness = Harness(__doc__)
harness.parser.add_argument("--hf-a", required=True)
harness.parser.add_argument("--hf-b", required=True)
harness.parser.add_argument("--work", type=Path, required=True)


def use_layout(tp: int, pp: int, arch) -> None:
    initialize(tp, pp, arch=arch)


def hf_model(directory):
    from transformers import BloomForCausalLM

    return BloomForCausalLM.from_pretrained(directory).eval()


def compare_logits(name: str, model, ids, mask, ref, vocab_size: int) -> None:
    """Judge this layout's logits on the last stage: real vocab vs ``ref``, padding at -inf."""
    with torch.no_grad():
        shard = pipeline_forward(model, ids, mask)  # (B, S, V_pad / tp) on the last stage
    if not parallel_state.is_pipeline_last_stage():
        if shard is not None:
            harness.record(name, False, "a non-last stage returned logits")
        return
    tp = parallel_state.get_tensor_model_parallel_world_size()
    full = gather_vocab_shards(shard, model.pg_collection.tp)  # (B, S, V_pad)
    expected_shape = (*ids.shape, model.vocab_size // tp)
    real = mask.bool()
    diff = (full[..., :vocab_size] - ref)[real].abs().max().item()
    padding_ok = bool((full[..., vocab_size:] == torch.finfo(full.dtype).min).all())
    ok = tuple(shard.shape) == expected_shape and diff <= TOLERANCE and padding_ok
    harness.record(
        name,
        ok,
        f"shard {tuple(shard.shape)} max|diff| {diff:.2e} padded-vocab-masked {padding_ok}",
    )


@harness.check
def logits(args) -> None:
    # 4 layers over 4 stages; 12 heads over 4 TP ranks (3 each, 256 vocab rows, the last 232
    # of them real for vocab 1000).
    extra = {"a": [(1, 4)], "b": [(4, 1)]}
    for arch_name, arch, directory in (("a", ARCH_A, args.hf_a), ("b", ARCH_B, args.hf_b)):
        ids, mask = left_padded_batch(arch.vocab_size, [10, 6, 1, 8], seed=11)
        with torch.no_grad():
            ref = hf_model(directory)(input_ids=ids, attention_mask=mask).logits
        for tp, pp in LAYOUTS + extra[arch_name]:
            use_layout(tp, pp, arch)
            model = load_bloom(directory, init_weights=False).eval()
            compare_logits(
                f"logits_{arch_name}_tp{tp}pp{pp}", model, ids, mask, ref, arch.vocab_size
            )
            if tp == 2 and arch_name == "a":
                model = load_bloom(directory, init_weights=False, sequence_parallel=True).eval()
                name = f"logits_{arch_name}_tp{tp}pp{pp}_sequence_parallel"
                compare_logits(name, model, ids, mask, ref, arch.vocab_size)


def perturb_scalar_head(model) -> None:
    """Give the (replicated) scalar head random weights and bias, the same on every rank."""
    if not model.is_last_stage:
        return
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for param in model.scalar_head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))


def compare_scalar(name: str, model, ids, mask, hf) -> None:
    with torch.no_grad():
        values = pipeline_forward(model, ids, mask)  # (B, S, n) on the last stage
    if not parallel_state.is_pipeline_last_stage():
        return
    head = model.scalar_head
    ref = hf_scalar_reference(hf, ids, mask, head.weight, head.bias)
    diff = (values.double() - ref)[mask.bool()].abs().max().item()
    ok = tuple(values.shape) == (*ids.shape, 2) and diff <= TOLERANCE
    harness.record(name, ok, f"values {tuple(values.shape)} max|diff| {diff:.2e}")


@harness.check
def checkpoints(args) -> None:
    """Save at TP2xPP2 (LM and scalar heads), load at every other layout."""
    hf_a, work = args.hf_a, args.work
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [7, 3, 9], seed=12)
    hf = hf_model(hf_a)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
    lm_dir, scalar_dir = work / "ckpt_lm_tp2pp2", work / "ckpt_scalar_tp2pp2"
    use_layout(2, 2, ARCH_A)
    model = load_bloom(hf_a, init_weights=False)
    dist_ckpt.save(lm_dir, model.sharded_state_dict(), dist_ckpt.model_metadata(model))
    try:  # every rank must refuse (a refusal on rank 0 alone would hang the others)
        dist_ckpt.save(lm_dir, model.sharded_state_dict(), dist_ckpt.model_metadata(model))
        harness.record("ckpt_save_refuses_existing_dir", False, "saved over an existing checkpoint")
    except InputError as err:
        harness.record("ckpt_save_refuses_existing_dir", "already exists" in str(err), str(err))
    scalar = load_bloom(hf_a, head="scalar", num_scalar_outputs=2).eval()
    perturb_scalar_head(scalar)
    compare_scalar("scalar_head_tp2pp2", scalar, ids, mask, hf)
    dist_ckpt.save(scalar_dir, scalar.sharded_state_dict(), dist_ckpt.model_metadata(scalar))
    for tp, pp in [(1, 1), (2, 1), (1, 2)]:
        use_layout(tp, pp, ARCH_A)
        from_ckpt = load_bloom(lm_dir, init_weights=False).eval()
        from_hf = load_bloom(hf_a, init_weights=False)
        names = [n for n, _ in from_hf.named_parameters()]
        same = [
            torch.equal(a, b)
            for (_, a), (_, b) in zip(from_ckpt.named_parameters(), from_hf.named_parameters())
        ]
        ok = len(same) == len(names) and all(same)
        bad = [n for n, s in zip(names, same) if not s]
        harness.record(f"ckpt_tp2pp2_loads_at_tp{tp}pp{pp}_bit_exact", ok, f"differing: {bad[:4]}")
        compare_logits(
            f"ckpt_tp2pp2_logits_at_tp{tp}pp{pp}", from_ckpt, ids, mask, ref, ARCH_A.vocab_size
        )
        from_ckpt = load_bloom(scalar_dir, head="scalar", num_scalar_outputs=2).eval()
        compare_scalar(f"scalar_ckpt_tp2pp2_at_tp{tp}pp{pp}", from_ckpt, ids, mask, hf)
    try:
        load_bloom(lm_dir, head="scalar")
        harness.record(
            "ckpt_wrong_head_refused", False, "an LM checkpoint loaded into a scalar head"
        )
    except InputError as err:
        harness.record("ckpt_wrong_head_refused", "'lm' head" in str(err), str(err))


def greedy_config(use_kv_cache: bool, eos_id: int = EOS_ID, parts: int = 0) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=10,
        greedy=True,
        eos_id=eos_id,
        pad_id=PAD_ID,
        use_kv_cache=use_kv_cache,
        pipeline_micro_batches=parts,
    )


def response_mask_until_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 on every token up to and including the first EOS of each row (B, N)."""
    eos_before = (tokens == eos_id).long().cumsum(dim=1) - (tokens == eos_id).long()
    return (eos_before == 0).long()


def compare_generation(name: str, out, ref_tokens, ref_logprobs, eos_id: int) -> None:
    ref_mask = response_mask_until_eos(ref_tokens, eos_id)
    same_tokens = out.response_ids.shape == ref_tokens.shape and torch.equal(
        out.response_ids, ref_tokens
    )
    same_mask = same_tokens and torch.equal(out.response_mask, ref_mask)
    diff, padding_zero = float("inf"), False
    if same_mask:
        diff = (out.response_logprobs - ref_logprobs)[ref_mask.bool()].abs().max().item()
        padding_zero = bool((out.response_logprobs[~ref_mask.bool()] == 0).all())
    ok = same_mask and diff <= TOLERANCE and padding_zero
    detail = f"tokens equal {same_tokens} mask equal {same_mask} logprob max|diff| {diff:.2e}"
    if not same_tokens:
        detail += f" ours {out.response_ids.tolist()} ref {ref_tokens.tolist()}"
    harness.record(name, ok, detail)


@harness.check
def generation(args) -> None:
    hf_a = args.hf_a
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [7, 3, 9, 5], seed=13)
    hf = hf_model(hf_a)
    ref_tokens, ref_logprobs = hf_greedy(hf, ids, mask, max_new_tokens=10)
    # Stop row 1 early: the first of its greedy tokens (from the 3rd on) not seen before in the
    # row becomes EOS; the other rows stop there too if they produce it.
    row = ref_tokens[1].tolist()
    firsts = [t for i, t in enumerate(row) if i >= 2 and t not in row[:i] and t != EOS_ID]
    stop_token = firsts[0] if firsts else EOS_ID
    harness.record("generation_eos_token_usable", bool(firsts), f"stop token {stop_token} in {row}")
    stop_tokens, stop_logprobs = hf_greedy(hf, ids, mask, max_new_tokens=10, eos_id=stop_token)
    sampled = {}
    for tp, pp in LAYOUTS + [(1, 4)]:
        use_layout(tp, pp, ARCH_A)
        model = load_bloom(hf_a, init_weights=False)
        # At PP > 1 the default pipelines one micro-batch per stage; 1 is the plain
        # stage-after-stage schedule, 3 cuts the 4 rows unevenly (2, 1, 1).
        for parts in (0, 1, 3) if pp > 1 else (0,):
            tag = f"_micro_batches{parts}" if parts else ""
            for cache in (True, False) if pp < 4 else (True,):
                out = generate(model, ids, mask, greedy_config(cache, parts=parts))
                name = f"greedy_tp{tp}pp{pp}{tag}_{'kv_cache' if cache else 'no_cache'}"
                compare_generation(name, out, ref_tokens, ref_logprobs, EOS_ID)
            out = generate(model, ids, mask, greedy_config(True, stop_token, parts))
            name = f"greedy_eos_stop_tp{tp}pp{pp}{tag}"
            compare_generation(name, out, stop_tokens, stop_logprobs, stop_token)
            if pp == 1 and not parts:  # refilled decode slots: 4 prompts through 2 slots
                refill = replace(greedy_config(True, stop_token), decode_batch=2)
                out = generate(model, ids, mask, refill)
                name = f"greedy_eos_stop_tp{tp}pp1_decode_batch2"
                compare_generation(name, out, stop_tokens, stop_logprobs, stop_token)
            for seed in (7, 8):
                sampling = SamplingConfig(
                    max_new_tokens=10,
                    temperature=0.8,
                    top_p=0.9,
                    seed=seed,
                    pipeline_micro_batches=parts,
                )
                sampled[(tp, pp, parts, seed)] = generate(model, ids, mask, sampling).response_ids
                if pp == 1 and seed == 7:
                    refill = replace(sampling, decode_batch=3, eos_id=stop_token)
                    sampled[(tp, pp, "refill", seed)] = generate(model, ids, mask, refill)
                    at_once = generate(model, ids, mask, replace(refill, decode_batch=None))
                    sampled[(tp, pp, "at_once", seed)] = at_once
    if dist.get_rank() == 0:  # data-parallel rank 0 in every layout
        for tp in (1, 2):  # refill at TP: the tokens (and log-probs) of the all-at-once loop
            out, ref = sampled.pop((tp, 1, "refill", 7)), sampled.pop((tp, 1, "at_once", 7))
            same = torch.equal(out.response_ids, ref.response_ids)
            same = same and torch.equal(out.response_mask, ref.response_mask)
            diff = (out.response_logprobs - ref.response_logprobs).abs().max().item() if same else 1
            name = f"sampling_decode_batch3_tp{tp}pp1_vs_all_at_once"
            harness.record(name, same and diff <= TOLERANCE, f"{out.response_ids.tolist()} {diff}")
        base = sampled[(1, 1, 0, 7)]
        for (tp, pp, parts, seed), tokens in sampled.items():
            if seed == 7 and (tp, pp) != (1, 1):
                tag = f"_micro_batches{parts}" if parts else ""
                name = f"sampling_seed_reproducible_tp{tp}pp{pp}{tag}_vs_tp1"
                harness.record(name, torch.equal(tokens, base), str(tokens.tolist()))
        differs = not torch.equal(sampled[(1, 1, 0, 8)], base)
        harness.record("sampling_other_seed_differs", differs, str(sampled[(1, 1, 0, 8)].tolist()))


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at PP=1 as TP=1 would hold it: the sequence-parallel
    all-reduce that Megatron's finalize_model_grads does, then TP shards gathered."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if getattr(param, "sequence_parallel", False) and model.config.sequence_parallel:
            dist.all_reduce(grad, group=group)
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            shards = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(shards, grad.contiguous(), group=group)
            grad = torch.cat(shards, dim=param.partition_dim)
        grads[name] = grad
    return grads


def backward_grads(directory, head: str, ids, mask, sequence_parallel: bool):
    """Gradients of a fixed linear function of the outputs (all vocab / scalar outputs)."""
    model = load_bloom(
        directory, head=head, num_scalar_outputs=2, sequence_parallel=sequence_parallel
    )
    if head == "scalar":
        perturb_scalar_head(model)
    output = model(ids, mask)  # (B, S, V_pad / tp) or (B, S, 2)
    if head == "lm":
        width = output.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * width
        weights = torch.randn(
            *ids.shape, model.vocab_size, generator=torch.Generator().manual_seed(5)
        )
        weights = weights[..., start : start + width]
        output = output.masked_fill(output == torch.finfo(output.dtype).min, 0.0)
    else:
        weights = torch.randn(*ids.shape, 2, generator=torch.Generator().manual_seed(5))
    ((output * weights) * mask[..., None]).sum().backward()
    return full_grads(model)


@harness.check
def gradients(args) -> None:
    """Backward at TP=2 (with and without sequence parallelism) equals TP=1, both heads."""
    hf_a = args.hf_a
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [8, 5, 2, 8], seed=14)
    for head in ("lm", "scalar"):
        use_layout(1, 1, ARCH_A)
        ref = backward_grads(hf_a, head, ids, mask, sequence_parallel=False)
        use_layout(2, 1, ARCH_A)
        for sequence_parallel in (False, True):
            grads = backward_grads(hf_a, head, ids, mask, sequence_parallel)
            worst, where = 0.0, ""
            for name, grad in ref.items():
                diff = (grads[name] - grad).abs().max().item() / max(1.0, grad.abs().max().item())
                worst, where = max((worst, where), (diff, name))
            name = f"{head}_grads_tp2pp1{'_sequence_parallel' if sequence_parallel else ''}_vs_tp1"
            ok = sorted(grads) == sorted(ref) and worst <= TOLERANCE
            harness.record(name, ok, f"worst relative diff {worst:.2e} at {where}")


@harness.check
def placement(args) -> None:
    from megatron_rlhf.models.bloom import BloomModel

    for tp, pp in LAYOUTS:
        use_layout(tp, pp, ARCH_B)
        for head in ("lm", "scalar"):
            model = BloomModel(
                ARCH_B, head=head, num_scalar_outputs=2, params_dtype=torch.bfloat16,
                device="meta",
            )  # fmt: skip
            buffers = list(model.named_buffers(remove_duplicate=False))
            tensors = list(model.named_parameters()) + buffers
            off = [n for n, t in tensors if t.device.type != "meta"]
            fp32 = {n for n, t in tensors if t.dtype != torch.bfloat16}
            slopes = {n: t for n, t in buffers if n.endswith("core_attention.slopes")}
            shared = len({id(t) for t in slopes.values()}) == 1  # one tensor per model and rank
            ok = not off and fp32 == set(slopes) and len(slopes) == ARCH_B.num_layers // pp
            ok = ok and shared
            harness.record(f"meta_bf16_{head}_tp{tp}pp{pp}", ok, f"off meta {off}, not bf16 {fp32}")


if __name__ == "__main__":  # the guard matters: dist_checkpointing spawns a helper process
    harness.main()
