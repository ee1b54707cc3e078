"""BLOOM building blocks in one process: ALiBi, masks, layout validation, name map, parity.

References: transformers' ``build_alibi_tensor`` and ``BloomForCausalLM`` (same weights), and
brute-force loops for the masks. The multi-process layouts are in ``test_bloom_parallel.py``.
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from dist_bloom_common import (
    ARCH_A,
    ARCH_B,
    hf_scalar_reference,
    left_padded_batch,
    save_hf_bloom,
)

from megatron_rlhf.models.bloom import alibi_slopes, alibi_slopes_for_rank, padded_vocab_size
from megatron_rlhf.models.bloom.alibi import positions_from_mask
from megatron_rlhf.utils import InputError

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _hf_slopes(num_heads: int) -> torch.Tensor:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)
    return alibi[:, 0, 1]  # (H,) bias at position 1 = the slope


def test_alibi_slopes_match_transformers_for_every_head_count():
    for num_heads in [*range(1, 131), 112]:
        ours, ref = alibi_slopes(num_heads), _hf_slopes(num_heads)
        assert ours.dtype == torch.float32 and ours.shape == (num_heads,)
        assert torch.equal(ours, ref), f"num_heads={num_heads}"


def test_alibi_slopes_per_tp_rank_are_contiguous_blocks():
    for num_heads, tp in [(6, 2), (6, 3), (12, 2), (12, 4), (16, 8), (112, 4), (112, 8), (5, 1)]:
        ref = _hf_slopes(num_heads)
        per_rank = num_heads // tp
        for rank in range(tp):
            block = alibi_slopes_for_rank(num_heads, rank, tp)
            assert torch.equal(block, ref[rank * per_rank : (rank + 1) * per_rank]), (num_heads, tp)


def _random_masks(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Left-padded, right-padded, holed, full and all-padding rows."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(batch, seq, generator=generator) > 0.3).long()
    mask[0] = 0
    mask[1] = 1
    mask[2, :3] = 0
    mask[2, 3:] = 1
    mask[3, : seq - 2] = 1
    mask[3, seq - 2 :] = 0
    return mask


def test_positions_from_mask_counts_from_first_real_token():
    mask = _random_masks(8, 11, seed=0)
    expected = torch.zeros_like(mask)
    for row in range(mask.shape[0]):
        count = 0
        for col in range(mask.shape[1]):
            if mask[row, col]:
                expected[row, col] = count
                count += 1
    assert torch.equal(positions_from_mask(mask), expected)
    assert torch.equal(positions_from_mask(mask.bool()), expected)


@pytest.mark.parametrize("query_length", [11, 4, 1])
def test_attention_mask_for_matches_brute_force(query_length):
    from megatron_rlhf.models.bloom import attention_mask_for

    mask = _random_masks(6, 11, seed=1)
    batch, keys = mask.shape
    expected = torch.ones(batch, 1, query_length, keys, dtype=torch.bool)  # True = masked
    for b in range(batch):
        for q in range(query_length):
            query_position = keys - query_length + q
            for k in range(keys):
                if k <= query_position and mask[b, k]:
                    expected[b, 0, q, k] = False
    got = attention_mask_for(mask, query_length)
    assert got.dtype == torch.bool and torch.equal(got, expected)


def test_initialize_validates_before_building_anything():
    import torch.distributed as dist

    from megatron_rlhf.distributed import initialize

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    try:
        os.environ.pop("WORLD_SIZE", None)
        with pytest.raises(InputError, match="world size 1 is not divisible by tp"):
            initialize(tp=2, arch=SimpleNamespace(num_heads=6, num_layers=4))
        assert not dist.is_initialized()
    finally:
        _restore_env(saved)


def test_padded_vocab_size():
    assert padded_vocab_size(250_880, 1) == 250_880  # BLOOM needs no padding
    for vocab in [1, 250, 1000, 1024, 1025, 50_257, 250_680]:
        sizes = {padded_vocab_size(vocab, tp) for tp in (1, 2, 4, 8)}
        assert len(sizes) == 1, f"vocab {vocab}: padded size depends on tp: {sizes}"
        for tp in (1, 2, 4, 8, 16):
            padded = padded_vocab_size(vocab, tp)
            assert padded >= vocab and padded % (128 * tp) == 0 and padded - vocab < 128 * 16


def _restore_env(saved: dict) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def single_process():
    """Megatron-Core parallel state at world size 1; torch.distributed torn down afterwards."""
    import torch.distributed as dist

    from megatron_rlhf.distributed import destroy, initialize

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    saved = {key: os.environ.get(key) for key in _DIST_ENV}
    initialize()
    yield
    destroy()
    _restore_env(saved)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_bloom_a")
    save_hf_bloom(directory, ARCH_A, seed=0)
    return directory


def _hf_model(directory):
    from transformers import BloomForCausalLM

    return BloomForCausalLM.from_pretrained(directory).eval()


def test_hf_name_map_covers_exactly_the_hf_tensors(single_process):
    from transformers import BloomConfig, BloomForSequenceClassification

    from megatron_rlhf.checkpoint.hf_names import canonical_hf_name, hf_names, mapping_for
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.models.bloom.tiny import random_hf_bloom

    arch = ARCH_B
    hf_lm = {canonical_hf_name(n) for n in random_hf_bloom(arch).state_dict()} - {"lm_head.weight"}
    assert hf_lm == set(hf_names(arch.num_layers, "lm"))
    hf_cls = BloomForSequenceClassification(BloomConfig(**arch.to_hf_dict(), num_labels=2))
    hf_scalar = {canonical_hf_name(n) for n in hf_cls.state_dict()}
    # Our scalar head has a bias; BloomForSequenceClassification's `score` has none.
    assert hf_scalar | {"score.bias"} == set(hf_names(arch.num_layers, "scalar"))

    for head in ("lm", "scalar"):
        model = BloomModel(arch, head=head, num_scalar_outputs=2)
        names = [n for n, _ in model.named_parameters() if n != "output_layer.weight"]
        mapped = [mapping_for(n, head, layer_offset=0).hf_name for n in names]
        assert len(set(mapped)) == len(mapped), f"{head}: two parameters map to one HF tensor"
        assert set(mapped) == set(hf_names(arch.num_layers, head)), head
    with pytest.raises(KeyError):
        mapping_for("decoder.layers.0.self_attention.linear_q.weight", "lm", 0)


def _our_logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, mask)  # (B, S, V_padded) at TP=1


def test_logits_match_transformers_single_process(single_process, hf_dir):
    from megatron_rlhf.checkpoint import load_bloom

    ids, mask = left_padded_batch(ARCH_A.vocab_size, [9, 5, 1, 7], seed=3)
    with torch.no_grad():
        ref = _hf_model(hf_dir)(input_ids=ids, attention_mask=mask).logits  # (B, S, V)
    model = load_bloom(hf_dir).eval()
    logits = _our_logits(model, ids, mask)
    assert logits.shape == (4, 9, padded_vocab_size(ARCH_A.vocab_size, 1))
    real = mask.bool()
    assert ref[real].abs().max() > 1.0  # logits are not trivially small
    diff = (logits[..., : ARCH_A.vocab_size] - ref)[real].abs().max().item()
    assert diff <= 1e-4, diff
    assert (logits[..., ARCH_A.vocab_size :] == torch.finfo(logits.dtype).min).all()

    # A left-padded row gives the same logits as the same prompt alone, unpadded.
    for row in range(ids.shape[0]):
        alone = ids[row][real[row]][None]
        single = _our_logits(model, alone, torch.ones_like(alone))
        diff = (single[0] - logits[row][real[row]]).abs().max().item()
        assert diff <= 1e-5, (row, diff)


def test_packed_row_logits_equal_each_sequence_alone_and_transformers(single_process, hf_dir):
    """Several sequences in one row (the key mask holds each one's id): block-diagonal causal
    attention with ALiBi positions restarting per sequence gives every token the logits of its
    sequence alone, in fp32 against transformers too; padding after the pack is harmless, and
    a scalar head reads the same values."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models.bloom.model import attention_mask_for

    lengths = [5, 1, 7, 3]
    generator = torch.Generator().manual_seed(21)
    sequences = [torch.randint(4, ARCH_A.vocab_size, (n,), generator=generator) for n in lengths]
    width = sum(lengths) + 2  # two padding columns after the pack
    packed_ids = torch.full((2, width), 3, dtype=torch.long)
    packed_mask = torch.zeros((2, width), dtype=torch.long)
    start = 0
    for i, seq in enumerate(sequences):
        packed_ids[0, start : start + len(seq)] = seq
        packed_mask[0, start : start + len(seq)] = i + 1
        start += len(seq)
    packed_ids[1, 2 : 2 + lengths[2]] = sequences[2]  # row 1: one sequence, left-padded
    packed_mask[1, 2 : 2 + lengths[2]] = 1
    # the mask: block-diagonal causal (brute force), padding keys masked
    mask = attention_mask_for(packed_mask, width)[0, 0]  # (S, S) True = masked
    for q in range(width):
        for k in range(width):
            same = packed_mask[0, q] in (0, packed_mask[0, k])  # padding queries see all
            expected = not (k <= q and packed_mask[0, k] > 0 and same)
            assert bool(mask[q, k]) == expected, (q, k)

    model = load_bloom(hf_dir).eval()
    logits = _our_logits(model, packed_ids, packed_mask)  # (2, S, V)
    hf = _hf_model(hf_dir)
    start = 0
    for i, seq in enumerate(sequences):
        alone = _our_logits(model, seq[None], torch.ones(1, len(seq), dtype=torch.long))[0]
        part = logits[0, start : start + len(seq)]
        assert (part - alone).abs().max() <= 1e-5, (i, float((part - alone).abs().max()))
        with torch.no_grad():
            ref = hf(input_ids=seq[None]).logits[0]
        diff = (part[:, : ARCH_A.vocab_size] - ref).abs().max()
        assert diff <= 1e-4, (i, float(diff))
        start += len(seq)
    row1 = logits[1, 2 : 2 + lengths[2]]
    assert (row1 - logits[0, 6 : 6 + lengths[2]]).abs().max() <= 1e-5  # padded = packed

    scalar = load_bloom(hf_dir, head="scalar", num_scalar_outputs=2).eval()
    with torch.no_grad():
        packed_scores = scalar(packed_ids, packed_mask)
        alone = scalar(sequences[3][None], torch.ones(1, lengths[3], dtype=torch.long))
    assert (packed_scores[0, 13:16] - alone[0]).abs().max() <= 1e-5


def test_scalar_head_matches_transformers_trunk(single_process, hf_dir):
    from megatron_rlhf.checkpoint import load_bloom

    ids, mask = left_padded_batch(ARCH_A.vocab_size, [6, 8, 2], seed=4)
    model = load_bloom(hf_dir, head="scalar", num_scalar_outputs=2).eval()
    head = model.scalar_head
    assert head.weight.abs().sum() > 0  # a fresh initialisation, not zeros
    with torch.no_grad():
        head.bias.copy_(torch.randn(2, generator=torch.Generator().manual_seed(5)))
        values = model(ids, mask)  # (B, S, 2)
    assert values.shape == (3, 8, 2) and values.dtype == torch.float32
    ref = hf_scalar_reference(_hf_model(hf_dir), ids, mask, head.weight, head.bias)
    diff = (values.double() - ref)[mask.bool()].abs().max().item()
    assert diff <= 1e-4, diff


def test_unknown_head_is_refused(single_process):
    from megatron_rlhf.models.bloom import BloomModel

    with pytest.raises(ValueError, match="head must be one of"):
        BloomModel(ARCH_A, head="value")


def _top_p_support(logits: torch.Tensor, top_p: float) -> set[int]:
    """Plain reference: the smallest set of most likely tokens whose probability reaches top_p."""
    probs = logits.double().softmax(-1)
    kept, total = set(), 0.0
    for token in probs.argsort(descending=True).tolist():
        kept.add(token)
        total += probs[token].item()
        if total >= top_p:
            break
    return kept


def test_sampling_top_p_and_temperature_follow_the_reference():
    from megatron_rlhf.generation.decode import SamplingConfig, choose_tokens

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 37, generator=generator) * 2.0
    draws = 20_000
    batch = logits.expand(draws, -1)
    for top_p, temperature in [(1.0, 1.0), (0.9, 1.0), (0.5, 0.7), (1e-6, 1.0)]:
        sampling = SamplingConfig(top_p=top_p, temperature=temperature)
        tokens, _ = choose_tokens(batch, sampling, torch.rand(draws, generator=generator))
        support = _top_p_support(logits[0] / temperature, top_p)
        assert set(tokens.tolist()) <= support, (top_p, temperature)
        expected = torch.zeros(37, dtype=torch.float64)
        kept = torch.tensor(sorted(support))
        expected[kept] = (logits[0, kept].double() / temperature).softmax(-1)
        observed = torch.bincount(tokens, minlength=37).double() / draws
        sigma = (expected * (1 - expected) / draws).sqrt()
        assert ((observed - expected).abs() <= 5 * sigma + 1e-9).all(), (top_p, temperature)
    greedy, _ = choose_tokens(batch[:3], SamplingConfig(greedy=True), None)
    assert torch.equal(greedy, logits.argmax(-1).expand(3))


