"""Selective Rehearsal curation (paper §3.2): which (prompt, SFT response) pairs PPO rehearses.

Pipeline: ``embed_prompts`` (sentence-transformers) -> ``kmeans`` (FAISS, GPU when present) ->
``select_top_k`` per cluster -> D_R written as an indexed SFT dataset by ``build.run``.
PPO reuses the clusters through ``load_cluster_assignment`` and ``per_cluster_stats``.
"""

from megatron_rlhf.rehearsal.assignment import ClusterAssignment, load_cluster_assignment
from megatron_rlhf.rehearsal.cluster import kmeans, nearest_centroid
from megatron_rlhf.rehearsal.embed import embed_prompts
from megatron_rlhf.rehearsal.records import ScoredRecords, load_scored_records
from megatron_rlhf.rehearsal.selection import eligible_mask, per_cluster_stats, select_top_k

__all__ = [
    "ClusterAssignment",
    "ScoredRecords",
    "eligible_mask",
    "embed_prompts",
    "kmeans",
    "load_cluster_assignment",
    "load_scored_records",
    "nearest_centroid",
    "per_cluster_stats",
    "select_top_k",
]
