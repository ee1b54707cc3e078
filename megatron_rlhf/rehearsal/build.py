"""Build the rehearsal set D_R (paper §3.2): embed prompts, k-means, top-k per cluster, write.

Usage (``tools/build_rehearsal_clusters.py`` calls ``main``)::

    python tools/build_rehearsal_clusters.py --input scored.jsonl --embedding-model DIR \\
        --tokenizer POLICY_TOKENIZER_DIR --clusters C --top-k K --output-prefix OUT

Writes, all or nothing:
  OUT.bin/.idx (+ OUT_loss_mask.*, OUT.json)  D_R as an indexed SFT dataset, shuffled with --seed
  OUT.selected.jsonl   the chosen records (document i of OUT = line i) + cluster, rank, input line
  OUT.clusters.jsonl   the cluster of every input line, in input order (PPO reuses it)
  OUT.centroids.npy    (C, D) centroids, to place unseen prompts by nearest centroid
  OUT.report.json/.png per-cluster sizes, score mean/std, examples; a 2-D projection

``--sweep-clusters 10,20,50`` writes one such set per count under ``OUT_c10`` ... (embedding the
prompts once) and compares them in ``OUT.sweep.md`` and ``OUT.sweep.json`` (paper Fig. 6).
``--max-response-tokens`` counts tokens of ``--tokenizer`` (the policy's), response only.
A response cut at the generation limit (``finished: false`` from ``generate``, or token ids not
ending in EOS) enters D_R without an EOS (``--truncated drop``: not at all); both are counted.
Selection rules: ``selection.py``. Bad records (no/NaN score, empty prompt, duplicate prompt
unless ``--dedupe``) stop the run before any work, naming file:line (``records.py``); so do
more clusters than records and a missing model directory. A cluster with fewer than k eligible
records is not an error: it gives all it has, with a warning and a count in the report.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megatron_rlhf.data import load_tokenizer, write_sft_dataset
from megatron_rlhf.rehearsal.cluster import distances_to_assigned, kmeans, kmeans_backend
from megatron_rlhf.rehearsal.embed import check_model_dir, embed_prompts, resolve_device
from megatron_rlhf.rehearsal.records import (
    ScoredRecords,
    load_scored_records,
    response_finished,
)
from megatron_rlhf.rehearsal.report import cluster_table, pca_2d, plot_report
from megatron_rlhf.rehearsal.selection import eligible_mask, select_top_k
from megatron_rlhf.rehearsal.staging import StagedOutputs, staged_outputs
from megatron_rlhf.utils import InputError, check_output_prefix, print_summary, run_command

COMMAND = "build_rehearsal_clusters"


@dataclass(kw_only=True)
class RehearsalConfig:
    """Everything one curation run depends on; written into every report."""

    input: str
    """Scored JSONL: one {"prompt", "response", "score"} per line (extra fields carried)."""
    embedding_model: str
    """Local sentence-transformers model directory (paper: SimCSE roberta-base)."""
    tokenizer: str
    """The policy's Hugging Face tokenizer directory, used to write D_R."""
    output_prefix: str
    """OUT: the prefix every output file name starts with."""
    clusters: list[int]
    """Cluster counts c; more than one is a sweep (one rehearsal set per count)."""
    top_k: int
    """k: records kept per cluster."""
    seed: int = 0
    """Seeds k-means initialisation and the shuffle of D_R."""
    device: str = "auto"
    """auto | cpu | cuda: for embeddings and (with faiss-gpu) k-means."""
    batch_size: int = 64
    """Prompts per embedding batch."""
    niter: int = 50
    """K-means (Lloyd) iterations."""
    normalize: bool = True
    """L2-normalise embeddings (cosine geometry) before k-means."""
    min_score: float | None = None
    """Filter: drop candidates scored below this."""
    max_response_tokens: int | None = None
    """Filter: drop candidates whose response is longer (policy-tokenizer tokens)."""
    max_entropy: float | None = None
    """Filter: drop candidates whose mean token entropy is higher (needs entropy_field)."""
    rank_by: str = "score"
    """score: highest score first (the paper) | entropy: lowest mean token entropy first."""
    entropy_field: str = "entropy"
    """Record field holding the response's mean token entropy."""
    dedupe: bool = False
    """Keep the highest-scored record of duplicate prompts instead of failing."""
    overwrite: bool = False
    """Replace the outputs of an earlier run at ``output_prefix`` (else an existing one stops
    the run before any work)."""
    truncated: str = "no_eos"
    """Responses cut at the generation limit (no EOS; see records.response_finished): no_eos
    keeps them in D_R without an EOS, so rehearsal never teaches stopping where the limit cut;
    drop makes them ineligible for selection. Counted in the report either way."""


# Files at every output prefix (OUT, or OUT_cN in a sweep) whose presence marks an earlier run.
PREFIX_OUTPUTS = (".json", ".selected.jsonl", ".clusters.jsonl", ".report.json", ".report.png")


def _parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers, got {text!r}")
    return counts


