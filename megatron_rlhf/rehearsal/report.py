"""What a rehearsal run found: per-cluster table, a 2-D projection and a four-panel PNG.

The projection is PCA computed with numpy (eigenvectors of the D x D covariance), so it needs no
extra dependency and is deterministic.
"""

from __future__ import annotations

import os

import numpy as np

from megatron_rlhf.rehearsal.selection import per_cluster_stats

EXAMPLE_CHARS = 200
"""Example prompts in the report are cut to this many characters."""


def pca_2d(embeddings: np.ndarray, max_fit_rows: int = 10_000) -> np.ndarray:
    """(N, D) -> (N, 2): the embeddings projected on their two principal axes.

    The axes are fitted on at most ``max_fit_rows`` rows (a fixed subsample, enough for a
    picture and ~6x cheaper at the paper's 64,364 x 768), then every row is projected.
    """
    vectors = np.asarray(embeddings, dtype=np.float64)
    fit = vectors
    if len(vectors) > max_fit_rows:
        rows = np.random.default_rng(0).choice(len(vectors), max_fit_rows, replace=False)
        fit = vectors[np.sort(rows)]
    mean = fit.mean(axis=0)
    centered = fit - mean  # (M, D)
    covariance = centered.T @ centered / max(len(fit) - 1, 1)  # (D, D)
    _, eigenvectors = np.linalg.eigh(covariance)  # ascending eigenvalues
    axes = eigenvectors[:, ::-1][:, :2]  # (D, 2)
    axes = axes * np.where(axes[np.abs(axes).argmax(axis=0), [0, 1]] < 0, -1.0, 1.0)  # fix sign
    return (vectors - mean) @ axes  # (N, 2)


def cluster_table(
    prompts: list[str],
    scores: np.ndarray,
    assignments: np.ndarray,
    num_clusters: int,
    eligible: np.ndarray,
    selected: np.ndarray,
    distances: np.ndarray,
    examples_per_cluster: int = 3,
) -> list[dict]:
    """One row per cluster: size, score mean/std, eligible and selected counts, example prompts.

    ``eligible`` (N,) bool, ``selected`` (S,) record indices, ``distances`` (N,) squared distance
    of each record to its centroid; the examples are the prompts nearest the centroid.
    """
    stats = per_cluster_stats(scores, assignments, num_clusters)
    eligible_count = np.bincount(assignments[eligible], minlength=num_clusters)
    chosen = per_cluster_stats(scores[selected], assignments[selected], num_clusters)
    by_closeness = np.lexsort((distances, assignments))  # grouped by cluster, nearest first
    starts = np.searchsorted(assignments[by_closeness], np.arange(num_clusters))
    rows = []
    for cluster in range(num_clusters):
        size = int(stats["count"][cluster])
        nearest = by_closeness[starts[cluster] : starts[cluster] + min(size, examples_per_cluster)]
        rows.append(
            {
                "cluster": cluster,
                "size": size,
                "score_mean": _finite_or_none(stats["mean"][cluster]),
                "score_std": _finite_or_none(stats["std"][cluster]),
                "eligible": int(eligible_count[cluster]),
                "selected": int(chosen["count"][cluster]),
                "selected_score_mean": _finite_or_none(chosen["mean"][cluster]),
                "examples": [prompts[i][:EXAMPLE_CHARS] for i in nearest],
            }
        )
    return rows


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def plot_report(
    png_path: str | os.PathLike,
    rows: list[dict],
    projection: np.ndarray,
    assignments: np.ndarray,
    scores: np.ndarray,
    selected: np.ndarray,
    title: str,
    max_points: int = 20000,
) -> None:
    """Write the four-panel PNG: sizes, score mean/std, 2-D projection by cluster, histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clusters = np.arange(len(rows))
    figure, ((sizes_ax, scores_ax), (map_ax, hist_ax)) = plt.subplots(2, 2, figsize=(14, 10))
    sizes_ax.bar(clusters, [r["size"] for r in rows], color="lightgray", label="cluster size")
    sizes_ax.bar(clusters, [r["selected"] for r in rows], color="tab:blue", label="selected")
    sizes_ax.set(xlabel="cluster", ylabel="records", title="cluster sizes")
    sizes_ax.legend()

    means = np.array([np.nan if r["score_mean"] is None else r["score_mean"] for r in rows])
    stds = np.array([np.nan if r["score_std"] is None else r["score_std"] for r in rows])
    picked = [
        np.nan if r["selected_score_mean"] is None else r["selected_score_mean"] for r in rows
    ]
    scores_ax.errorbar(clusters, means, yerr=stds, fmt="o", ms=3, label="all: mean ± std")
    scores_ax.plot(clusters, picked, "x", color="tab:red", label="selected: mean")
    scores_ax.set(xlabel="cluster", ylabel="score", title="score per cluster")
    scores_ax.legend()

    shown = np.arange(len(projection))
    if len(shown) > max_points:  # a fixed subsample keeps the PNG quick and deterministic
        shown = np.sort(np.random.default_rng(0).choice(len(shown), max_points, replace=False))
    palette = plt.get_cmap("tab10" if len(rows) <= 10 else "tab20")
    colours = palette(assignments[shown] % palette.N)  # (n, 4) RGBA, one colour per cluster id
    map_ax.scatter(*projection[shown].T, c=colours, s=4, alpha=0.6)
    map_ax.scatter(*projection[selected].T, marker="x", s=12, c="black", label="selected")
    map_ax.set(xlabel="PC 1", ylabel="PC 2", title="prompt embeddings (PCA), colour = cluster")
    map_ax.legend()

    bins = np.histogram_bin_edges(scores, bins=40)
    hist_ax.hist(scores, bins=bins, color="lightgray", label="all responses")
    hist_ax.hist(scores[selected], bins=bins, color="tab:blue", label="selected (D_R)")
    hist_ax.set(xlabel="score", ylabel="records", title="score distribution")
    hist_ax.legend()

    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(png_path, format="png", dpi=90)
    plt.close(figure)
