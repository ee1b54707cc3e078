"""BLOOM at TP=1/2 x PP=1/2 (4 processes over gloo) against transformers, in one torchrun launch.

``dist_bloom_worker.py`` runs every check; this file builds the tiny HF checkpoints, launches it
once, and turns each check into a test. See the worker for what each check compares.
"""

from __future__ import annotations

import pytest
from dist_bloom_common import ARCH_A, ARCH_B, save_hf_bloom
from torchrun_util import REPO, assert_check, run_checks

LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]
OTHER_LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2"]
GEN_LAYOUTS = LAYOUTS
PIPELINED_LAYOUTS = ["tp1pp2", "tp2pp2"]
CHECKS = [
    *(f"logits_{arch}_{layout}" for arch in "ab" for layout in LAYOUTS),
    "logits_a_tp1pp4",
    "logits_b_tp4pp1",
    "logits_a_tp2pp1_sequence_parallel",
    "logits_a_tp2pp2_sequence_parallel",
    "scalar_head_tp2pp2",
    *(f"ckpt_tp2pp2_loads_at_{layout}_bit_exact" for layout in OTHER_LAYOUTS),
    *(f"ckpt_tp2pp2_logits_at_{layout}" for layout in OTHER_LAYOUTS),
    *(f"scalar_ckpt_tp2pp2_at_{layout}" for layout in OTHER_LAYOUTS),
    "ckpt_wrong_head_refused",
    "ckpt_save_refuses_existing_dir",
    "generation_eos_token_usable",
    *(f"greedy_{layout}_{cache}" for layout in GEN_LAYOUTS for cache in ("kv_cache", "no_cache")),
    *(f"greedy_eos_stop_{layout}" for layout in GEN_LAYOUTS),
    *(f"greedy_eos_stop_{layout}_decode_batch2" for layout in ("tp1pp1", "tp2pp1")),
    *(f"sampling_decode_batch3_{layout}_vs_all_at_once" for layout in ("tp1pp1", "tp2pp1")),
    *(f"sampling_seed_reproducible_{layout}_vs_tp1" for layout in LAYOUTS[1:]),
    # pipelined generation: unpipelined (1) and uneven (3) micro-batches, and PP=4's ring
    *(
        f"greedy_{layout}_micro_batches{parts}_{cache}"
        for layout in PIPELINED_LAYOUTS
        for parts in (1, 3)
        for cache in ("kv_cache", "no_cache")
    ),
    *(f"greedy_eos_stop_{layout}_micro_batches{p}" for layout in PIPELINED_LAYOUTS for p in (1, 3)),
    *(
        f"sampling_seed_reproducible_{layout}_micro_batches{p}_vs_tp1"
        for layout in PIPELINED_LAYOUTS
        for p in (1, 3)
    ),
    "greedy_tp1pp4_kv_cache",
    "greedy_eos_stop_tp1pp4",
    "sampling_seed_reproducible_tp1pp4_vs_tp1",
    *(f"greedy_tp1pp4_micro_batches{p}_kv_cache" for p in (1, 3)),
    *(f"greedy_eos_stop_tp1pp4_micro_batches{p}" for p in (1, 3)),
    *(f"sampling_seed_reproducible_tp1pp4_micro_batches{p}_vs_tp1" for p in (1, 3)),
    "sampling_other_seed_differs",
    *(
        f"{head}_grads_tp2pp1{sp}_vs_tp1"
        for head in ("lm", "scalar")
        for sp in ("", "_sequence_parallel")
    ),
    *(f"meta_bf16_{head}_{layout}" for head in ("lm", "scalar") for layout in LAYOUTS),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bloom_parallel")
    save_hf_bloom(root / "hf_a", ARCH_A, seed=0)
    save_hf_bloom(root / "hf_b", ARCH_B, seed=1)
    (root / "work").mkdir()
    return run_checks(
        REPO / "tests" / "dist_bloom_worker.py",
        4,
        root / "results",
        "--hf-a",
        str(root / "hf_a"),
        "--hf-b",
        str(root / "hf_b"),
        "--work",
        str(root / "work"),
        timeout=600,
    )


@pytest.mark.launch(ranks=4)
def test_worker_ran_exactly_the_expected_checks(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("check", CHECKS)
def test_bloom_parallel(results, check):
    assert_check(results, check)