def test_architecture_from_hf_reads_bigscience_legacy_keys():
    from transformers import BloomConfig

    from megatron_rlhf.models.bloom import BloomArchitecture

    # bigscience/bloom-560m's config.json spells hidden size and heads the legacy way.
    legacy = {"model_type": "bloom", "vocab_size": 250880, "n_embed": 1024, "n_layer": 24}
    legacy.update(num_attention_heads=16, layer_norm_epsilon=1e-5)
    expected = BloomArchitecture(vocab_size=250880, hidden_size=1024, num_layers=24, num_heads=16)
    assert BloomArchitecture.from_hf(legacy) == expected
    assert BloomArchitecture.from_hf(BloomConfig(**legacy)) == expected
    assert BloomArchitecture.from_hf(ARCH_B.to_hf_dict()) == ARCH_B
    with pytest.raises(InputError, match=r"none of \['n_head', 'num_attention_heads'\]"):
        BloomArchitecture.from_hf({"vocab_size": 10, "hidden_size": 8, "n_layer": 1})


def test_loaded_models_mark_their_tensor_parallel_weights(single_process):
    """A model built to be loaded (no init) carries the same TP attributes on every parameter
    as an initialised one: Megatron-Core sets them only while initialising, and the optimizer's
    gradient norm (hence clipping) at TP > 1 counts unmarked sharded weights on TP rank 0 only."""
    from megatron_rlhf.models.bloom import BloomModel

    def attributes(model):
        return {
            name: tuple(getattr(p, key, None) for key in
                        ("tensor_model_parallel", "partition_dim", "partition_stride"))
            for name, p in model.named_parameters()
        }  # fmt: skip

    for head in ("lm", "scalar"):
        initialised = attributes(BloomModel(ARCH_A, head=head, init_weights=True))
        loaded = attributes(BloomModel(ARCH_A, head=head, init_weights=False))
        assert loaded == initialised
        assert loaded["embedding.word_embeddings.weight"] == (True, 0, 1)
        assert loaded["decoder.layers.0.mlp.linear_fc2.weight"] == (True, 1, 1)


