"""Datasets, the resumable data-parallel sampler/loader and the collators.

References: the uninterrupted single-process stream (for resume and sharding), plain Python
padding of the raw id lists (for collators and loaders), and the raw examples written through
the ``write_*_dataset`` API (for the datasets).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrun_util import run_checks

from megatron_rlhf.data import (
    Example,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    ShardedSampler,
    build_loader,
    collate_preference,
    collate_prompts,
    collate_sft,
    read_sidecar,
    write_preference_dataset,
    write_prompt_dataset,
    write_sft_dataset,
)

VOCAB, EOS, PAD = 900, 2, 3


def rand_ids(rng: random.Random, low: int = 1, high: int = 40) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(low, high))]


def stream(sampler_kwargs: dict, count: int) -> list[int]:
    return list(itertools.islice(iter(ShardedSampler(**sampler_kwargs)), count))


def rank_steps(num_samples, dp_size, mbs, seed, steps, consumed=0, shuffle=True):
    """Per step, the concatenation over ranks of each rank's micro-batch of indices."""
    per_rank = [
        stream(
            dict(
                num_samples=num_samples,
                dp_rank=r,
                dp_size=dp_size,
                seed=seed,
                consumed_samples=consumed,
                shuffle=shuffle,
                micro_batch_size=mbs,
            ),
            steps * mbs,
        )
        for r in range(dp_size)
    ]
    return [sum((rank[s * mbs : (s + 1) * mbs] for rank in per_rank), []) for s in range(steps)]


