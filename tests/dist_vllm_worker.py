"""The vLLM rollout engine against our decode and transformers, in one engine start.

A random BLOOM (vocabulary 512, hidden 64, 2 heads: vLLM's CPU attention needs heads of >= 32)
is built with transformers and loaded into a Megatron-Core BloomModel; a ``VLLMRolloutEngine``
gets its weights in memory (``checkpoint/hf_stream.py``). Prompts are ragged (left-padded), and
EOS is a token the model emits, so rows end at different steps.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torchrun_harness import Harness
from transformers import BloomForCausalLM

harness = Harness(__doc__)
harness.parser.add_argument("--work", type=Path, required=True)
harness.parser.add_argument("--tp", type=int, default=1, help="of ours and of vLLM")
STATE: dict = {}
MAX_NEW = 12
LOGPROB_TOL = 1e-4  # fp32, random weights: vLLM's CPU kernels and ours differ by ~1e-6
SHARP_LOGPROB_TOL = 1e-2  # after large updates: 1.3e-3 observed (ours: 8e-7 from float64)


def _prompts(batch: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (batch,), generator=generator)
    width = int(lengths.max())
    ids = torch.full((batch, width), 3)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, n in enumerate(lengths.tolist()):
        ids[row, width - n :] = torch.randint(4, vocab, (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


def _setup(args):
    if STATE:
        return STATE
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.distributed import initialize
    from megatron_rlhf.generation import SamplingConfig, generate
    from megatron_rlhf.generation.rollout_engines import VLLMRolloutEngine
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    initialize(args.tp)
    arch = tiny_architecture(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2)
    if dist.get_rank() == 0:
        save_random_hf_bloom(args.work / "hf", arch, seed=3)
    dist.barrier()
    hf = BloomForCausalLM.from_pretrained(args.work / "hf").eval()
    model = load_bloom(args.work / "hf")
    # each data-parallel replica (vLLM's too) serves its own prompts
    ids, mask = _prompts(8, arch.vocab_size, seed=model.pg_collection.dp.rank())
    # EOS: the token row 0 emits third, so that some rows stop early and others do not
    probe = generate(
        model, ids, mask, SamplingConfig(max_new_tokens=MAX_NEW, greedy=True, eos_id=-1)
    )
    eos = int(probe.response_ids[0, 2])
    greedy = SamplingConfig(max_new_tokens=MAX_NEW, greedy=True, eos_id=eos, pad_id=3)
    engine = VLLMRolloutEngine(model, model.pg_collection, max_model_len=32, max_rows=8, seed=0)
    sync_s = engine.refresh()
    STATE.update(
        arch=arch, hf=hf, model=model, ids=ids, mask=mask, greedy=greedy, engine=engine,
        generate=generate, sync_s=sync_s,
    )  # fmt: skip
    return STATE


def _recomputed_logprobs(model, ids, mask, out, temperature: float = 1.0, top_p: float = 1.0):
    """log pi of the response tokens from a full forward of prompt + response, at
    ``temperature`` and, at ``top_p`` < 1, cut to the nucleus and renormalised (the score
    stage's pi_old for the importance weight: ``ppo/scoring.py``)."""
    from megatron_rlhf.distributed.parallel import model_groups, vocab_group
    from megatron_rlhf.ppo.scoring import nucleus_log_mass, response_logprobs

    sequences = torch.cat([ids, out.response_ids], dim=1)
    full_mask = torch.cat([mask, out.response_mask], dim=1)
    with torch.no_grad():
        logits = model(sequences, full_mask)
    p, n = ids.shape[1], out.response_ids.shape[1]
    tp_group = vocab_group(model_groups(model))  # the logits are vocab-parallel at TP > 1
    logprobs = response_logprobs(logits, sequences, p, n, temperature, tp_group=tp_group)
    if top_p >= 1.0:
        return logprobs
    predicting = logits[:, p - 1 : p - 1 + n]  # (B, N, V/tp)
    log_mass = nucleus_log_mass(predicting.flatten(0, 1), temperature, top_p, tp_group)
    return logprobs - log_mass.view(logprobs.shape)


@harness.check
def greedy_equals_megatron_and_transformers(args) -> str:
    s = _setup(args)
    ours = s["generate"](s["model"], s["ids"], s["mask"], s["greedy"])
    vllm = s["engine"].generate(s["ids"], s["mask"], s["greedy"])
    assert torch.equal(vllm.response_ids, ours.response_ids), (vllm.response_ids, ours.response_ids)
    assert torch.equal(vllm.response_mask, ours.response_mask)
    lengths = vllm.response_mask.sum(1)
    assert lengths.min() < MAX_NEW <= lengths.max(), f"rows should end at different steps {lengths}"
    gap = (vllm.response_logprobs - ours.response_logprobs).abs().max().item()
    assert gap < LOGPROB_TOL, gap
    eos = s["greedy"].eos_id
    for row in range(s["ids"].shape[0]):
        prompt = s["ids"][row][s["mask"][row].bool()][None]
        with torch.no_grad():
            hf = s["hf"].generate(
                prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=3
            )[0, prompt.shape[1] :]
        n = int(lengths[row])
        assert hf[:n].tolist() == vllm.response_ids[row, :n].tolist(), (
            row,
            hf,
            vllm.response_ids[row],
        )
        assert (hf[n:] == 3).all(), row
    return f"8 ragged rows, lengths {lengths.tolist()}, log-prob gap {gap:.1e}; sync {s['sync_s']:.3f} s"


@harness.check
def sampled_logprobs_equal_a_recomputing_forward(args) -> str:
    """mu is what was sampled (issue 48): at T = 0.7 and top-p 0.9 vLLM's log-probs (its
    processed mode) are of the distribution it drew from, which the score stage recomputes
    for pi_old (temperature, nucleus renormalised), so pi_old/mu is 1 to vLLM's rounding; not
    the untruncated softmax at T, nor the raw temperature-1 one."""
    s = _setup(args)
    temperature, top_p = 0.7, 0.9
    sampling = replace(
        s["greedy"], greedy=False, temperature=temperature, top_p=top_p,
        row_seeds=tuple(range(8)),
    )  # fmt: skip
    out = s["engine"].generate(s["ids"], s["mask"], sampling)
    real = out.response_mask.bool()
    recomputed = _recomputed_logprobs(s["model"], s["ids"], s["mask"], out, temperature, top_p)
    gap = (out.response_logprobs - recomputed)[real].abs().max().item()
    assert gap < LOGPROB_TOL, gap
    assert (out.response_logprobs[~real] == 0).all()
    untruncated = _recomputed_logprobs(s["model"], s["ids"], s["mask"], out, temperature)
    raw = _recomputed_logprobs(s["model"], s["ids"], s["mask"], out)
    for other in (untruncated, raw):  # what was recorded before differs by far more
        assert (out.response_logprobs - other)[real].abs().max() > 100 * LOGPROB_TOL
    return f"T=0.7, top-p 0.9: the nucleus's log-probs within {gap:.1e} of a full forward's"


@harness.check
def rows_do_not_depend_on_the_batch(args) -> str:
    s = _setup(args)
    sampling = replace(s["greedy"], greedy=False, temperature=1.0, row_seeds=tuple(range(100, 108)))
    batch = s["engine"].generate(s["ids"], s["mask"], sampling)
    for row in (0, 5):
        alone = s["engine"].generate(
            s["ids"][row : row + 1], s["mask"][row : row + 1],
            replace(sampling, row_seeds=(sampling.row_seeds[row],)),
        )  # fmt: skip
        n = int(batch.response_mask[row].sum())
        assert alone.response_ids[0, :n].tolist() == batch.response_ids[row, :n].tolist(), row
    other = s["engine"].generate(s["ids"], s["mask"], replace(sampling, row_seeds=tuple(range(8))))
    assert not torch.equal(other.response_ids, batch.response_ids), "the seeds change nothing"
    return "rows 0 and 5 alone = in the batch; other row seeds give other samples"


@harness.check
def weights_synced_in_memory_after_updates(args) -> str:
    """New actor weights (every tensor moved, TP shards each their own way, replicated tensors
    the same on every TP rank) change its greedy tokens; the engine follows only after
    ``refresh()``, and no weight file is written. (train-ppo's test checks the same after
    real PPO updates: the rollout's log-probs against the updated actor's, every step.)"""
    s = _setup(args)
    model, engine = s["model"], s["engine"]
    _perturb(model, 0.2, seed=0)
    ours = s["generate"](model, s["ids"], s["mask"], s["greedy"])
    stale = engine.generate(s["ids"], s["mask"], s["greedy"])
    assert not torch.equal(stale.response_ids, ours.response_ids), "the updates changed nothing"
    sync_s = engine.refresh()
    fresh = engine.generate(s["ids"], s["mask"], s["greedy"])
    assert torch.equal(fresh.response_ids, ours.response_ids), (
        fresh.response_ids,
        ours.response_ids,
    )
    gap = (fresh.response_logprobs - ours.response_logprobs).abs().max().item()
    # vLLM's CPU attention rounds more coarsely than ours once attention is sharp: an engine
    # loaded from files with these weights has the same gap, bit for bit (checked by hand)
    assert gap < SHARP_LOGPROB_TOL, gap
    files = sorted(p.name for p in Path(engine.generator._config_dir.name).iterdir())
    assert files == ["config.json"], files
    return f"stale engine differs, synced engine equal (gap {gap:.1e}); sync {sync_s:.3f} s; files {files}"


def _perturb(model, scale: float, seed: int) -> None:
    """Move every actor tensor (TP shards each their own way, replicated tensors the same on
    every TP rank)."""
    tp_rank = model.pg_collection.tp.rank()
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            sharded = getattr(param, "tensor_model_parallel", False)
            generator = torch.Generator().manual_seed(
                seed + 1000 * index + (tp_rank if sharded else 0)
            )
            param += scale * torch.randn(param.shape, generator=generator)


@harness.check
def shard_sync_logprobs_equal_the_actors_recomputed(args) -> str:
    """After an actor update, the shard-to-shard sync (not the full-stream fallback) gives
    vLLM sampled log-probs equal to a recomputing forward of the updated actor; the stale
    engine's are not."""
    s = _setup(args)
    model, engine = s["model"], s["engine"]
    assert not engine.full_stream and engine._plan is not None, "the sync fell back"
    _perturb(model, 0.05, seed=70_000)
    sampling = replace(s["greedy"], greedy=False, temperature=1.0, row_seeds=tuple(range(200, 208)))

    def gap(out):
        recomputed = _recomputed_logprobs(model, s["ids"], s["mask"], out)
        return ((out.response_logprobs - recomputed) * out.response_mask).abs().max().item()

    stale = gap(engine.generate(s["ids"], s["mask"], sampling))
    sync_s = engine.refresh()
    fresh = gap(engine.generate(s["ids"], s["mask"], sampling))
    assert fresh < SHARP_LOGPROB_TOL < stale, (fresh, stale)
    return f"log-prob gap {fresh:.1e} after the sync ({sync_s:.3f} s), {stale:.1e} before it"


@harness.check
def shard_sync_moves_one_tp_share_of_the_bytes(args) -> str:
    """Each rank's sync writes exactly its vLLM TP shard of every HF tensor (real vocabulary
    rows only; norms and row-parallel biases whole): at TP 2 half the model, give or take
    those replicated tensors. Before/after: the full stream's seconds and bytes beside."""
    from megatron_rlhf.checkpoint.hf_stream import hf_tensor_stream
    from megatron_rlhf.generation.vllm_layout import vllm_vocab_rows

    s = _setup(args)
    model, engine, arch = s["model"], s["engine"], s["arch"]
    tp, rank = model.pg_collection.tp.size(), model.pg_collection.tp.rank()
    expected, full = 0, 0
    for name, tensor in s["hf"].state_dict().items():  # the HF model: every tensor, full
        if name == "lm_head.weight":
            continue  # tied to the word embedding
        full += tensor.numel() * 4
        if name.endswith("word_embeddings.weight"):
            start, end, _ = vllm_vocab_rows(arch.vocab_size, tp, rank)
            expected += (end - start) * tensor.shape[1] * 4
        elif any(
            key in name
            for key in ("query_key_value", "dense_h_to_4h", "dense.weight", "4h_to_h.weight")
        ):
            expected += tensor.numel() * 4 // tp
        else:
            expected += tensor.numel() * 4
    got = engine.sync_bytes_per_rank
    assert got == expected, (got, expected)
    assert full / tp <= got < 1.02 * full / tp, (got, full)  # replicated: ~1 % here
    with torch.no_grad():
        full_s = engine.generator.load_weights(hf_tensor_stream(model))
    shard_s = engine.refresh()
    return (
        f"TP {tp}: {got} B a rank = {got / full:.4f} of the model ({full} B); "
        f"{engine.sync_remote_bytes_per_rank} B of them from other ranks; sync {shard_s:.3f} s, "
        f"full stream {full_s:.3f} s ({full} B a rank)"
    )


@harness.check
def shard_sync_falls_back_when_vllm_shards_otherwise(args) -> str:
    """The live-model check that decides the fallback: the engine's plan fits vLLM's model; a
    plan for another vLLM TP does not, and says why. When a rank's check fails, every rank
    takes the full stream (warned), which still syncs: greedy tokens = the actor's."""
    import warnings
    from dataclasses import replace as replace_plan

    s = _setup(args)
    engine = s["engine"]
    generator, plan = engine.generator, engine._plan
    assert generator.check_shards(plan) is None
    other = replace_plan(plan, rollout_tp=2 * plan.rollout_tp)
    reason = generator.check_shards(other)
    assert reason is not None and "plan's shard" in reason, reason
    _perturb(s["model"], 0.05, seed=90_000)
    engine._plan = None
    generator.check_shards = lambda plan: "a mismatch made up by the test"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.refresh()
    finally:
        del generator.check_shards
    assert engine.full_stream and engine._plan is None
    assert any("every sync streams every full tensor" in str(w.message) for w in caught)
    ours = s["generate"](s["model"], s["ids"], s["mask"], s["greedy"])
    fresh = engine.generate(s["ids"], s["mask"], s["greedy"])
    assert torch.equal(fresh.response_ids, ours.response_ids)
    assert engine.sync_bytes_per_rank == engine.sync_remote_bytes_per_rank  # all of it, each
    engine.full_stream = False  # back to shard to shard for the checks after this one
    engine.refresh()
    assert engine._plan is not None and engine.sync_bytes_per_rank == plan.received_bytes
    return f"the engine's plan fits; one for TP {other.rollout_tp}: {reason}; fallback synced"


@harness.check
def shard_plan_moves_slices_between_layouts(args) -> str:
    """The plan's point-to-point transport: from the actor (TP of the launch) to a rollout of
    TP 1 on every rank (at 2 ranks, half of each tensor comes from the other rank), in
    4-KiB buckets, into plain tensors: equal to the full tensors laid out as vLLM does."""
    from megatron_rlhf.checkpoint.hf_names import full_hf_name, hf_names
    from megatron_rlhf.checkpoint.hf_stream import hf_tensor_stream
    from megatron_rlhf.generation import shard_sync as ss
    from megatron_rlhf.generation.vllm_layout import vllm_plan

    s = _setup(args)
    model, arch = s["model"], s["arch"]
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    order = [full_hf_name(n) for n in hf_names(arch.num_layers, "lm")]
    plan, sources = vllm_plan(model, singles[dist.get_rank()], 4096, order)
    targets = {}
    for name, spec in plan.specs.items():
        targets[name] = torch.full(ss.rollout_shard_shape(spec, 1), float("nan"))
        ss.zero_padding(targets[name], spec, 0, 1)

    def write(piece, ranges, data):
        ss.write_piece(targets[piece.name], plan.specs[piece.name], ranges, data)

    with torch.no_grad():
        ss.run_plan(plan, sources, write)
        full = dict(hf_tensor_stream(model))
    assert set(full) == set(targets)
    heads = arch.num_heads
    for name, tensor in full.items():
        if "query_key_value" in name:  # vLLM's (3, heads, d) from HF's (heads, 3, d)
            shape = tensor.shape
            tensor = tensor.view(heads, 3, -1, *shape[1:]).transpose(0, 1).reshape(shape)
        assert torch.equal(targets[name], tensor), name
    if dist.get_world_size() > 1:
        assert plan.remote_bytes > 0
    return (
        f"{len(plan.buckets)} buckets, {plan.received_bytes} B a rank, "
        f"{plan.remote_bytes} B of them from other ranks"
    )


@harness.check
def close_releases_the_engine(args: argparse.Namespace) -> str:
    s = _setup(args)
    folder = Path(s["engine"].generator._config_dir.name)
    s["engine"].close()
    assert not folder.exists()
    return "engine shut down, its config folder removed"


if __name__ == "__main__":
    harness.main()
