"""Sequence packing: the pure helpers (packs by token budget, data-parallel balancing, the
packed layout), and ``train-sft`` / ``train-reward`` packed against padded in one process
(the same global batches: losses, gradient norms and held-out metrics rel 1e-5; the parallel
layouts are in test_engine_parallel.py and test_reward_train.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_rlhf.data.packing import (
    balance_by_tokens,
    pack_by_budget,
    pack_first_fit,
    pack_rows,
    pad_pack,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))


def test_packs_are_consecutive_rows_within_the_budget():
    lengths = [5, 3, 9, 1, 1, 12, 4]
    packs = pack_by_budget(lengths, 10)
    assert packs == [[0, 1], [2, 3], [4], [5], [6]]
    assert [row for pack in packs for row in pack] == list(range(len(lengths)))  # order kept
    for pack in packs:  # within budget, or one row longer than it alone
        assert sum(lengths[r] for r in pack) <= 10 or len(pack) == 1
    assert pack_by_budget(lengths, 1000) == [list(range(7))]
    assert pack_by_budget(lengths, 1) == [[r] for r in range(7)]
    with pytest.raises(ValueError, match=">= 1"):
        pack_by_budget(lengths, 0)


def test_pack_rows_concatenates_real_tokens_with_sequence_ids():
    ids = torch.tensor([[3, 3, 10, 11, 12], [20, 21, 3, 3, 3], [3, 30, 31, 32, 3]])
    mask = (ids != 3).long()
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 31, 32]]
    assert packed.segments.tolist() == [[1, 1, 1, 2, 2, 3, 3, 3]]
    assert packed.starts.tolist() == [0, 3, 5] and packed.lengths.tolist() == [3, 2, 3]
    with pytest.raises(ValueError, match="at least one real token"):
        pack_rows(ids, torch.zeros_like(mask))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balance_gives_every_rank_a_near_equal_share(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=int(rng.integers(8, 40))).tolist()
    for parts in (1, 2, 3, 8):
        groups = balance_by_tokens(lengths, parts)
        assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
        assert all(group == sorted(group) and group for group in groups)
        loads = [sum(lengths[i] for i in group) for group in groups]
        assert max(loads) - min(loads) <= max(lengths)  # longest-first greedy's bound
        assert balance_by_tokens(lengths, parts) == groups  # deterministic


@pytest.mark.parametrize("seed", [0, 1])
def test_first_fit_packs_stay_within_the_budget_and_cover_every_item(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=30).tolist() + [75]  # one item over the budget
    packs = pack_first_fit(lengths, 64)
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
    for pack in packs:
        assert sum(lengths[i] for i in pack) <= 64 or pack == [30]
    # fuller than consecutive packing, never more packs than items need
    assert len(packs) <= len(pack_by_budget(lengths, 64))
    assert len(packs) >= -(-sum(lengths) // 64)
    with pytest.raises(ValueError, match=">= 1"):
        pack_first_fit(lengths, 0)


def test_pad_pack_adds_segment_zero_columns():
    packed = pack_rows(torch.tensor([[5, 6, 0], [7, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    padded = pad_pack(packed, 6, pad_id=0)
    assert padded.input_ids.tolist() == [[5, 6, 7, 0, 0, 0]]
    assert padded.segments.tolist() == [[1, 1, 2, 0, 0, 0]]
    with pytest.raises(ValueError, match="wider"):
        pad_pack(packed, 2, pad_id=0)


def _packed_and_padded(run_one) -> dict:
    from megatron_rlhf.distributed import destroy

    results = {}
    for packing in (True, False):
        try:
            result = run_one(packing)
        finally:
            destroy()
        history = result["history"]
        results[packing] = {
            "loss": [m["loss"] for m in history],
            "grad_norm": [m["grad_norm"] for m in history],
            "eval": result["eval"]["loss"],
        }
    return results


def _assert_equal(results: dict) -> None:
    packed, padded = results[True], results[False]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(packed[key], padded[key], rtol=1e-5)
    np.testing.assert_allclose(packed["eval"], padded["eval"], rtol=1e-5)


def test_sft_packed_equals_padded(tmp_path):
    from test_engine_parallel import write_sft_data

    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture
    from megatron_rlhf.training.config import ModelConfig, OptimConfig
    from megatron_rlhf.training.sft import SFTConfig, SFTDataConfig, TrainConfig, run

    save_random_hf_bloom(tmp_path / "hf", tiny_architecture(vocab_size=250, num_layers=2), seed=3)
    write_sft_data(tmp_path / "train", 40, seed=0)
    write_sft_data(tmp_path / "eval", 9, seed=1)

    def run_one(packing: bool) -> dict:
        return run(
            SFTConfig(
                model=ModelConfig(load=str(tmp_path / "hf")),
                data=SFTDataConfig(
                    train=str(tmp_path / "train"), eval=str(tmp_path / "eval"), max_length=12
                ),
                optim=OptimConfig(lr=1e-2, warmup_fraction=0.0),
                train=TrainConfig(
                    output_dir=str(tmp_path / f"run_{packing}"),
                    global_batch_size=8,
                    micro_batch_size=2,
                    max_tokens_per_micro_batch=20,
                    steps=3,
                    eval_interval=0,
                    save_interval=0,
                    seed=5,
                    packing=packing,
                ),
            )  # fmt: skip
        )

    _assert_equal(_packed_and_padded(run_one))


@pytest.mark.parametrize("loss", ["am", "rm"])
def test_reward_packed_equals_padded(tmp_path, loss):
    from test_reward_train import save_hf_bloom, write_synthetic_pairs

    from megatron_rlhf.reward.train import (
        AMConfig,
        ModelConfig,
        RewardDataConfig,
        RewardTrainConfig,
        TrainConfig,
        train,
    )  # fmt: skip
    from megatron_rlhf.training import OptimConfig

    data = write_synthetic_pairs(tmp_path / "pairs", pairs_per_task=22)
    hf = save_hf_bloom(tmp_path / "hf", num_outputs={"am": 2, "rm": 1}[loss], seed=1)

    def run_one(packing: bool) -> dict:
        return train(
            RewardTrainConfig(
                loss=loss,
                model=ModelConfig(load=str(hf)),
                data=RewardDataConfig(train=str(data), eval_fraction=0.1),
                am=AMConfig(margin=1.5),
                optim=OptimConfig(lr=3e-3, warmup_fraction=0.0, weight_decay=0.01),
                train=TrainConfig(
                    output_dir=str(tmp_path / f"run_{packing}"),
                    global_batch_size=8,
                    micro_batch_size=2,
                    steps=3,
                    eval_interval=0,
                    save_interval=0,
                    seed=11,
                    packing=packing,
                ),
            )  # fmt: skip
        )

    _assert_equal(_packed_and_padded(run_one))


@pytest.mark.e2e
def test_ppo_update_packed_equals_padded(tmp_path):
    """Two train-ppo steps (2 epochs x 2 minibatches, Selective Rehearsal on, a 24-token
    budget): every logged loss, gradient norm and fraction equals the padded run's."""
    import json
    import subprocess

    from ppo_fixtures import make_ppo_setup
    from torchrun_util import launch_env

    setup = make_ppo_setup(tmp_path)
    runs = {}
    for packing in ("true", "false"):
        output_dir = tmp_path / f"run_{packing}"
        proc = subprocess.run(
            [
                sys.executable, "-m", "megatron_rlhf", "train-ppo", "--config",
                str(setup["config"]), f"train.output_dir={output_dir}", "train.steps=2",
                f"train.packing={packing}", "train.max_tokens_per_micro_batch=24",
                "rehearsal.enabled=true", f"rehearsal.dataset={tmp_path / 'rehearsal'}",
                "rehearsal.gamma=0.5",
            ],
            env=launch_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (output_dir / "metrics.jsonl").read_text().splitlines()
        runs[packing] = [json.loads(line) for line in lines]
    assert len(runs["true"]) == len(runs["false"]) == 2
    for packed, padded in zip(runs["true"], runs["false"]):
        keys = [k for k in padded if isinstance(padded[k], float) and "/time" not in k]
        keys = [k for k in keys if "throughput" not in k and not k.startswith("time")]
        assert {"actor/policy_loss", "actor/rehearsal_nll", "critic/value_loss"} <= set(keys)
        for key in keys:
            assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
