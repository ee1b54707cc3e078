"""Build the rehearsal set D_R (paper §3.2): embed prompts, k-means, top-k per cluster, write.

Usage (``tools/build_rehearsal_clusters.py`` calls ``main``)::

    python tools/build_rehearsal_clusters.py --input scored.jsonl --embedding-model DIR \
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
import math
import sys

from megatron_rlhf.rehearsal.build import run
from megatron_rlhf.rehearsal.config import RehearsalConfig
from megatron_rlhf.utils import print_summary, run_command

COMMAND = "build_rehearsal_clusters"


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
