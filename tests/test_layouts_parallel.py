"""Per-role layouts on 4 gloo ranks (one torchrun launch, ``dist_layouts_worker.py``): hand-offs
between layouts, and rollouts from the training layout (TP2xPP2), the resharded rollout layout
(TP2, DP2, refit by Megatron-Core's ``swap_model_weights``) and TP1 giving identical tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_bloom_common import ARCH_A, save_hf_bloom
from torchrun_util import run_torchrun

WORKER = Path(__file__).with_name("dist_layouts_worker.py")
CHECKS = ["handoff_gather_rows", "rollout_greedy_layouts", "rollout_sampled_layouts"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    save_hf_bloom(root / "hf", ARCH_A)
    return run_torchrun(WORKER, 4, root / "out.json", "--hf", str(root / "hf"))


@pytest.mark.parametrize("check", CHECKS)
def test_layouts(results, check):
    assert results[check]["ok"], results[check]["detail"]
