"""Accuracy, ECE, reliability curve and per-task statistics against plain-Python references and
hand-computed cases."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from megatron_rlhf.reward.calibration import (
    calibration_bins,
    expected_calibration_error,
    per_task_stats,
    ranking_accuracy,
    reliability_curve,
)


def reference_ece(chosen, rejected, bins=10):
    """DESIGN.md §2 ECE×100 with loops: bins [lo, hi) over [0.5, 1], 1.0 in the last bin."""
    members = [[] for _ in range(bins)]
    for c, r in zip(chosen, rejected):
        conf = 1.0 / (1.0 + math.exp(-abs(c - r)))
        correct = 1.0 if c > r else 0.0 if c < r else 0.5
        index = next(
            (b for b in range(bins) if conf < 0.5 + 0.5 * (b + 1) / bins), bins - 1
        )  # first bin whose upper edge is above conf
        members[index].append((conf, correct))
    total = len(chosen)
    ece = 0.0
    for rows in members:
        if rows:
            mean_conf = sum(conf for conf, _ in rows) / len(rows)
            mean_acc = sum(correct for _, correct in rows) / len(rows)
            ece += len(rows) / total * abs(mean_acc - mean_conf)
    return 100.0 * ece, [len(rows) for rows in members]


def random_pairs(size, seed, ties=0):
    rng = np.random.default_rng(seed)
    chosen = rng.normal(0.8, 1.7, size)
    rejected = rng.normal(0.0, 1.7, size)
    rejected[:ties] = chosen[:ties]
    return chosen.tolist(), rejected.tolist()


def test_hand_computed_case():
    # Δ=2 correct (conf σ(2)=0.880797, bin 7), Δ=1 wrong (σ(1)=0.731059, bin 4), tie (0.5, bin 0)
    chosen, rejected = [2.0, 0.0, 1.0], [0.0, 1.0, 1.0]
    s2, s1 = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(-1))
    expected = 100 * ((1 - s2) + (s1 - 0) + abs(0.5 - 0.5)) / 3
    assert expected_calibration_error(chosen, rejected) == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(100 * (0.119203 + 0.731059) / 3, abs=1e-4)
    assert ranking_accuracy(chosen, rejected) == pytest.approx(1 / 3)  # the tie counts as wrong
    counts = [row["count"] for row in calibration_bins(chosen, rejected)]
    assert counts == [1, 0, 0, 0, 1, 0, 0, 1, 0, 0]


def test_confidence_one_lands_in_last_bin():
    # σ(60) is exactly 1.0 in float64
    table = calibration_bins([60.0, 0.0], [0.0, 0.0], bins=4)
    assert [row["count"] for row in table] == [1, 0, 0, 1]
    assert table[-1]["confidence"] == 1.0
    assert expected_calibration_error([60.0], [0.0]) == pytest.approx(0.0, abs=1e-12)
    assert expected_calibration_error([0.0], [60.0]) == pytest.approx(100.0)


@pytest.mark.parametrize(("size", "bins", "ties"), [(1, 10, 0), (37, 10, 3), (1001, 7, 20)])
def test_ece_and_accuracy_match_reference(size, bins, ties):
    chosen, rejected = random_pairs(size, seed=size, ties=ties)
    ref_ece, ref_counts = reference_ece(chosen, rejected, bins)
    assert expected_calibration_error(chosen, rejected, bins) == pytest.approx(ref_ece, abs=1e-9)
    assert [row["count"] for row in calibration_bins(chosen, rejected, bins)] == ref_counts
    ref_accuracy = sum(c > r for c, r in zip(chosen, rejected)) / size
    assert ranking_accuracy(chosen, rejected) == pytest.approx(ref_accuracy, abs=1e-12)
    # tensors (any dtype) are accepted as well as lists
    as_tensors = torch.tensor(chosen, dtype=torch.float32), torch.tensor(rejected)
    assert expected_calibration_error(*as_tensors, bins) == pytest.approx(ref_ece, abs=1e-4)


def test_reliability_curve_matches_reference():
    chosen, rejected = random_pairs(500, seed=5, ties=4)
    curve = reliability_curve(chosen, rejected, bins=8)
    deltas = [abs(c - r) for c, r in zip(chosen, rejected)]
    width = max(deltas) / 8
    for row in curve:
        b = round(row["delta_lo"] / width)
        rows = [
            i
            for i, d in enumerate(deltas)
            if b * width <= d < (b + 1) * width or (b == 7 and d == max(deltas))
        ]
        assert row["count"] == len(rows)
        correct = [
            1.0 if chosen[i] > rejected[i] else 0.0 if chosen[i] < rejected[i] else 0.5
            for i in rows
        ]
        assert row["accuracy"] == pytest.approx(sum(correct) / len(rows), abs=1e-12)
        mean_delta = sum(deltas[i] for i in rows) / len(rows)
        assert row["delta_mean"] == pytest.approx(mean_delta, abs=1e-12)
        assert row["calibrated"] == pytest.approx(1 / (1 + math.exp(-mean_delta)), abs=1e-12)
    assert sum(row["count"] for row in curve) == 500
    # a cap on Δ puts everything larger into the last bin
    capped = reliability_curve(chosen, rejected, bins=4, max_delta=1.0)
    assert capped[-1]["count"] == sum(d >= 0.75 for d in deltas)


def test_per_task_stats_match_statistics_module():
    chosen, rejected = random_pairs(300, seed=9)
    rng = np.random.default_rng(9)
    tasks = [str(t) for t in rng.choice(["qa", "code", "math", "x"], 300, p=[0.5, 0.3, 0.19, 0.01])]
    stats = per_task_stats(chosen, rejected, tasks)
    assert list(stats) == sorted(set(tasks))
    for task, row in stats.items():
        rows = [i for i, t in enumerate(tasks) if t == task]
        scores = [chosen[i] for i in rows] + [rejected[i] for i in rows]
        assert row["count"] == 2 * len(rows) and row["pairs"] == len(rows)
        assert row["mean"] == pytest.approx(statistics.fmean(scores), abs=1e-12)
        assert row["std"] == pytest.approx(statistics.pstdev(scores), abs=1e-12)
        ref_accuracy = sum(chosen[i] > rejected[i] for i in rows) / len(rows)
        assert row["accuracy"] == pytest.approx(ref_accuracy, abs=1e-12)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="same non-zero number"):
        expected_calibration_error([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="same non-zero number"):
        ranking_accuracy([], [])
    with pytest.raises(ValueError, match="bins"):
        calibration_bins([1.0], [0.0], bins=0)
    with pytest.raises(ValueError, match="task labels"):
        per_task_stats([1.0], [0.0], ["a", "b"])
