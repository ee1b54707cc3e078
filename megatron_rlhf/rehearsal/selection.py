"""Pick the rehearsal records of every cluster (paper §3.2, the data of Eq. 9's D_R).

Pure numpy: arrays in, indices out. The paper keeps, in each of the c clusters, the top-k
(x, y) pairs by advantage score, and names other criteria: entropy (low = confident), response
length (long may be redundant), a score threshold. Here candidates are *filtered* first
(``min_score``, ``max_response_length``, ``max_entropy``), then *ranked* inside each cluster:
``rank_by="score"`` (the paper) takes the highest scores, ``rank_by="entropy"`` the lowest mean
token entropy (ties broken by the higher score). Remaining ties go to the earlier record, so the
selection is a deterministic function of its inputs. Each cluster contributes
``min(k, eligible records)``; without filters, ``min(k, cluster size)``.
"""

from __future__ import annotations

import numpy as np


def eligible_mask(
    scores: np.ndarray,
    *,
    min_score: float | None = None,
    response_lengths: np.ndarray | None = None,
    max_response_length: int | None = None,
    entropies: np.ndarray | None = None,
    max_entropy: float | None = None,
    finished: np.ndarray | None = None,
) -> np.ndarray:
    """(N,) bool: the records that pass every filter that is set (``finished``: (N,) bool,
    False for a response cut at the generation limit, which is then not eligible)."""
    mask = np.ones(len(scores), dtype=bool)
    if min_score is not None:
        mask &= scores >= min_score
    if max_response_length is not None:
        if response_lengths is None:
            raise ValueError("max_response_length needs response_lengths")
        mask &= response_lengths <= max_response_length
    if max_entropy is not None:
        if entropies is None:
            raise ValueError("max_entropy needs entropies")
        mask &= entropies <= max_entropy
    if finished is not None:
        mask &= finished
    return mask


def select_top_k(
    scores: np.ndarray,
    assignments: np.ndarray,
    k: int,
    *,
    min_score: float | None = None,
    response_lengths: np.ndarray | None = None,
    max_response_length: int | None = None,
    entropies: np.ndarray | None = None,
    max_entropy: float | None = None,
    finished: np.ndarray | None = None,
    rank_by: str = "score",
) -> np.ndarray:
    """Indices of the selected records, ordered by (cluster, rank inside the cluster).

    ``scores`` (N,), ``assignments`` (N,) cluster ids, ``response_lengths`` (N,),
    ``entropies`` (N,) and ``finished`` (N,) optional. At most ``k`` indices per cluster.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if rank_by not in ("score", "entropy"):
        raise ValueError(f"rank_by must be 'score' or 'entropy', got {rank_by!r}")
    if rank_by == "entropy" and entropies is None:
        raise ValueError("rank_by='entropy' needs entropies")
    mask = eligible_mask(
        scores,
        min_score=min_score,
        response_lengths=response_lengths,
        max_response_length=max_response_length,
        entropies=entropies,
        max_entropy=max_entropy,
        finished=finished,
    )
    candidates = np.flatnonzero(mask)  # (M,) ascending record index
    # np.lexsort sorts by the last key first; the earlier index wins remaining ties (stable).
    keys = [-scores[candidates], assignments[candidates]]
    if rank_by == "entropy":
        keys.insert(1, entropies[candidates])
    ordered = candidates[np.lexsort(keys)]  # grouped by cluster, best first
    cluster_of = assignments[ordered]
    starts = np.r_[0, np.flatnonzero(np.diff(cluster_of)) + 1]  # first position of each group
    group_lengths = np.diff(np.r_[starts, len(ordered)])
    rank_in_cluster = np.arange(len(ordered)) - np.repeat(starts, group_lengths)
    return ordered[rank_in_cluster < k]


def per_cluster_stats(values: np.ndarray, assignments: np.ndarray, num_clusters: int) -> dict:
    """Count, mean and (population) std of ``values`` per cluster; NaN where a cluster is empty.

    Returns ``{"count": (C,) int64, "mean": (C,) float64, "std": (C,) float64}``. PPO uses this
    to report reward statistics per cluster of its prompts.
    """
    values = np.asarray(values, dtype=np.float64)
    count = np.bincount(assignments, minlength=num_clusters)
    total = np.bincount(assignments, weights=values, minlength=num_clusters)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
        centered = values - mean[assignments]
        variance = np.bincount(assignments, weights=centered * centered, minlength=num_clusters)
        std = np.sqrt(variance / count)
    return {"count": count.astype(np.int64), "mean": mean, "std": std}
