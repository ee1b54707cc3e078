"""The files of a rehearsal set: D_R as an indexed SFT dataset, the selected records, every
line's cluster, the centroids, the report and, for a sweep, its comparison table; and the check
that refuses an earlier run's outputs before any work."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from megatron_rlhf.data import write_sft_dataset
from megatron_rlhf.rehearsal.config import RehearsalConfig
from megatron_rlhf.rehearsal.records import ScoredRecords, response_finished
from megatron_rlhf.rehearsal.report import plot_report
from megatron_rlhf.rehearsal.staging import StagedOutputs
from megatron_rlhf.utils import check_output_prefix

# Files at every output prefix (OUT, or OUT_cN in a sweep) whose presence marks an earlier run.
PREFIX_OUTPUTS = (".json", ".selected.jsonl", ".clusters.jsonl", ".report.json", ".report.png")


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _write_rehearsal_dataset(prefix: Path, records: list[dict], tokenizer, metadata: dict):
    """D_R as an SFT dataset: prompt ids + response ids, loss on the response; an EOS ends
    every response that ended on its own, none ends one cut at the generation limit.

    Prompt and response are tokenized separately without special tokens, as the data layer's
    preprocessing and PPO's rollouts (prompt ids followed by generated ids) do.
    """
    eos = tokenizer.eos_token_id
    finished = response_finished(records, eos)
    prompt_ids = token_ids(tokenizer, [record["prompt"] for record in records])
    response_ids = [
        ids + [eos] if done and (not ids or ids[-1] != eos) else ids
        for ids, done in zip(
            token_ids(tokenizer, [record["response"] for record in records]), finished
        )
    ]
    write_sft_dataset(
        prefix,
        zip(prompt_ids, response_ids),
        metadata["tokenizer"],
        eos_id=eos,
        append_eos=False,
        metadata={**metadata, "truncated_without_eos": int((~finished).sum())},
    )


def write_outputs(
    staging: StagedOutputs,
    prefix: Path,
    config: RehearsalConfig,
    data: ScoredRecords,
    result: dict,
    projection: np.ndarray,
    tokenizer,
    run_info: dict,
) -> None:
    """Stage every output file of one cluster count under ``prefix``."""
    assignments, selected = result["assignments"], result["selected"]
    order = np.random.default_rng(config.seed).permutation(len(selected))
    shuffled = selected[order]  # D_R document i is record shuffled[i]
    rank = np.empty(len(data), dtype=np.int64)  # rank of each selected record in its cluster
    rank[selected] = np.arange(len(selected)) - np.searchsorted(
        assignments[selected], assignments[selected]
    )
    chosen = [
        {
            **data.records[i],
            "cluster": int(assignments[i]),
            "cluster_rank": int(rank[i]),
            "input_line": data.line_numbers[i],
        }
        for i in shuffled
    ]
    dataset_metadata = {
        "source": "selective rehearsal (D_R)",
        "tokenizer": str(Path(config.tokenizer).resolve()),
        "report": f"{prefix.name}.report.json",
        "selected": f"{prefix.name}.selected.jsonl",
        "clusters": result["clusters"],
        "top_k": config.top_k,
        "seed": config.seed,
    }
    _write_rehearsal_dataset(staging.prefix(prefix), chosen, tokenizer, dataset_metadata)
    _write_lines(staging.file(f"{prefix}.selected.jsonl"), chosen)
    _write_lines(staging.file(f"{prefix}.clusters.jsonl"), _cluster_rows(data, assignments))
    with open(staging.file(f"{prefix}.centroids.npy"), "wb") as handle:
        np.save(handle, result["centroids"])
    name = prefix.name
    report = {
        "config": {**asdict(config), "clusters": result["clusters"]},
        **run_info,
        **result["summary"],
        "files": {
            "dataset": name,
            "selected": f"{name}.selected.jsonl",
            "clusters": f"{name}.clusters.jsonl",
            "centroids": f"{name}.centroids.npy",
            "png": f"{name}.report.png",
        },
        "per_cluster": result["rows"],
    }
    staging_report = staging.file(f"{prefix}.report.json")
    staging_report.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", "utf-8")
    title = (
        f"{Path(config.input).name}: {len(data)} prompts, c={result['clusters']}, "
        f"k={config.top_k}, |D_R|={len(selected)}"
    )
    plot_report(
        staging.file(f"{prefix}.report.png"),
        result["rows"],
        projection,
        assignments,
        data.scores,
        selected,
        title,
    )


def _cluster_rows(data: ScoredRecords, assignments: np.ndarray) -> list[dict]:
    """One row per input line in input order; a dropped duplicate gets its kept twin's cluster."""
    rows = [
        {"line": line, "cluster": int(assignments[i]), "prompt": data.records[i]["prompt"]}
        for i, line in enumerate(data.line_numbers)
    ]
    for line, kept in data.duplicates:
        rows.append(
            {
                "line": line,
                "cluster": int(assignments[kept]),
                "prompt": data.records[kept]["prompt"],
                "duplicate_of_line": data.line_numbers[kept],
            }
        )
    return sorted(rows, key=lambda row: row["line"])


def _write_lines(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def sweep_markdown(summaries: list[dict], top_k: int) -> str:
    """The sweep comparison as a Markdown table, one row per cluster count."""
    lines = [
        f"| clusters c | selected (k={top_k}) | short of k | mean size | min size | max size "
        "| inertia | mean score selected | mean score all | k-means s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        picked = "-" if s["score_mean_selected"] is None else f"{s['score_mean_selected']:.4f}"
        lines.append(
            f"| {s['clusters']} | {s['selected']} | {s['clusters_short_of_k']} "
            f"| {s['cluster_size_mean']:.1f} | {s['cluster_size_min']} | {s['cluster_size_max']} "
            f"| {s['inertia']:.2f} | {picked} | {s['score_mean_all']:.4f} | {s['kmeans_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def check_outputs(config: RehearsalConfig) -> None:
    """Refuse an earlier run's outputs (unless ``overwrite``) before any work."""
    from megatron_rlhf.runtime import locks

    prefix = Path(config.output_prefix)
    if len(config.clusters) == 1:
        check_output_prefix(prefix, PREFIX_OUTPUTS, config.overwrite, "--output-prefix")
        locks.lock_output(prefix, "--output-prefix")
        return
    check_output_prefix(prefix, (".sweep.md", ".sweep.json"), config.overwrite, "--output-prefix")
    for clusters in config.clusters:
        swept = prefix.with_name(f"{prefix.name}_c{clusters}")
        check_output_prefix(swept, PREFIX_OUTPUTS, config.overwrite, "--output-prefix")
    locks.lock_output(prefix, "--output-prefix")
