"""Selective Rehearsal: selection, per-cluster statistics, k-means, PCA and record validation.

Each check compares against an independent reference (plain Python loops in float64, brute-force
nearest centroid, scikit-learn's KMeans and PCA) on fresh random inputs with ties, empty clusters
and awkward sizes.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_rlhf.rehearsal.cluster import (
    distances_to_assigned,
    kmeans,
    kmeans_plus_plus,
    nearest_centroid,
)
from megatron_rlhf.rehearsal.records import load_scored_records
from megatron_rlhf.rehearsal.report import pca_2d
from megatron_rlhf.rehearsal.selection import per_cluster_stats, select_top_k
from megatron_rlhf.rehearsal.staging import staged_outputs
from megatron_rlhf.utils import InputError


def reference_top_k(scores, assignments, k, eligible, entropies=None):
    """Plain-Python selection: per cluster, sort the eligible records by the rank key, keep k."""
    chosen = []
    for cluster in sorted(set(assignments.tolist())):
        members = [i for i in range(len(scores)) if assignments[i] == cluster and eligible[i]]
        if entropies is None:
            members.sort(key=lambda i: (-scores[i], i))
        else:
            members.sort(key=lambda i: (entropies[i], -scores[i], i))
        chosen += members[:k]
    return chosen


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3, 17])
def test_select_top_k_matches_reference(seed, k):
    rng = np.random.default_rng(seed)
    n, clusters = int(rng.integers(50, 400)), int(rng.integers(2, 23))
    scores = np.round(rng.normal(size=n), 1)  # rounding makes ties
    assignments = rng.integers(0, clusters, size=n)
    assignments[assignments == 1] = 0  # an empty cluster id
    got = select_top_k(scores, assignments, k)
    assert got.tolist() == reference_top_k(scores, assignments, k, np.ones(n, bool))
    # The properties, checked directly.
    for cluster in range(clusters):
        members = np.flatnonzero(assignments == cluster)
        picked = got[assignments[got] == cluster]
        assert len(picked) == min(k, len(members))
        if len(picked):
            kth_best = np.sort(scores[members])[::-1][len(picked) - 1]
            assert scores[picked].min() >= kth_best


@pytest.mark.parametrize("seed", [3, 4])
def test_select_top_k_with_filters_and_entropy(seed):
    rng = np.random.default_rng(seed)
    n, clusters, k = 333, 7, 5
    scores = rng.normal(size=n)
    assignments = rng.integers(0, clusters, size=n)
    lengths = rng.integers(1, 200, size=n)
    entropies = np.round(rng.uniform(0, 3, size=n), 1)
    eligible = (scores >= -0.2) & (lengths <= 120) & (entropies <= 2.5)
    common = dict(
        min_score=-0.2,
        response_lengths=lengths,
        max_response_length=120,
        entropies=entropies,
        max_entropy=2.5,
    )
    by_score = select_top_k(scores, assignments, k, **common)
    assert by_score.tolist() == reference_top_k(scores, assignments, k, eligible)
    by_entropy = select_top_k(scores, assignments, k, rank_by="entropy", **common)
    expected = reference_top_k(scores, assignments, k, eligible, entropies)
    assert by_entropy.tolist() == expected
    for cluster in range(clusters):
        eligible_count = int((eligible & (assignments == cluster)).sum())
        assert (assignments[by_score] == cluster).sum() == min(k, eligible_count)


def test_select_top_k_rejects_bad_arguments():
    scores, assignments = np.zeros(4), np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="k must be"):
        select_top_k(scores, assignments, 0)
    with pytest.raises(ValueError, match="needs entropies"):
        select_top_k(scores, assignments, 1, rank_by="entropy")
    with pytest.raises(ValueError, match="needs response_lengths"):
        select_top_k(scores, assignments, 1, max_response_length=3)


def test_per_cluster_stats_matches_float64_loops():
    rng = np.random.default_rng(5)
    values = rng.normal(3.0, 2.0, size=1001).astype(np.float32)
    assignments = rng.integers(0, 9, size=1001)
    assignments[assignments == 4] = 5  # cluster 4 empty
    stats = per_cluster_stats(values, assignments, 10)
    for cluster in range(10):
        members = [float(v) for v, a in zip(values, assignments) if a == cluster]
        assert stats["count"][cluster] == len(members)
        if not members:
            assert math.isnan(stats["mean"][cluster]) and math.isnan(stats["std"][cluster])
            continue
        mean = math.fsum(members) / len(members)
        std = math.sqrt(math.fsum((m - mean) ** 2 for m in members) / len(members))
        assert stats["mean"][cluster] == pytest.approx(mean, rel=1e-12, abs=1e-12)
        assert stats["std"][cluster] == pytest.approx(std, rel=1e-10, abs=1e-12)


def clustered_vectors(n, dim, clusters, seed, spread=0.3):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, dim))
    labels = rng.integers(0, clusters, size=n)
    return (centers[labels] + spread * rng.normal(size=(n, dim))).astype(np.float32), labels


def test_kmeans_is_deterministic_converged_and_close_to_sklearn():
    from sklearn.cluster import KMeans

    vectors, _ = clustered_vectors(1237, 24, 9, seed=6, spread=1.5)  # overlapping groups
    first, centroids = kmeans(vectors, 9, seed=11, device="cpu")
    again, centroids_again = kmeans(vectors, 9, seed=11, device="cpu")
    assert np.array_equal(first, again) and np.array_equal(centroids, centroids_again)
    assert first.shape == (1237,) and centroids.shape == (9, 24)
    # Each assignment is the nearest centroid (brute force in float64) ...
    brute = ((vectors[:, None, :].astype(np.float64) - centroids[None]) ** 2).sum(-1).argmin(1)
    assert np.array_equal(first, brute)
    # ... and each centroid the mean of its members: a converged Lloyd fixed point.
    for cluster in range(9):
        members = vectors[first == cluster].astype(np.float64)
        np.testing.assert_allclose(centroids[cluster], members.mean(0), atol=1e-4)
    inertia = distances_to_assigned(vectors, centroids, first).sum()
    reference = KMeans(9, n_init=1, random_state=0).fit(vectors.astype(np.float64))
    assert inertia <= reference.inertia_ * 1.02


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kmeans_plus_plus_seeding_recovers_separated_groups(seed):
    from sklearn.metrics import adjusted_rand_score

    # Uniformly random starts (FAISS's default) merge some of these groups for most seeds.
    vectors, labels = clustered_vectors(999, 16, 9, seed=12 + seed, spread=0.2)
    starts = kmeans_plus_plus(vectors, 9, seed=seed)
    assert len(set(starts.tolist())) == 9
    assert np.array_equal(starts, kmeans_plus_plus(vectors, 9, seed=seed))
    assert len(set(labels[starts].tolist())) == 9  # one start in every group
    assignments, _ = kmeans(vectors, 9, seed=seed, device="cpu")
    assert adjusted_rand_score(labels, assignments) == pytest.approx(1.0)


def test_kmeans_plus_plus_on_duplicate_points():
    vectors = np.repeat(np.eye(3, dtype=np.float32), 4, axis=0)  # 3 distinct points, 12 rows
    starts = kmeans_plus_plus(vectors, 5, seed=0)
    assert len(set(starts.tolist())) == 5  # still distinct rows
    assert len({tuple(vectors[i]) for i in starts}) == 3  # all three points covered


def test_kmeans_same_result_for_any_thread_count():
    import faiss

    vectors, _ = clustered_vectors(3001, 32, 13, seed=7, spread=1.0)
    before = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(1)
        one_thread = kmeans(vectors, 13, seed=3, device="cpu")
        faiss.omp_set_num_threads(2)
        two_threads = kmeans(vectors, 13, seed=3, device="cpu")
    finally:
        faiss.omp_set_num_threads(before)
    assert np.array_equal(one_thread[0], two_threads[0])
    assert np.array_equal(one_thread[1], two_threads[1])


def test_kmeans_cluster_count_bounds():
    vectors, _ = clustered_vectors(10, 4, 2, seed=8)
    assignments, _ = kmeans(vectors, 10, seed=0, device="cpu")  # one point per cluster
    assert sorted(assignments.tolist()) == list(range(10))
    with pytest.raises(InputError, match="number of records"):
        kmeans(vectors, 11, seed=0, device="cpu")


def test_nearest_centroid_and_distances_match_brute_force():
    rng = np.random.default_rng(9)
    vectors = rng.normal(size=(1003, 17)).astype(np.float32)
    centroids = rng.normal(size=(6, 17)).astype(np.float32)
    squared = ((vectors[:, None, :].astype(np.float64) - centroids[None]) ** 2).sum(-1)
    assignments, distances = nearest_centroid(vectors, centroids, chunk=100)
    assert np.array_equal(assignments, squared.argmin(1))
    np.testing.assert_allclose(distances, squared.min(1), rtol=1e-9, atol=1e-9)
    labels = rng.integers(0, 6, size=1003)
    np.testing.assert_allclose(
        distances_to_assigned(vectors, centroids, labels, chunk=77),
        squared[np.arange(1003), labels],
        rtol=1e-9,
        atol=1e-9,
    )


def test_pca_2d_matches_sklearn_up_to_sign():
    from sklearn.decomposition import PCA

    rng = np.random.default_rng(10)
    vectors = (rng.normal(size=(301, 12)) * np.linspace(3, 0.1, 12)).astype(np.float32)
    ours = pca_2d(vectors)
    reference = PCA(2, svd_solver="full").fit_transform(vectors.astype(np.float64))
    signs = np.sign((ours * reference).sum(0))
    np.testing.assert_allclose(ours, reference * signs, rtol=1e-6, atol=1e-6)
    # Axes fitted on a subsample of 200 rows still find two well-separated dominant directions.
    spread = (rng.normal(size=(1001, 12)) * np.r_[5.0, 2.5, np.full(10, 0.5)]).astype(np.float32)
    sampled = pca_2d(spread, max_fit_rows=200)
    reference = PCA(2, svd_solver="full").fit_transform(spread.astype(np.float64))
    assert sampled.shape == (1001, 2)
    for column in range(2):
        assert abs(np.corrcoef(sampled[:, column], reference[:, column])[0, 1]) > 0.99


def write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_records_carry_extra_fields_and_dedupe_keeps_best(tmp_path):
    rows = [
        {"prompt": "a", "response": "x", "score": 1.0, "task": "t1"},
        {"prompt": "b", "response": "y", "score": 2, "entropy": 0.5},
        {"prompt": "a", "response": "z", "score": 3.0, "task": "t2"},
        {"prompt": "a", "response": "w", "score": 0.0},
    ]
    path = tmp_path / "scored.jsonl"
    write_lines(path, rows)
    with pytest.raises(InputError, match=r"scored.jsonl:3: duplicate prompt .*line 1"):
        load_scored_records(path)
    data = load_scored_records(path, dedupe=True)
    assert data.prompts == ["a", "b"] and data.line_numbers == [3, 2]
    assert data.records[0]["task"] == "t2" and data.scores.tolist() == [3.0, 2.0]
    assert sorted(data.duplicates) == [(1, 0), (4, 0)]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "p", "response": "r"}, "no 'score'"),
        ({"prompt": "p", "response": "r", "score": float("nan")}, "NaN"),
        ({"prompt": "p", "response": "r", "score": "high"}, "expected a number"),
        ({"prompt": "  ", "response": "r", "score": 1.0}, "'prompt' is missing or empty"),
        ({"response": "r", "score": 1.0}, "'prompt' is missing or empty"),
        ({"prompt": "p", "response": "", "score": 1.0}, "'response' is missing or empty"),
    ],
)
def test_records_bad_input_names_file_and_line(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    write_lines(path, [{"prompt": "ok", "response": "fine", "score": 0.0}, row])
    with pytest.raises(InputError, match=message) as error:
        load_scored_records(path)
    assert "bad.jsonl:2" in str(error.value)


def test_records_entropy_field_required_when_asked(tmp_path):
    path = tmp_path / "scored.jsonl"
    write_lines(
        path,
        [
            {"prompt": "a", "response": "x", "score": 1.0, "entropy": 0.1},
            {"prompt": "b", "response": "y", "score": 1.0},
        ],
    )
    assert load_scored_records(path).entropies is None
    with pytest.raises(InputError, match=r"scored.jsonl:2: no 'entropy' field"):
        load_scored_records(path, entropy_field="entropy")


def test_staged_outputs_all_or_nothing(tmp_path):
    (tmp_path / "out.report.json").write_text("old", encoding="utf-8")
    with pytest.raises(RuntimeError, match="boom"):
        with staged_outputs() as staging:
            staging.file(tmp_path / "out.report.json").write_text("new", encoding="utf-8")
            prefix = staging.prefix(tmp_path / "out")
            prefix.with_name(prefix.name + ".bin").write_bytes(b"1")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.report.json"]
    assert (tmp_path / "out.report.json").read_text(encoding="utf-8") == "old"
    with staged_outputs() as staging:
        staging.file(tmp_path / "out.report.json").write_text("new", encoding="utf-8")
        prefix = staging.prefix(tmp_path / "out")
        for suffix in (".bin", ".idx", "_loss_mask.bin"):
            prefix.with_name(prefix.name + suffix).write_bytes(b"1")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["out.bin", "out.idx", "out.report.json", "out_loss_mask.bin"]
