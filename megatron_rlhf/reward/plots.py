"""The paper's reward-model figures as PNGs: Fig. 2 (calibration), Fig. 3 (score histograms),
Fig. 4 (per-task mean and std).

Each function takes one entry per scoring model (label -> data), so RM and AM can share a
figure as in the paper. Figures are drawn on matplotlib's Agg canvas without pyplot (no global
state, no display) and written atomically.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from megatron_rlhf.utils import atomic_output


def plot_calibration(path: str | os.PathLike, curves: Mapping[str, Sequence[dict]]) -> None:
    """Fig. 2: accuracy against score difference per model, with the calibrated curve σ(Δ).

    curves: label -> :func:`megatron_rlhf.reward.calibration.reliability_curve` output.
    """
    fig, ax = _figure(1, 1, (5.0, 4.0))
    top = max(row["delta_hi"] for curve in curves.values() for row in curve)
    delta = np.linspace(0.0, top, 200)
    ax.plot(delta, 1.0 / (1.0 + np.exp(-delta)), "k--", label="calibrated σ(Δ)")
    for label, curve in curves.items():
        ax.plot(
            [row["delta_mean"] for row in curve],
            [row["accuracy"] for row in curve],
            marker="o",
            label=label,
        )
    ax.set_xlabel("score difference Δ = |s_chosen − s_rejected|")
    ax.set_ylabel("ranking accuracy")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def plot_score_histograms(
    path: str | os.PathLike, scores: Mapping[str, tuple[Sequence[float], Sequence[float]]]
) -> None:
    """Fig. 3: histograms of chosen and rejected scores, one panel per model.

    scores: label -> (chosen scores, rejected scores).
    """
    fig, axes = _figure(1, len(scores), (4.5 * len(scores), 3.6))
    for ax, (label, (chosen, rejected)) in zip(np.atleast_1d(axes), scores.items()):
        edges = np.histogram_bin_edges(np.concatenate([chosen, rejected]), bins=40)
        ax.hist(chosen, bins=edges, alpha=0.6, color="tab:green", label="chosen")
        ax.hist(rejected, bins=edges, alpha=0.6, color="tab:red", label="rejected")
        ax.set_title(label)
        ax.set_xlabel("score")
        ax.set_ylabel("responses")
        ax.legend()
    _save(fig, path)


def plot_task_stats(path: str | os.PathLike, stats: Mapping[str, Mapping[str, dict]]) -> None:
    """Fig. 4: per-task score mean (left) and std (right), one bar per model and task.

    stats: label -> :func:`megatron_rlhf.reward.calibration.per_task_stats` output.
    """
    tasks = sorted({task for per_task in stats.values() for task in per_task})
    fig, (ax_mean, ax_std) = _figure(1, 2, (max(8.0, 0.5 * len(tasks) * len(stats) + 4), 3.8))
    positions = np.arange(len(tasks))
    width = 0.8 / len(stats)
    for i, (label, per_task) in enumerate(stats.items()):
        offset = positions - 0.4 + width * (i + 0.5)
        for ax, key in ((ax_mean, "mean"), (ax_std, "std")):
            values = [per_task[t][key] if t in per_task else np.nan for t in tasks]
            ax.bar(offset, values, width=width, label=label)
    for ax, title in ((ax_mean, "mean score per task"), (ax_std, "score std per task")):
        ax.set_xticks(positions, tasks, rotation=45 if len(tasks) > 6 else 0, ha="right")
        ax.set_title(title)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    _save(fig, path)


def _figure(rows: int, cols: int, size: tuple[float, float]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="tight")
    return fig, fig.subplots(rows, cols)


def _save(fig, path: str | os.PathLike) -> None:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
