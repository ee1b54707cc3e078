"""One optimizer step of an LM-head BLOOM at TP=2 and at PP=2 equals TP=1 (issue: TP/PP parity)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_util import run_torchrun

WORKER = Path(__file__).resolve().parent / "dist_engine_worker.py"
CHECKS = ["tp2_pp1_step_equals_tp1", "tp1_pp2_step_equals_tp1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    root = tmp_path_factory.mktemp("engine")
    save_random_hf_bloom(root / "hf", tiny_architecture(vocab_size=250, num_layers=2), seed=3)
    return run_torchrun(WORKER, 2, root / "out.json", "--hf", str(root / "hf"))


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_optimizer_step_matches_tp1(results, check):
    assert check in results, sorted(results)
    assert results[check]["ok"], results[check]["detail"]