def test_each_epoch_is_a_seeded_permutation():
    n = 37
    order = stream(dict(num_samples=n, dp_rank=0, dp_size=1, seed=5), 4 * n)
    epochs = [order[e * n : (e + 1) * n] for e in range(4)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 4  # reshuffled every epoch
    assert epochs[0] == np.random.default_rng([5, 0]).permutation(n).tolist()
    assert order == stream(dict(num_samples=n, dp_rank=0, dp_size=1, seed=5), 4 * n)
    assert order != stream(dict(num_samples=n, dp_rank=0, dp_size=1, seed=6), 4 * n)
    plain = stream(dict(num_samples=n, dp_rank=0, dp_size=1, seed=5, shuffle=False), 2 * n)
    assert plain == list(range(n)) * 2


@pytest.mark.parametrize("num_samples,dp_size,mbs", [(37, 2, 3), (10, 3, 4), (64, 4, 2), (5, 1, 7)])
def test_shards_rebuild_the_single_process_order(num_samples, dp_size, mbs):
    single = stream(dict(num_samples=num_samples, dp_rank=0, dp_size=1, seed=3), 9 * dp_size * mbs)
    steps = rank_steps(num_samples, dp_size, mbs, seed=3, steps=9)
    assert sum(steps, []) == single


@pytest.mark.parametrize("num_samples,dp_size,mbs", [(37, 2, 3), (10, 3, 4), (23, 1, 5)])
def test_resume_mid_epoch_and_across_epochs_equals_uninterrupted(num_samples, dp_size, mbs):
    total_steps = 3 * num_samples // (dp_size * mbs) + 4  # runs through several epochs
    uninterrupted = rank_steps(num_samples, dp_size, mbs, seed=9, steps=total_steps)
    for stop in sorted({1, 2, total_steps // 3, total_steps // 2, total_steps - 1}):
        consumed = stop * dp_size * mbs
        resumed = rank_steps(
            num_samples, dp_size, mbs, seed=9, steps=total_steps - stop, consumed=consumed
        )
        assert resumed == uninterrupted[stop:], (stop, consumed)
    # Resuming under another data-parallel size continues the same global order.
    consumed = 5 * dp_size * mbs
    other = rank_steps(num_samples, dp_size + 1, mbs, seed=9, steps=3, consumed=consumed)
    single = stream(dict(num_samples=num_samples, dp_rank=0, dp_size=1, seed=9), 200)
    assert sum(other, []) == single[consumed : consumed + 3 * (dp_size + 1) * mbs]


@pytest.mark.parametrize("drop_last", [True, False])
def test_total_samples_and_length(drop_last):
    n, dp, mbs, total = 13, 3, 2, 40
    seen = []
    for rank in range(dp):
        sampler = ShardedSampler(
            n,
            rank,
            dp,
            seed=1,
            consumed_samples=4,
            micro_batch_size=mbs,
            total_samples=total,
            drop_last=drop_last,
        )
        indices = list(sampler)
        assert len(indices) == len(sampler)
        seen.append(indices)
    single = stream(dict(num_samples=n, dp_rank=0, dp_size=1, seed=1), 60)
    end = 36 if drop_last else 40  # 36 = last whole global step of 6 samples
    assert sorted(itertools.chain(*seen)) == sorted(single[4:end])
    with pytest.raises(TypeError):
        len(ShardedSampler(n, 0, dp, seed=1))


def pad_left(rows, width, value):
    return [[value] * (width - len(r)) + r for r in rows]


def pad_right(rows, width, value):
    return [r + [value] * (width - len(r)) for r in rows]


@pytest.mark.parametrize("batch,multiple", [(1, 1), (5, 1), (4, 8)])
def test_collators_match_plain_padding(batch, multiple):
    rng = random.Random(batch * 10 + multiple)
    prompts = [rand_ids(rng, 1, 17) for _ in range(batch)]
    responses = [[rand_ids(rng, 1, 11) for _ in range(2)] for _ in range(batch)]

    def width(longest):
        return -(-longest // multiple) * multiple

    got = collate_prompts(
        [{"input_ids": p, "index": i} for i, p in enumerate(prompts)], PAD, multiple
    )
    w = width(max(map(len, prompts)))
    assert got["input_ids"].tolist() == pad_left(prompts, w, PAD)
    assert got["attention_mask"].tolist() == pad_left([[1] * len(p) for p in prompts], w, 0)
    assert got["prompt_lengths"].tolist() == [len(p) for p in prompts]
    assert got["index"].tolist() == list(range(batch))

    seqs = [p + r[0] for p, r in zip(prompts, responses)]
    masks = [[0] * len(p) + [1] * len(r[0]) for p, r in zip(prompts, responses)]
    got = collate_sft(
        [{"input_ids": torch.tensor(s), "loss_mask": torch.tensor(m)} for s, m in zip(seqs, masks)],
        PAD,
        multiple,
    )
    w = width(max(map(len, seqs)))
    assert got["input_ids"].tolist() == pad_right(seqs, w, PAD)
    assert got["attention_mask"].tolist() == pad_right([[1] * len(s) for s in seqs], w, 0)
    assert got["loss_mask"].tolist() == pad_right(masks, w, 0)

    samples = [
        {
            "prompt_ids": p,
            "chosen_ids": r[0],
            "rejected_ids": r[1],
            "task_id": i % 2,
            "chosen_logprobs": [-1.0 * i, -2.0],
            "rejected_logprobs": [-3.0, -4.0 * i],
        }
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]
    got = collate_preference(samples, PAD, multiple)
    w = width(max(len(p) + len(x) for p, r in zip(prompts, responses) for x in r))
    for side, k in (("chosen", 0), ("rejected", 1)):
        full = [p + r[k] for p, r in zip(prompts, responses)]
        assert got[f"{side}_input_ids"].tolist() == pad_right(full, w, PAD)
        assert got[f"{side}_attention_mask"].tolist() == pad_right(
            [[1] * len(f) for f in full], w, 0
        )
        response_mask = [[0] * len(p) + [1] * len(r[k]) for p, r in zip(prompts, responses)]
        assert got[f"{side}_response_mask"].tolist() == pad_right(response_mask, w, 0)
        assert got[f"{side}_logprobs"].dtype == torch.float32
        assert got[f"{side}_logprobs"].tolist() == [s[f"{side}_logprobs"] for s in samples]
    assert got["prompt_lengths"].tolist() == [len(p) for p in prompts]
    assert got["task_ids"].tolist() == [i % 2 for i in range(batch)]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """Raw examples of each kind, and the prefixes they were written to."""
    tmp = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    prompts = [rand_ids(rng) for _ in range(29)]
    sft = [([] if i % 7 == 0 else rand_ids(rng), rand_ids(rng)) for i in range(31)]
    sft[3] = (sft[3][0], sft[3][1] + [EOS])  # already ends in EOS: no second EOS
    pref = [
        Example(
            rand_ids(rng),
            (rand_ids(rng), rand_ids(rng)),
            task=f"t{i % 3}",
            logprobs=((-rng.random(), -5.0), (-rng.random(), -6.0)),
        )
        for i in range(23)
    ]
    meta = {"curation": {"clusters": 4}}
    write_prompt_dataset(tmp / "prompt", prompts, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD)
    write_sft_dataset(tmp / "sft", sft, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD, metadata=meta)
    write_preference_dataset(tmp / "pref", pref, vocab_size=VOCAB, eos_id=EOS, pad_id=PAD)
    return {"dir": tmp, "prompt": prompts, "sft": sft, "pref": pref}


def test_datasets_read_what_the_api_wrote(written):
    tmp = written["dir"]
    prompts = PromptDataset(tmp / "prompt")
    assert [prompts[i]["input_ids"].tolist() for i in range(len(prompts))] == written["prompt"]
    sft = SFTDataset(tmp / "sft")
    assert read_sidecar(tmp / "sft")["metadata"] == {"curation": {"clusters": 4}}
    for i, (prompt, response) in enumerate(written["sft"]):
        response = response if response[-1] == EOS else response + [EOS]
        assert sft[i]["input_ids"].tolist() == prompt + response
        assert sft[i]["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(response)
    pref = PreferenceDataset(tmp / "pref")
    assert pref.task_names == ["t0", "t1", "t2"] and pref.num_behaviour_policies == 2
    for i, example in enumerate(written["pref"]):
        item = pref[i]
        assert item["prompt_ids"].tolist() == example.prompt_ids
        assert item["chosen_ids"].tolist() == example.response_ids[0] + [EOS]
        assert item["rejected_ids"].tolist() == example.response_ids[1] + [EOS]
        assert pref.task_names[item["task_id"]] == example.task
        assert item["chosen_logprobs"].tolist() == pytest.approx(example.logprobs[0], rel=1e-6)
    with pytest.raises(ValueError, match="holds sft data"):
        PromptDataset(tmp / "sft")
    with pytest.raises(ValueError, match="no sidecar"):
        SFTDataset(tmp / "missing")


def test_write_api_refuses_bad_examples_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="example 2: empty response"):
        write_sft_dataset(
            tmp_path / "x", [([1], [2]), ([1], [5]), ([1], [])], vocab_size=VOCAB, eos_id=EOS
        )
    with pytest.raises(ValueError, match="example 1: empty prompt"):
        write_prompt_dataset(tmp_path / "x", [[1], []], vocab_size=VOCAB)
    with pytest.raises(ValueError, match="example 1: .*same K"):
        write_preference_dataset(
            tmp_path / "x",
            [
                Example([1], ([4], [5]), logprobs=((-1.0,), (-2.0,))),
                Example([1], ([4], [5]), logprobs=((-1.0, -1.0), (-2.0, -2.0))),
            ],
            vocab_size=VOCAB,
            eos_id=EOS,
        )
    assert list(tmp_path.iterdir()) == []


def test_loader_batches_match_plain_reference_and_resume(written):
    tmp, raw = written["dir"], written["sft"]
    dataset = SFTDataset(tmp / "sft")
    mbs, dp, seed, steps = 3, 2, 4, 14  # 14 steps x 6 samples = 2.7 epochs of 31
    order = stream(dict(num_samples=len(raw), dp_rank=0, dp_size=1, seed=seed), steps * mbs * dp)

    def expected(step: int, rank: int) -> list[list[int]]:
        first = step * mbs * dp + rank * mbs
        rows = []
        for index in order[first : first + mbs]:
            prompt, response = raw[index]
            rows.append(prompt + (response if response[-1] == EOS else response + [EOS]))
        return pad_right(rows, max(map(len, rows)), PAD)

    for rank in range(dp):
        loader = build_loader(dataset, mbs, None, rank, dp, seed)
        batches = list(itertools.islice(loader, steps))
        assert [b["input_ids"].tolist() for b in batches] == [
            expected(s, rank) for s in range(steps)
        ]
        stop = 6  # mid-epoch: 36 samples consumed of 31 per epoch
        resumed = build_loader(
            dataset,
            mbs,
            None,
            rank,
            dp,
            seed,
            consumed_samples=stop * mbs * dp,
            num_workers=2 if rank else 0,
        )
        again = list(itertools.islice(resumed, steps - stop))
        for a, b in zip(again, batches[stop:]):
            assert all(torch.equal(a[key], b[key]) for key in b)
        assert len(again) == steps - stop


def test_loader_tail_and_side_fields(written):
    dataset = PreferenceDataset(written["dir"] / "pref")
    loader = build_loader(
        dataset, 4, None, 0, 1, seed=0, shuffle=False, total_samples=23, drop_last=False
    )
    batches = list(loader)
    assert [len(b["index"]) for b in batches] == [4, 4, 4, 4, 4, 3]
    last = batches[-1]
    assert last["index"].tolist() == [20, 21, 22]
    assert last["chosen_logprobs"].shape == (3, 2) and last["task_ids"].tolist() == [2, 0, 1]
    prompt_loader = build_loader(
        PromptDataset(written["dir"] / "prompt"), 5, None, 0, 1, seed=0, shuffle=False
    )
    batch = next(iter(prompt_loader))
    assert batch["input_ids"][:, -1].tolist() == [p[-1] for p in written["prompt"][:5]]


@pytest.mark.launch(ranks=2)
def test_loader_over_two_gloo_ranks(tmp_path, written):
    script = Path(__file__).with_name("dist_data_loader.py")
    results = run_checks(script, 2, tmp_path / "out", "--data", str(written["dir"]))
    failed = {name: r["detail"] for name, r in results.items() if not r["ok"]}
    assert len(results) >= 3 and not failed, json.dumps(failed, indent=1)