@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_ended_rows_leave_the_decode_batch_and_nothing_else_changes(
    single_process, hf_dir, use_kv_cache
):
    """Rows that emit EOS leave the decode batch (their KV cache compacted away), so later steps
    compute fewer rows; every row's tokens, mask and log-probs equal that row generated alone
    (per-row seeds make a row's samples independent of its batch)."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.generation import SamplingConfig, generate

    model = load_bloom(hf_dir, init_weights=False).eval()
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [6, 2, 8, 4, 1, 5], seed=11)
    seeds = (101, 102, 103, 104, 105, 106)
    sampling = SamplingConfig(
        max_new_tokens=12, temperature=0.9, top_p=0.95, row_seeds=seeds, eos_id=-1,
        use_kv_cache=use_kv_cache,
    )  # fmt: skip
    endless = generate(model, ids, mask, sampling).response_ids.tolist()

    def end_steps(token):  # the step at which each row would end with EOS := token
        return {row.index(token) if token in row else None for row in endless}

    # EOS := the drawn token that ends the rows at the most different steps
    sampling.eos_id = max(
        sorted({t for row in endless for t in row}), key=lambda t: len(end_steps(t))
    )
    batch_sizes = []
    hook = model.register_forward_pre_hook(lambda _, args: batch_sizes.append(args[0].shape[0]))
    try:
        out = generate(model, ids, mask, sampling)
    finally:
        hook.remove()
    lengths = out.response_mask.sum(dim=1).tolist()
    assert len(set(lengths)) >= 3 and min(lengths) < 12, lengths
    assert batch_sizes[0] == 6 and batch_sizes[-1] < 6, batch_sizes  # ended rows left
    assert batch_sizes == sorted(batch_sizes, reverse=True)
    steps = len(batch_sizes)
    alive_rows = sum(int((out.response_mask[:, step] == 1).sum()) for step in range(steps))
    assert sum(batch_sizes) == alive_rows  # each step computed exactly the rows still going
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        alone = generate(
            model, ids[row][real][None], torch.ones(1, int(real.sum()), dtype=torch.long),
            SamplingConfig(**{**vars(sampling), "row_seeds": (seeds[row],)}),
        )  # fmt: skip
        n = alone.response_ids.shape[1]
        assert torch.equal(out.response_ids[row, :n], alone.response_ids[0]), row
        assert torch.equal(out.response_mask[row, :n], alone.response_mask[0]), row
        assert not out.response_mask[row, n:].any()
        diff = (out.response_logprobs[row, :n] - alone.response_logprobs[0]).abs().max()
        assert diff <= 1e-5, (row, float(diff))


def test_prefill_groups_minimise_tokens_plus_forwards_as_brute_force_does():
    """The dynamic program's grouping costs what the best of every contiguous grouping costs."""
    import itertools

    from megatron_rlhf.generation.decode import PREFILL_FORWARD_COST_TOKENS as C
    from megatron_rlhf.generation.decode import prefill_groups

    generator = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = 1 + trial % 9
        top = (8, 60, 300)[trial % 3]
        lengths = sorted(torch.randint(1, top, (n,), generator=generator).tolist(), reverse=True)
        groups = prefill_groups(lengths)
        assert [g.start for g, _ in groups] == [0] + [g.stop for g, _ in groups[:-1]]
        assert groups[-1][0].stop == n and all(w == lengths[g.start] for g, w in groups)
        cost = sum((g.stop - g.start) * w + C for g, w in groups)
        best = min(
            sum((b - a) * lengths[a] + C for a, b in zip((0, *cuts), (*cuts, n)))
            for k in range(n)
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert cost == best, (lengths, groups)


@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_prompts_prefilled_without_padding_give_the_padded_prefills_outputs(
    single_process, hf_dir, use_kv_cache, monkeypatch
):
    """``unpadded_prefill``: rows sorted by prompt length, prefilled in groups as wide as their
    longest prompt (a column of padding in every row dropped too), give every row the tokens,
    mask and log-probs of the left-padded prefill, in the caller's row order; and the prefill
    computes fewer prompt positions than the padded batch holds."""
    from megatron.core.transformer.attention import Attention

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.generation import SamplingConfig, decode, generate

    monkeypatch.setattr(decode, "PREFILL_FORWARD_COST_TOKENS", 2)  # several groups at this size
    allocate = Attention._allocate_memory  # a fresh KV cache holds NaNs, not lucky zeros
    monkeypatch.setattr(
        Attention, "_allocate_memory", lambda *a, **k: allocate(*a, **k).fill_(float("nan"))
    )
    model = load_bloom(hf_dir, init_weights=False).eval()
    lengths = [3, 9, 1, 9, 5, 2, 6, 4]
    ids, mask = left_padded_batch(ARCH_A.vocab_size, lengths, seed=21)
    ids = torch.cat([torch.full((8, 2), 3), ids], dim=1)  # 2 columns padding in every row
    mask = torch.cat([torch.zeros(8, 2, dtype=torch.long), mask], dim=1)
    sampling = SamplingConfig(
        max_new_tokens=9, temperature=0.9, top_p=0.95, row_seeds=tuple(range(40, 48)),
        use_kv_cache=use_kv_cache, unpadded_prefill=False,
    )  # fmt: skip
    padded = generate(model, ids, mask, sampling)
    widths = []
    hook = model.register_forward_pre_hook(lambda _, args: widths.append(tuple(args[0].shape)))
    try:
        sampling.unpadded_prefill = True
        out = generate(model, ids, mask, sampling)
    finally:
        hook.remove()
    assert torch.equal(out.response_ids, padded.response_ids)
    assert torch.equal(out.response_mask, padded.response_mask)
    diff = (out.response_logprobs - padded.response_logprobs).abs().max()
    assert diff <= 1e-5, float(diff)
    if use_kv_cache:
        prefill = [w for w in widths if w[1] > 1]
        assert len(prefill) >= 3, widths  # several groups, each as wide as its longest prompt
        assert sum(b for b, _ in prefill) == 8
        assert sum(b * w for b, w in prefill) < 8 * 9, prefill
    else:  # every step recomputes the prefix: the shared padding columns are gone
        assert widths[0] == (8, 9), widths


def _spread_eos(endless: list[list[int]]) -> int:
    """The generated token that, made EOS, ends the rows at the most different steps."""

    def end_steps(token):
        return {row.index(token) if token in row else None for row in endless}

    return max(sorted({t for row in endless for t in row}), key=lambda t: len(end_steps(t)))


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_refilled_slots_give_every_row_the_all_at_once_tokens(
    single_process, hf_dir, greedy, monkeypatch
):
    """``decode_batch``: 13 ragged prompts through 1, 3 and 5 decode slots (rows that end
    hand their slot to a waiting prompt; the cache rebases and compacts) give every row the
    tokens and mask of all 13 decoded at once, and its log-probs to 1e-5 (another batch rounds
    differently), in the caller's row order; with a KV cache that starts as NaN and per-row
    seeds, so a row fed another slot's keys, uniforms or step count would differ."""
    from megatron.core.transformer.attention import Attention

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.generation import SamplingConfig, generate, refill

    allocate = Attention._allocate_memory  # a fresh KV cache holds NaNs, not lucky zeros
    monkeypatch.setattr(
        Attention, "_allocate_memory", lambda *a, **k: allocate(*a, **k).fill_(float("nan"))
    )
    runs = []
    run = refill._Refill.run
    monkeypatch.setattr(refill._Refill, "run", lambda self: runs.append(self) or run(self))
    model = load_bloom(hf_dir, init_weights=False).eval()
    lengths = [6, 2, 8, 4, 1, 5, 9, 3, 7, 2, 6, 1, 4]
    ids, mask = left_padded_batch(ARCH_A.vocab_size, lengths, seed=11)
    sampling = SamplingConfig(
        max_new_tokens=10, greedy=greedy, temperature=0.9, top_p=0.95, eos_id=-1,
        row_seeds=tuple(range(200, 213)),
    )  # fmt: skip
    sampling.eos_id = _spread_eos(generate(model, ids, mask, sampling).response_ids.tolist())
    ref = generate(model, ids, mask, sampling)
    ended = ref.response_mask.sum(dim=1)
    assert len(set(ended.tolist())) >= 3 and int(ended.min()) < 10, ended
    for slots in (1, 3, 5):
        sampling.decode_batch = slots
        out = generate(model, ids, mask, sampling)
        assert torch.equal(out.response_ids, ref.response_ids), slots
        assert torch.equal(out.response_mask, ref.response_mask), slots
        diff = (out.response_logprobs - ref.response_logprobs).abs().max()
        assert diff <= 1e-5, (slots, float(diff))
        assert not out.response_logprobs[ref.response_mask == 0].any()
    assert runs[0].rebases >= 1  # one slot decodes ~60 tokens in a P + 20 column cache
    assert sum(r.moves for r in runs) >= 1  # the queue emptied with gaps below live rows


def test_refill_without_compaction_carries_ended_slots_and_changes_no_token(single_process, hf_dir):
    """Decode batches never exceed ``decode_batch``; a step computes the live rows plus the
    free slots below the highest live one, which compaction (on by default) mostly removes
    once the queue is empty, and ``drop_ended_rows=False`` keeps (static shapes); the tokens
    are the same either way."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.generation import SamplingConfig, generate

    model = load_bloom(hf_dir, init_weights=False).eval()
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [5, 3, 7, 2, 6, 4, 8, 1], seed=4)
    sampling = SamplingConfig(max_new_tokens=8, greedy=True, eos_id=-1)
    sampling.eos_id = _spread_eos(generate(model, ids, mask, sampling).response_ids.tolist())
    outs, decode_rows = {}, {}
    for drop in (True, False):
        sampling = replace(sampling, decode_batch=3, drop_ended_rows=drop)
        rows = []

        def count(_, args, rows=rows):  # rows of each decode forward (one new token a row)
            if args[0].shape[1] == 1:
                rows.append(args[0].shape[0])

        hook = model.register_forward_pre_hook(count)
        try:
            outs[drop] = generate(model, ids, mask, sampling)
        finally:
            hook.remove()
        decode_rows[drop] = rows
        assert max(rows) <= 3
    assert torch.equal(outs[True].response_ids, outs[False].response_ids)
    assert sum(decode_rows[True]) < sum(decode_rows[False]), decode_rows


def test_compaction_pays_unless_at_most_one_step_remains():
    """Moving at most as many rows as are carried, over at most the filled columns, pays from
    two remaining steps on whatever the model's size; at one step it pays only when the rows
    carried outweigh the copy."""
    from megatron_rlhf.generation.refill import compaction_pays

    sizes = dict(kv_bytes=2 * 24 * 1024 * 4, row_flops=2 * 560e6)  # BLOOM-560m, fp32
    for carried, moved, filled, occupied in [(1, 1, 900, 900), (5, 1, 300, 40), (9, 9, 64, 60)]:
        for horizon in (2, 3, 100):
            assert compaction_pays(carried, moved, horizon, filled, occupied, **sizes)
    assert not compaction_pays(1, 1, 1, 900, 900, kv_bytes=1000, row_flops=0.0)
    assert compaction_pays(4, 1, 1, 900, 900, kv_bytes=1000, row_flops=0.0)
    assert not compaction_pays(0, 0, 50, 900, 900, **sizes)


def test_decode_batch_is_refused_where_refill_cannot_run():
    from megatron_rlhf.generation import SamplingConfig
    from megatron_rlhf.generation.decode_loop import check_decode_batch

    with pytest.raises(ValueError, match="PP = 1 only"):
        check_decode_batch(SamplingConfig(decode_batch=4), pipeline_stages=2)
    with pytest.raises(ValueError, match="use_kv_cache"):
        check_decode_batch(SamplingConfig(decode_batch=4, use_kv_cache=False), 1)
    with pytest.raises(ValueError, match=">= 1"):
        check_decode_batch(SamplingConfig(decode_batch=-2), 1)


def test_one_packed_row_runs_thd_attention_with_the_masked_paths_values_and_gradients(
    single_process, hf_dir
):
    """A single packed row (batch 1, ids 1..k, trailing padding) takes Megatron-Core's THD
    layout (each sequence's attention alone, none for the padding); in training mode its
    logits and every parameter's gradient equal those of the same sequences as a padded batch
    (the masked path), rel 1e-5."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.data.packing import pack_rows, pad_pack

    lengths = [6, 1, 9, 4]
    generator = torch.Generator().manual_seed(5)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 3, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(4, ARCH_A.vocab_size, (n,), generator=generator)
        mask[row, :n] = 1
    packed = pad_pack(pack_rows(ids, mask), sum(lengths) + 3, pad_id=3)
    model = load_bloom(hf_dir).train()
    assert model._packed_sequences(packed.segments, packed.segments.shape[1], None) is not None
    assert model._packed_sequences(mask, width, None) is None  # a padded batch: masked path
    weights = torch.randn(sum(lengths), generator=generator)

    def loss_and_grads(logits_real):
        model.zero_grad(set_to_none=True)
        loss = (logits_real[:, : ARCH_A.vocab_size].logsumexp(dim=-1) * weights).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits_real.detach(), grads

    packed_logits, packed_grads = loss_and_grads(
        model(packed.input_ids, packed.segments)[0, : sum(lengths)]
    )
    padded_logits, padded_grads = loss_and_grads(model(ids, mask)[mask.bool()])
    assert (packed_logits - padded_logits).abs().max() <= 1e-5
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) > 10
    for name, grad in padded_grads.items():
        gap = (packed_grads[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-12)
        assert gap <= 1e-5, (name, float(gap))


def test_vocab_projection_of_a_decode_step_equals_one_linear_in_float64():
    from megatron_rlhf.models.bloom.vocab import LARGE_VOCAB, vocab_projection

    generator = torch.Generator().manual_seed(0)
    vocab = LARGE_VOCAB + 123  # the decode path, an awkward size
    weight = torch.randn(vocab, 32, generator=generator)
    reference = weight.double()
    # decode steps (3-D, 2-D), 1 and 2 rows (F.linear), many rows (F.linear)
    for shape in ((1, 8, 32), (3, 32), (2, 5, 32), (1, 1, 32), (2, 32), (100, 32)):
        hidden = torch.randn(*shape, generator=generator)
        out = vocab_projection(hidden, weight)
        assert out.shape == (*shape[:-1], vocab) and out.is_contiguous()
        torch.testing.assert_close(out.double(), hidden.double() @ reference.t(), rtol=0, atol=2e-5)
    bf16 = vocab_projection(torch.randn(8, 32, generator=generator).bfloat16(), weight.bfloat16())
    assert bf16.dtype == torch.bfloat16


def test_output_positions_give_those_columns_logits_and_gradients(single_process, hf_dir):
    """``output_positions``: the LM head runs on the chosen columns only; logits and every
    parameter's gradient equal those of the full logits' same columns (ragged rows)."""
    from megatron_rlhf.checkpoint import load_bloom

    ids, mask = left_padded_batch(ARCH_A.vocab_size, [9, 5, 7], seed=4)
    positions = torch.tensor([8, 3, 5, 6])  # any order, not contiguous
    weights = torch.randn(3, 4, padded_vocab_size(ARCH_A.vocab_size, 1))
    grads = []
    for select in (False, True):
        model = load_bloom(hf_dir)
        if select:
            logits = model(ids, mask, output_positions=positions)
        else:
            logits = model(ids, mask)[:, positions]
        assert logits.shape == weights.shape
        (logits[..., : ARCH_A.vocab_size] * weights[..., : ARCH_A.vocab_size]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        grads[-1]["logits"] = logits.detach()
    for name, full in grads[0].items():
        torch.testing.assert_close(grads[1][name], full, rtol=1e-5, atol=1e-6, msg=name)


def regression_step(head: str) -> tuple[list[dict], object]:
    """Two ragged micro-batches and a squared-error loss on every output (the logits of an LM
    head, the value of a scalar head) against fixed random targets: one training step's
    inputs for :meth:`TrainEngine.step`."""
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [9, 5, 7, 3], seed=5)
    microbatches = [
        {"input_ids": ids[:2], "padding_mask": mask[:2]},
        {"input_ids": ids[2:], "padding_mask": mask[2:]},
    ]
    generator = torch.Generator().manual_seed(6)
    width = padded_vocab_size(ARCH_A.vocab_size, 1) if head == "lm" else 1
    targets = torch.randn(2, 9, width, generator=generator)

    def loss_fn(output, microbatch):
        rows = 0 if microbatch["input_ids"] is ids[:2] else 1
        valid = output[..., : ARCH_A.vocab_size] if head == "lm" else output
        target = targets[rows, :, : valid.shape[-1]]
        error = (valid.float() - target).pow(2) * microbatch["padding_mask"][..., None]
        return error.mean(), {}

    return microbatches, loss_fn


@pytest.mark.parametrize("head", ["lm", "scalar"])
def test_vocabulary_gradients_into_main_grad_equal_megatrons_path(
    single_process, hf_dir, head, monkeypatch
):
    """The embedding, the tied LM head and (on a CPU in fp32) the trunk's linears write their
    weight gradients into DDP's ``main_grad`` (models/bloom/vocab.py, lean.py), their products
    through oneDNN (models/cpu_linear.py); one optimizer step equals the same step through
    Megatron-Core's own layers (the opt-in removed): loss, gradient norm, the gradients and
    every updated weight whose gradient stands above rounding noise."""
    from unittest import mock

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models import cpu_linear
    from megatron_rlhf.models.bloom import vocab
    from megatron_rlhf.models.bloom.vocab import OPT_IN
    from megatron_rlhf.training import OptimConfig, TrainEngine

    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT", 0)  # this tiny model's products: oneDNN too
    microbatches, loss_fn = regression_step(head)
    results = []
    for fused in (True, False):
        model = load_bloom(hf_dir, head=head)
        engine = TrainEngine(model, OptimConfig(lr=1e-3, warmup_fraction=0.0), total_steps=2)
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        word_embeddings = model.embedding.word_embeddings.weight
        assert getattr(word_embeddings, OPT_IN) is True  # the engine opted its model in
        if not fused:
            for param in model.parameters():
                setattr(param, OPT_IN, False)
        with (
            mock.patch.object(vocab, "embedding", wraps=vocab.embedding) as embedding,
            mock.patch.object(vocab, "linear", wraps=vocab.linear) as linear,
        ):
            metrics = engine.step(microbatches, loss_fn)
        assert embedding.call_count == (2 if fused else 0)  # one per microbatch
        # per microbatch: the LM head, and every trunk linear (the CPU fp32 path, lean.py)
        linears = 4 * model.config.num_layers + (head == "lm")
        assert linear.call_count == (2 * linears if fused else 0)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
        results.append((metrics["loss"], metrics["grad_norm"], weights, grads))
    (loss, norm, weights, grads), (ref_loss, ref_norm, ref_weights, ref_grads) = results
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    moved = min((initial[n] - w).abs().max().item() for n, w in weights.items())
    assert moved > 1e-4  # the step moved every tensor, the embedding included
    for name, grad in grads.items():
        # the same sums in another order (oneDNN's products, main_grad's accumulation)
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=name)
        # Adam turns a gradient at rounding noise into a full +-lr step whose sign is the
        # noise's (the key bias: softmax ignores it, its true gradient is 0); every weight
        # whose gradient stands above that noise took the same step
        signal = ref_grads[name].abs() > 1e-4 * scale
        torch.testing.assert_close(
            weights[name][signal], ref_weights[name][signal], rtol=1e-5, atol=1e-6, msg=name
        )


@pytest.mark.parametrize("head", ["lm", "scalar"])
def test_scoring_a_model_in_training_mode_takes_onednn(single_process, hf_dir, head, monkeypatch):
    """A trained model scores in training mode without autograd (PPO's critic after an update):
    every trunk linear then runs ``cpu_linear.linear`` (oneDNN on a CPU in fp32), not
    Megatron-Core's autograd function's MKL matmul, and the output equals Megatron-Core's path
    to fp32 rounding."""
    from unittest import mock

    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.models import cpu_linear
    from megatron_rlhf.models.bloom import lean

    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT", 0)  # this tiny model's products: oneDNN too
    model = load_bloom(hf_dir, head=head).train()
    ids, mask = left_padded_batch(ARCH_A.vocab_size, [9, 5, 7], seed=11)
    with torch.no_grad(), mock.patch.object(lean, "linear", wraps=lean.linear) as linear:
        ours = model(ids, mask)
    assert linear.call_count == 4 * model.config.num_layers
    with torch.no_grad(), mock.patch.object(lean, "_cpu_forward", return_value=None):
        megatrons = model(ids, mask)
    torch.testing.assert_close(ours, megatrons, rtol=1e-5, atol=1e-5)


def test_clipping_folded_into_fused_adam_equals_the_clipping_sweep(
    single_process, hf_dir, monkeypatch
):
    """On a CPU the clip coefficient reaches torch's fused Adam as its ``grad_scale``
    (training/engine.py) instead of a sweep over the gradients: Adam's moments and the weights
    equal the sweep's to rounding, the moments are the clipped gradients' (not the raw ones'),
    and no ``grad_scale`` outlives the step."""
    from megatron_rlhf.checkpoint import load_bloom
    from megatron_rlhf.training import OptimConfig, TrainEngine
    from megatron_rlhf.training import engine as engine_module

    microbatches, loss_fn = regression_step("lm")
    runs = {}
    for way in ("folded", "sweep", "unclipped"):
        if way == "sweep":
            monkeypatch.setattr(engine_module, "fold_clip_into_cpu_adam", lambda *args: False)
        model = load_bloom(hf_dir, head="lm")
        clip = 0.0 if way == "unclipped" else 1e-2
        optim = OptimConfig(lr=1e-3, warmup_fraction=0.0, clip_grad=clip)
        engine = TrainEngine(model, optim, total_steps=2)
        metrics = engine.step(microbatches, loss_fn)
        chained = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
        assert not any(hasattr(o.optimizer, "grad_scale") for o in chained)
        state = {}
        for o in chained:
            state |= {id(p): s["exp_avg"].clone() for p, s in o.optimizer.state.items()}
        runs[way] = (
            metrics["grad_norm"],
            {n: p.detach().clone() for n, p in model.named_parameters()},
            {n: state[id(p)] for n, p in model.named_parameters()},
        )
    norm, weights, moments = runs["folded"]
    assert norm > 1e-2  # the coefficient (1e-2 / norm) is below 1: clipping happened
    _, sweep_weights, sweep_moments = runs["sweep"]
    _, _, raw_moments = runs["unclipped"]
    for name in weights:
        scale = raw_moments[name].abs().max().item()
        torch.testing.assert_close(moments[name], sweep_moments[name], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(weights[name], sweep_weights[name], rtol=1e-5, atol=1e-7)
        if scale > 0:  # the moments hold the clipped gradients: 1e-2 / norm of the raw ones
            torch.testing.assert_close(
                moments[name], raw_moments[name] * (1e-2 / norm), rtol=1e-3, atol=1e-6 * scale
            )