def parse_args(argv: list[str]) -> RehearsalConfig:
    parser = argparse.ArgumentParser(
        prog="tools/build_rehearsal_clusters.py",
        description="Selective Rehearsal curation: top-k responses per prompt cluster -> D_R.",
    )
    parser.add_argument("--input", required=True, help="scored JSONL (prompt, response, score)")
    parser.add_argument("--embedding-model", required=True, help="sentence-transformers dir")
    parser.add_argument("--tokenizer", required=True, help="the policy's HF tokenizer dir")
    parser.add_argument("--output-prefix", required=True, help="OUT: prefix of every output")
    counts = parser.add_mutually_exclusive_group(required=True)
    counts.add_argument("--clusters", type=int, help="number of k-means clusters c")
    counts.add_argument("--sweep-clusters", type=_parse_counts, help="e.g. 10,20,50")
    parser.add_argument("--top-k", type=int, required=True, help="records kept per cluster")
    parser.add_argument("--seed", type=int, default=0, help="k-means seeding and D_R shuffle")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="embeddings, and k-means when faiss-gpu is installed",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="embedding batch size")
    parser.add_argument("--niter", type=int, default=50, help="k-means iterations")
    parser.add_argument(
        "--no-normalize",
        dest="normalize",
        action="store_false",
        help="cluster raw embeddings instead of L2-normalised ones",
    )
    parser.add_argument("--min-score", type=float, help="filter: minimum score")
    parser.add_argument("--max-response-tokens", type=int, help="filter: max response tokens")
    parser.add_argument("--max-entropy", type=float, help="filter: max mean token entropy")
    parser.add_argument(
        "--rank-by",
        choices=["score", "entropy"],
        default="score",
        help="inside a cluster: highest score (paper) or lowest mean token entropy",
    )
    parser.add_argument("--entropy-field", default="entropy", help="record field for entropy")
    parser.add_argument("--dedupe", action="store_true", help="keep best of duplicate prompts")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier run's outputs")
    parser.add_argument(
        "--truncated",
        choices=["no_eos", "drop"],
        default="no_eos",
        help="responses cut at the generation limit: keep without EOS (default) or drop",
    )
    args = parser.parse_args(argv)
    for flag, value in (
        ("--top-k", args.top_k),
        ("--clusters", args.clusters),
        ("--batch-size", args.batch_size),
        ("--niter", args.niter),
        ("--max-response-tokens", args.max_response_tokens),
    ):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--min-score", args.min_score), ("--max-entropy", args.max_entropy)):
        if value is not None and not math.isfinite(value):
            parser.error(f"{flag} must be a finite number, got {value}")
    return RehearsalConfig(
        input=args.input,
        embedding_model=args.embedding_model,
        tokenizer=args.tokenizer,
        output_prefix=args.output_prefix,
        clusters=args.sweep_clusters or [args.clusters],
        top_k=args.top_k,
        seed=args.seed,
        device=args.device,
        batch_size=args.batch_size,
        niter=args.niter,
        normalize=args.normalize,
        min_score=args.min_score,
        max_response_tokens=args.max_response_tokens,
        max_entropy=args.max_entropy,
        rank_by=args.rank_by,
        entropy_field=args.entropy_field,
        dedupe=args.dedupe,
        overwrite=args.overwrite,
        truncated=args.truncated,
    )


def _token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _write_rehearsal_dataset(prefix: Path, records: list[dict], tokenizer, metadata: dict):
    """D_R as an SFT dataset: prompt ids + response ids, loss on the response; an EOS ends
    every response that ended on its own, none ends one cut at the generation limit.

    Prompt and response are tokenized separately without special tokens, as the data layer's
    preprocessing and PPO's rollouts (prompt ids followed by generated ids) do.
    """
    eos = tokenizer.eos_token_id
    finished = response_finished(records, eos)
    prompt_ids = _token_ids(tokenizer, [record["prompt"] for record in records])
    response_ids = [
        ids + [eos] if done and (not ids or ids[-1] != eos) else ids
        for ids, done in zip(
            _token_ids(tokenizer, [record["response"] for record in records]), finished
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
        response_tokens = np.array([len(ids) for ids in _token_ids(tokenizer, data.responses)])

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


def check_outputs(config: RehearsalConfig) -> None:
    """Refuse an earlier run's outputs (unless ``overwrite``) before any work."""
    from megatron_rlhf.training import run_lock

    prefix = Path(config.output_prefix)
    if len(config.clusters) == 1:
        check_output_prefix(prefix, PREFIX_OUTPUTS, config.overwrite, "--output-prefix")
        run_lock.lock_output(prefix, "--output-prefix")
        return
    check_output_prefix(prefix, (".sweep.md", ".sweep.json"), config.overwrite, "--output-prefix")
    for clusters in config.clusters:
        swept = prefix.with_name(f"{prefix.name}_c{clusters}")
        check_output_prefix(swept, PREFIX_OUTPUTS, config.overwrite, "--output-prefix")
    run_lock.lock_output(prefix, "--output-prefix")


def main(argv: list[str] | None = None) -> int:
    config = parse_args(list(sys.argv[1:] if argv is None else argv))
    summaries = []
    rc = run_command(COMMAND, lambda: summaries.extend(run(config)) or 0)
    if rc:
        return rc
    last = summaries[-1]
    print_summary(
        COMMAND,
        records=last["records"],
        clusters=",".join(str(s["clusters"]) for s in summaries),
        top_k=config.top_k,
        selected=",".join(str(s["selected"]) for s in summaries),
        score_mean_selected=last["score_mean_selected"],
        embed_s=last["embed_s"],
        kmeans_s=sum(s["kmeans_s"] for s in summaries),
        output=config.output_prefix,
    )
    return 0
