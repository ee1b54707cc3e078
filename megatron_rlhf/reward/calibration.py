"""Ranking accuracy, calibration (ECE, the paper's Fig. 2) and per-task score statistics (Fig. 4).

Pure math on per-pair scores: any 1-D sequence or tensor of chosen and rejected scores in,
JSON-ready floats and dicts out, computed in float64; no I/O.

Conventions (DESIGN.md §2 fixes the rest):
- accuracy is the share of pairs with s(y_c) > s(y_r) strictly: a tie counts as wrong.
- ECE: Δ = |s_c - s_r|, confidence σ(Δ) in [0.5, 1], 10 equal bins over [0.5, 1], each bin
  [lo, hi) except the last, which also holds confidence exactly 1.0;
  ECE = Σ_b (n_b / n) · |acc_b - conf_b|, reported ×100. A pair is correct (1) when the
  higher-scored response is the chosen one, wrong (0) when it is the rejected one, and a tie
  (Δ = 0, confidence 0.5) counts 1/2: a coin flip picks the "higher" one, which is exactly
  what confidence 0.5 predicts, so ties add no calibration error.
- per-task statistics pool the chosen and the rejected score of every pair of the task (each
  response is one scored example, as in Fig. 4); std is the population std (ddof = 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ArrayLike = torch.Tensor | Sequence[float]


def pair_correctness(chosen: ArrayLike, rejected: ArrayLike) -> torch.Tensor:
    """(P,) float64: 1 if the chosen score is higher, 0 if lower, 0.5 for a tie."""
    chosen, rejected = _as_pairs(chosen, rejected)
    return 0.5 * (1.0 + torch.sign(chosen - rejected))


def ranking_accuracy(chosen: ArrayLike, rejected: ArrayLike) -> float:
    """Share of pairs whose chosen response scores strictly higher (ties count as wrong)."""
    chosen, rejected = _as_pairs(chosen, rejected)
    return (chosen > rejected).double().mean().item()


def calibration_bins(chosen: ArrayLike, rejected: ArrayLike, bins: int = 10) -> list[dict]:
    """Per confidence bin over [0.5, 1]: its edges, pair count, accuracy and mean confidence.

    Empty bins have ``accuracy`` and ``confidence`` None. These are the terms of the ECE.
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    chosen, rejected = _as_pairs(chosen, rejected)
    confidence = torch.sigmoid((chosen - rejected).abs())  # (P,) σ(Δ) in [0.5, 1]
    correct = pair_correctness(chosen, rejected)  # (P,)
    edges = torch.linspace(0.5, 1.0, bins + 1, dtype=torch.float64)
    # bucketize(right=True) gives i with edges[i-1] <= conf < edges[i]; 1.0 goes to the last bin
    bin_index = (torch.bucketize(confidence, edges[1:-1], right=True)).clamp(max=bins - 1)
    table = []
    for b in range(bins):
        in_bin = bin_index == b
        count = int(in_bin.sum())
        table.append(
            {
                "conf_lo": edges[b].item(),
                "conf_hi": edges[b + 1].item(),
                "count": count,
                "accuracy": correct[in_bin].mean().item() if count else None,
                "confidence": confidence[in_bin].mean().item() if count else None,
            }
        )
    return table


def expected_calibration_error(chosen: ArrayLike, rejected: ArrayLike, bins: int = 10) -> float:
    """ECE ×100 (DESIGN.md §2; the paper reports RM 4.70 and AM 3.48 on HH-RLHF)."""
    table = calibration_bins(chosen, rejected, bins)
    total = sum(row["count"] for row in table)
    error = sum(
        row["count"] / total * abs(row["accuracy"] - row["confidence"])
        for row in table
        if row["count"]
    )
    return 100.0 * error


def reliability_curve(
    chosen: ArrayLike, rejected: ArrayLike, bins: int = 10, max_delta: float | None = None
) -> list[dict]:
    """Fig. 2: ranking accuracy against the score difference Δ = |s_c - s_r|.

    Equal-width bins of Δ over [0, max_delta] (default: the largest Δ; larger Δ fall in the
    last bin). Returns the non-empty bins: edges, count, mean Δ, accuracy (ties count 1/2) and
    the calibrated prediction σ(mean Δ).
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    chosen, rejected = _as_pairs(chosen, rejected)
    delta = (chosen - rejected).abs()  # (P,)
    correct = pair_correctness(chosen, rejected)  # (P,)
    top = delta.max().item() if max_delta is None else float(max_delta)
    top = top if top > 0 else 1.0
    edges = torch.linspace(0.0, top, bins + 1, dtype=torch.float64)
    bin_index = torch.bucketize(delta, edges[1:-1], right=True).clamp(max=bins - 1)
    curve = []
    for b in range(bins):
        in_bin = bin_index == b
        if not in_bin.any():
            continue
        delta_mean = delta[in_bin].mean()
        curve.append(
            {
                "delta_lo": edges[b].item(),
                "delta_hi": edges[b + 1].item(),
                "count": int(in_bin.sum()),
                "delta_mean": delta_mean.item(),
                "accuracy": correct[in_bin].mean().item(),
                "calibrated": torch.sigmoid(delta_mean).item(),
            }
        )
    return curve


def score_stats(scores: ArrayLike) -> dict:
    """Mean, population std and count of a set of scores."""
    values = torch.as_tensor(scores, dtype=torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError("no scores")
    return {
        "mean": values.mean().item(),
        "std": values.std(correction=0).item(),
        "count": values.numel(),
    }


def per_task_stats(chosen: ArrayLike, rejected: ArrayLike, tasks: Sequence[str]) -> dict:
    """Fig. 4: ``{task: {mean, std, count, pairs, accuracy}}``, tasks in sorted order.

    mean/std/count pool both scores of each pair (count = 2 · pairs); accuracy as
    :func:`ranking_accuracy` on the task's pairs.
    """
    chosen, rejected = _as_pairs(chosen, rejected)
    if len(tasks) != len(chosen):
        raise ValueError(f"{len(tasks)} task labels for {len(chosen)} pairs")
    rows_of_task: dict[str, list[int]] = {}
    for row, task in enumerate(tasks):
        rows_of_task.setdefault(task, []).append(row)
    stats = {}
    for task in sorted(rows_of_task):
        rows = torch.tensor(rows_of_task[task])
        stats[task] = {
            **score_stats(torch.cat([chosen[rows], rejected[rows]])),
            "pairs": len(rows),
            "accuracy": ranking_accuracy(chosen[rows], rejected[rows]),
        }
    return stats


def _as_pairs(chosen: ArrayLike, rejected: ArrayLike) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = torch.as_tensor(chosen, dtype=torch.float64).flatten()
    rejected = torch.as_tensor(rejected, dtype=torch.float64).flatten()
    if chosen.shape != rejected.shape or chosen.numel() == 0:
        raise ValueError(
            f"need the same non-zero number of chosen ({chosen.numel()}) and rejected "
            f"({rejected.numel()}) scores"
        )
    return chosen, rejected
