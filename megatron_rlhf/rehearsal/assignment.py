"""Reuse a rehearsal run's clusters elsewhere, e.g. PPO logging reward statistics per cluster.

``load_cluster_assignment(OUT)`` reads ``OUT.report.json``, ``OUT.clusters.jsonl`` and
``OUT.centroids.npy``. A PPO prompt maps to its cluster by exact text (the prompt set the
clusters were built on), by its index in that set, or, for a prompt never seen, by the nearest
centroid after embedding it with the same model (named in the report; loaded once per
process). PPO holding prompt token ids decodes them first: byte-level BPE tokenizers (BLOOM's,
the tiny test one) give back the exact text.

    assignment = load_cluster_assignment("data/rehearsal")
    cluster_ids = assignment.clusters_of_prompts(batch_prompts)      # (B,)
    stats = per_cluster_stats(rewards, cluster_ids, assignment.num_clusters)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rlhf.rehearsal.cluster import nearest_centroid
from megatron_rlhf.utils import InputError, read_jsonl


@dataclass(kw_only=True)
class ClusterAssignment:
    """The k-means clusters of a prompt set, as written by ``build_rehearsal_clusters``."""

    centroids: np.ndarray
    """(C, D) float32 k-means centroids in the embedding space."""
    record_clusters: np.ndarray
    """(N,) int64 cluster of each input line, in input order (duplicates included)."""
    prompt_clusters: dict[str, int]
    """Cluster of every prompt text the clusters were built on."""
    embedding_model: str
    """Directory of the sentence-transformers model that produced the embeddings."""
    normalize: bool
    """Whether embeddings were L2-normalised before clustering."""

    @property
    def num_clusters(self) -> int:
        return len(self.centroids)

    def cluster_of_index(self, index: int) -> int:
        """Cluster of the ``index``-th (0-based) record of the input file."""
        return int(self.record_clusters[index])

    def cluster_of_prompt(self, prompt: str) -> int:
        """Cluster of a prompt from the clustered set; ``KeyError`` if it was not in it."""
        if prompt not in self.prompt_clusters:
            raise KeyError(f"prompt not in the clustered set (embed it): {prompt[:80]!r}")
        return self.prompt_clusters[prompt]

    def clusters_of_prompts(
        self, prompts: list[str], device: str = "cpu", batch_size: int = 64
    ) -> np.ndarray:
        """(B,) int64 cluster of each prompt; unseen prompts go to their nearest centroid."""
        clusters = np.array([self.prompt_clusters.get(p, -1) for p in prompts], dtype=np.int64)
        unseen = np.flatnonzero(clusters < 0)
        if len(unseen):
            from megatron_rlhf.rehearsal.embed import embed_prompts

            embeddings = embed_prompts(
                [prompts[i] for i in unseen],
                self.embedding_model,
                device=device,
                batch_size=batch_size,
                normalize=self.normalize,
                show_progress=False,
            )  # (U, D)
            clusters[unseen] = nearest_centroid(embeddings, self.centroids)[0]
        return clusters


def load_cluster_assignment(prefix: str | os.PathLike) -> ClusterAssignment:
    """Load the clusters written under output prefix ``prefix`` (``OUT`` of the tool)."""
    prefix = Path(prefix)
    report_path = Path(f"{prefix}.report.json")
    if not report_path.exists():
        raise InputError(
            f"{report_path}: not found; run tools/build_rehearsal_clusters.py with "
            f"--output-prefix {prefix} first"
        )
    report = json.loads(report_path.read_text(encoding="utf-8"))
    centroids = np.load(report_path.parent / report["files"]["centroids"])  # (C, D)
    record_clusters, prompt_clusters = [], {}
    for _, row in read_jsonl(report_path.parent / report["files"]["clusters"]):
        record_clusters.append(row["cluster"])
        prompt_clusters[row["prompt"]] = row["cluster"]
    return ClusterAssignment(
        centroids=centroids,
        record_clusters=np.asarray(record_clusters, dtype=np.int64),
        prompt_clusters=prompt_clusters,
        embedding_model=report["embedding"]["model"],
        normalize=report["embedding"]["normalize"],
    )
