"""TP=2 against TP=1 for the log-prob kernels, and whitening over a data-parallel group.

One torchrun launch (2 processes, gloo) runs every check of ``dist_kernels_worker.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_util import assert_check, run_checks

WORKER = Path(__file__).with_name("dist_kernels_worker.py")
CHECKS = [
    "logits_tp2_fp32",
    "logits_tp2_bf16",
    "hidden_tp2",
    "vs_megatron_core_tp2",
    "whiten_dp2",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_checks(WORKER, 2, tmp_path_factory.mktemp("dist_kernels") / "results")


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("check", CHECKS)
def test_dist_kernels(check, results):
    assert_check(results, check)
