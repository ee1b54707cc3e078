"""LM training at TP=2 and PP=2 equals TP=1: one engine step, and the ``train-sft`` command
(per-step losses, held-out NLL, first loss against transformers in float64); PPO's adaptive KL
controller at DP=2 equals DP=1. One torchrun launch (tests/dist_engine_worker.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from torchrun_util import assert_check, run_checks

WORKER = Path(__file__).resolve().parent / "dist_engine_worker.py"
CHECKS = [
    "tp2_pp1_step_equals_tp1",
    "tp1_pp2_step_equals_tp1",
    "sft_padded_equal_packed",
    "sft_tp2_pp1_losses_equal_tp1_dp2",
    "sft_tp1_pp2_losses_equal_tp1_dp2",
    "sft_first_loss_equals_hf_float64",
    "kl_controller_dp2_equals_dp1",
]


def write_sft_data(prefix: Path, count: int, seed: int, vocab_size: int = 250) -> Path:
    """Prompts of 2-9 tokens and responses of 1-8 (some sequences pass max_length = 12)."""
    from megatron_rlhf.data import write_sft_dataset

    rng = np.random.default_rng(seed)
    examples = [
        (
            rng.integers(4, vocab_size, size=rng.integers(2, 10)).tolist(),
            rng.integers(4, vocab_size, size=rng.integers(1, 9)).tolist(),
        )
        for _ in range(count)
    ]
    write_sft_dataset(prefix, examples, vocab_size=vocab_size, eos_id=2, pad_id=0)
    return prefix


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    root = tmp_path_factory.mktemp("engine")
    save_random_hf_bloom(root / "hf", tiny_architecture(vocab_size=250, num_layers=2), seed=3)
    write_sft_data(root / "sft" / "train", 40, seed=0)
    write_sft_data(root / "sft" / "eval", 9, seed=1)
    return run_checks(
        WORKER, 2, root / "results", "--hf", str(root / "hf"),
        "--sft-data", str(root / "sft"), "--work", str(root / "work"),
    )  # fmt: skip


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("check", CHECKS)
def test_lm_training_matches_tp1(results, check):
    assert_check(results, check)
