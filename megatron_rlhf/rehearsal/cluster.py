"""K-means over prompt embeddings with FAISS: on one GPU when faiss-gpu sees one, else on the CPU.

Departures from a textbook k-means, stated: FAISS runs a fixed number of Lloyd iterations
(``niter``, no tolerance-based stop) from ``k`` random points chosen with ``seed`` (not
k-means++), and splits empty clusters during training. Random starts can merge two
well-separated groups; ``redo`` restarts from other seeded points and keeps the run with the
lowest objective. FAISS would otherwise subsample ``k * 256`` training points; we
train on every point so the clusters match a full-data k-means (scikit-learn's, in the benchmark).
The same seed gives identical assignments and centroids run to run and for any OpenMP thread
count on the CPU (checked in the tests).
"""

from __future__ import annotations

import numpy as np

from megatron_rlhf.utils import InputError


def _import_faiss():
    try:
        import faiss
    except ImportError:
        raise InputError(
            "k-means needs FAISS: pip install faiss-cpu (or faiss-gpu-cu12 on a CUDA machine, "
            "never both)"
        ) from None
    return faiss


def kmeans_backend(device: str = "auto") -> str:
    """``"faiss-gpu"`` when ``device`` allows a GPU and FAISS has one, else ``"faiss-cpu"``."""
    faiss = _import_faiss()
    has_gpu = hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0
    return "faiss-gpu" if device in ("auto", "cuda") and has_gpu else "faiss-cpu"


def kmeans(
    embeddings: np.ndarray,
    clusters: int,
    seed: int = 0,
    device: str = "auto",
    niter: int = 50,
    redo: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Cluster (N, D) ``embeddings`` into ``clusters`` groups; keep the best of ``redo`` runs.

    Returns ``(assignments, centroids)``: (N,) int64 cluster id of each row (its nearest final
    centroid) and (C, D) float32 centroids.
    """
    num_points, dim = embeddings.shape
    if not 1 <= clusters <= num_points:
        raise InputError(
            f"--clusters {clusters}: must be between 1 and the number of records ({num_points})"
        )
    faiss = _import_faiss()
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)  # (N, D)
    model = faiss.Kmeans(
        dim,
        clusters,
        niter=niter,
        nredo=redo,
        seed=seed,
        gpu=1 if kmeans_backend(device) == "faiss-gpu" else False,
        max_points_per_centroid=num_points,  # never subsample
        min_points_per_centroid=1,  # small sets are fine; silences FAISS's stderr warning
        verbose=False,
    )
    model.train(vectors)
    _, nearest = model.index.search(vectors, 1)  # (N, 1)
    return nearest[:, 0].astype(np.int64), np.array(model.centroids, dtype=np.float32)


def distances_to_assigned(
    embeddings: np.ndarray, centroids: np.ndarray, assignments: np.ndarray, chunk: int = 8192
) -> np.ndarray:
    """(N,) float64 squared L2 distance of each row to its assigned centroid; sum = inertia."""
    distances = np.empty(len(embeddings), dtype=np.float64)
    for start in range(0, len(embeddings), chunk):
        block = np.asarray(embeddings[start : start + chunk], dtype=np.float64)  # (b, D)
        offset = block - centroids[assignments[start : start + chunk]]  # (b, D)
        distances[start : start + chunk] = np.einsum("bd,bd->b", offset, offset)
    return distances


def nearest_centroid(
    embeddings: np.ndarray, centroids: np.ndarray, chunk: int = 8192
) -> tuple[np.ndarray, np.ndarray]:
    """Plain-numpy nearest centroid by squared L2 distance.

    Returns ``(assignments, squared_distances)``, both (N,); places new prompts into existing
    clusters.
    """
    centroid_norms = np.einsum("cd,cd->c", centroids, centroids, dtype=np.float64)  # (C,)
    assignments = np.empty(len(embeddings), dtype=np.int64)
    distances = np.empty(len(embeddings), dtype=np.float64)
    for start in range(0, len(embeddings), chunk):
        block = np.asarray(embeddings[start : start + chunk], dtype=np.float64)  # (b, D)
        squared = (
            np.einsum("bd,bd->b", block, block)[:, None]
            - 2.0 * block @ centroids.T.astype(np.float64)
            + centroid_norms[None, :]
        )  # (b, C)
        best = squared.argmin(axis=1)
        assignments[start : start + chunk] = best
        distances[start : start + chunk] = np.maximum(squared[np.arange(len(block)), best], 0.0)
    return assignments, distances
