"""Build the rehearsal set D_R (paper §3.2): embed prompts, k-means, top-k per cluster, write.

The command line and what it writes: ``cli.py``; the settings: ``config.py``; the files:
``outputs.py``. :func:`run` embeds the prompts once, then clusters, selects and writes every
cluster count (:func:`curate_one`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from megatron_rlhf.data import load_tokenizer
from megatron_rlhf.rehearsal.cluster import distances_to_assigned, kmeans, kmeans_backend
from megatron_rlhf.rehearsal.config import RehearsalConfig
from megatron_rlhf.rehearsal.embed import check_model_dir, embed_prompts, resolve_device
from megatron_rlhf.rehearsal.outputs import check_outputs, sweep_markdown, token_ids, write_outputs
from megatron_rlhf.rehearsal.records import ScoredRecords, load_scored_records, response_finished
from megatron_rlhf.rehearsal.report import cluster_table, pca_2d
from megatron_rlhf.rehearsal.selection import eligible_mask, select_top_k
from megatron_rlhf.rehearsal.staging import staged_outputs
from megatron_rlhf.utils import InputError


def curate_one(
    config: RehearsalConfig,
    data: ScoredRecords,
    embeddings: np.ndarray,
    response_tokens: np.ndarray | None,
    finished: np.ndarray,
    clusters: int,
) -> dict:
    """K-means into ``clusters`` and select; return the arrays and report of this count.
    ``finished`` (N,) bool: False for responses cut at the generation limit."""
    started = time.perf_counter()
    assignments, centroids = kmeans(embeddings, clusters, config.seed, config.device, config.niter)
    kmeans_s = time.perf_counter() - started
    started = time.perf_counter()
    filters = dict(
        min_score=config.min_score,
        response_lengths=response_tokens,
        max_response_length=config.max_response_tokens,
        entropies=data.entropies,
        max_entropy=config.max_entropy,
        finished=finished if config.truncated == "drop" else None,
    )
    selected = select_top_k(
        data.scores, assignments, config.top_k, rank_by=config.rank_by, **filters
    )
    select_s = time.perf_counter() - started
    eligible = eligible_mask(data.scores, **filters)
    distances = distances_to_assigned(embeddings, centroids, assignments)
    rows = cluster_table(
        data.prompts, data.scores, assignments, clusters, eligible, selected, distances
    )
    short = [row["cluster"] for row in rows if row["eligible"] < config.top_k]
    return {
        "clusters": clusters,
        "assignments": assignments,
        "centroids": centroids,
        "selected": selected,
        "rows": rows,
        "summary": {
            "clusters": clusters,
            "eligible": int(eligible.sum()),
            "selected": int(len(selected)),
            "clusters_short_of_k": len(short),
            "short_clusters": short,
            "cluster_size_mean": float(np.mean([row["size"] for row in rows])),
            "cluster_size_min": int(min(row["size"] for row in rows)),
            "cluster_size_max": int(max(row["size"] for row in rows)),
            "inertia": float(distances.sum()),
            "truncated_responses": int((~finished).sum()),
            "truncated_selected": int((~finished[selected]).sum()),
            "truncated_policy": config.truncated,
            "score_mean_all": float(data.scores.mean()),
            "score_mean_selected": float(data.scores[selected].mean()) if len(selected) else None,
            "kmeans_s": kmeans_s,
            "select_s": select_s,
        },
    }


def run(config: RehearsalConfig) -> list[dict]:
    """Validate, embed once, then cluster/select/write every count; return their summaries."""
    check_outputs(config)
    check_model_dir(config.embedding_model)
    embed_device = resolve_device(config.device)
    needs_entropy = config.rank_by == "entropy" or config.max_entropy is not None
    data = load_scored_records(
        config.input,
        dedupe=config.dedupe,
        entropy_field=config.entropy_field if needs_entropy else None,
    )
    too_many = [c for c in config.clusters if c > len(data)]
    if too_many:
        raise InputError(
            f"{config.input}: {len(data)} records cannot form {max(too_many)} clusters; "
            f"use at most {len(data)}"
        )
    tokenizer = load_tokenizer(config.tokenizer)
    finished = response_finished(data.records, tokenizer.eos_token_id)
    response_tokens = None
    if config.max_response_tokens is not None:
        response_tokens = np.array([len(ids) for ids in token_ids(tokenizer, data.responses)])

    started = time.perf_counter()
    embeddings = embed_prompts(
        data.prompts, config.embedding_model, embed_device, config.batch_size, config.normalize
    )  # (N, D)
    run_info = {
        "records": len(data),
        "duplicates_dropped": len(data.duplicates),
        "embedding": {
            "model": str(check_model_dir(config.embedding_model)),
            "dim": int(embeddings.shape[1]),
            "normalize": config.normalize,
            "device": embed_device,
            "seconds": time.perf_counter() - started,
        },
        "kmeans_backend": kmeans_backend(config.device),
    }
    projection = pca_2d(embeddings)  # (N, 2)
    output_prefix = Path(config.output_prefix)
    sweep = len(config.clusters) > 1
    summaries = []
    with staged_outputs() as staging:
        for clusters in config.clusters:
            result = curate_one(config, data, embeddings, response_tokens, finished, clusters)
            if not len(result["selected"]):
                raise InputError(
                    f"{config.input}: no record passes the filters (--min-score, "
                    "--max-response-tokens, --max-entropy, --truncated drop); loosen them"
                )
            prefix = output_prefix
            if sweep:
                prefix = output_prefix.with_name(f"{output_prefix.name}_c{clusters}")
            write_outputs(staging, prefix, config, data, result, projection, tokenizer, run_info)
            summaries.append(
                {
                    **result["summary"],
                    "records": len(data),
                    "embed_s": run_info["embedding"]["seconds"],
                    "output_prefix": str(prefix),
                }
            )
            if result["summary"]["clusters_short_of_k"]:
                print(
                    f"warning: c={clusters}: {result['summary']['clusters_short_of_k']} clusters "
                    f"have fewer than k={config.top_k} eligible records and contribute all they "
                    f"have (listed in {prefix}.report.json, short_clusters)",
                    file=sys.stderr,
                )
        if sweep:
            staging.file(f"{output_prefix}.sweep.md").write_text(
                sweep_markdown(summaries, config.top_k), "utf-8"
            )
            sweep_json = {"config": asdict(config), **run_info, "sweep": summaries}
            staging.file(f"{output_prefix}.sweep.json").write_text(
                json.dumps(sweep_json, indent=2, allow_nan=False) + "\n", "utf-8"
            )
    return summaries
