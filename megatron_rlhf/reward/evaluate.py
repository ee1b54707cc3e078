"""``python -m megatron_rlhf eval-reward --scores FILE --output-dir DIR``: accuracy, ECE, per-task
score statistics and the paper's Fig. 2-4 plots for any reward model's scores.

FILE holds one pair per line: ``{"chosen_score": float, "rejected_score": float, "task": str}``
(task optional; pairs without one, or with null, are grouped as "untagged"). Equal chosen and rejected scores
are legitimate ties: they are counted and reported, never an error (conventions in
calibration.py). DIR receives fig2_calibration.png, fig3_score_hist.png, fig4_task_scores.png,
summary.md and, last, summary.json (its presence means the run finished).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_rlhf.reward import calibration, plots
from megatron_rlhf.utils import (
    InputError,
    atomic_output,
    print_summary,
    read_jsonl,
    require_finite,
    write_json,
)

UNTAGGED = "untagged"


def read_score_pairs(path: str | Path) -> tuple[list[float], list[float], list[str]]:
    """Read (chosen scores, rejected scores, tasks); errors name the file and line."""
    chosen, rejected, tasks = [], [], []
    for line_number, record in read_jsonl(path):
        where = f"{path}:{line_number}"
        for key in ("chosen_score", "rejected_score"):
            if key not in record:
                raise InputError(
                    f"{where}: missing {key!r}; each line needs chosen_score and "
                    "rejected_score (numbers) and optionally task (a string)"
                )
        chosen.append(require_finite(record["chosen_score"], f"{where}: chosen_score"))
        rejected.append(require_finite(record["rejected_score"], f"{where}: rejected_score"))
        task = UNTAGGED if record.get("task") is None else record["task"]
        if not isinstance(task, str) or not task:
            raise InputError(f"{where}: task must be a non-empty string, got {task!r}")
        tasks.append(task)
    if not chosen:
        raise InputError(f"{path}: no score pairs (the file is empty)")
    return chosen, rejected, tasks


def evaluate(chosen: list[float], rejected: list[float], tasks: list[str], bins: int) -> dict:
    """The summary.json content for one set of scored pairs."""
    return {
        "num_pairs": len(chosen),
        "accuracy": calibration.ranking_accuracy(chosen, rejected),
        "ece": calibration.expected_calibration_error(chosen, rejected, bins),
        "ties": sum(c == r for c, r in zip(chosen, rejected)),
        "overall": calibration.score_stats(chosen + rejected),
        "per_task": calibration.per_task_stats(chosen, rejected, tasks),
        "calibration_bins": calibration.calibration_bins(chosen, rejected, bins),
        "reliability_curve": calibration.reliability_curve(chosen, rejected, bins),
    }


def markdown_summary(summary: dict, scores_path: str) -> str:
    """A human-readable report of ``summary`` with the three figures."""
    lines = [
        f"# Reward model evaluation: `{scores_path}`",
        "",
        f"- pairs: {summary['num_pairs']} (ties: {summary['ties']})",
        f"- ranking accuracy: {100 * summary['accuracy']:.2f} %",
        f"- ECE (×100): {summary['ece']:.2f}",
        f"- scores: mean {summary['overall']['mean']:.4f}, std {summary['overall']['std']:.4f}",
        "",
        "## Per task",
        "",
        "| task | pairs | accuracy % | mean | std |",
        "|---|---:|---:|---:|---:|",
    ]
    for task, row in summary["per_task"].items():
        lines.append(
            f"| {task} | {row['pairs']} | {100 * row['accuracy']:.2f} | {row['mean']:.4f} | "
            f"{row['std']:.4f} |"
        )
    lines += [
        "",
        "## Calibration bins (confidence σ(|Δ|))",
        "",
        "| confidence | pairs | accuracy | mean confidence |",
        "|---|---:|---:|---:|",
    ]
    for row in summary["calibration_bins"]:
        acc = "–" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        conf = "–" if row["confidence"] is None else f"{row['confidence']:.4f}"
        lines.append(
            f"| [{row['conf_lo']:.2f}, {row['conf_hi']:.2f}) | {row['count']} | {acc} | {conf} |"
        )
    lines += [
        "",
        "![Fig. 2 calibration](fig2_calibration.png)",
        "![Fig. 3 score histograms](fig3_score_hist.png)",
        "![Fig. 4 per-task scores](fig4_task_scores.png)",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rlhf eval-reward", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--scores", required=True, help="JSONL of scored pairs (see above)")
    parser.add_argument("--output-dir", required=True, help="where summary.json etc. go")
    parser.add_argument("--bins", type=int, default=10, help="confidence bins for the ECE")
    parser.add_argument("--label", default=None, help="model name in the plots (default: FILE)")
    args = parser.parse_args(argv)
    try:
        if args.bins < 1:
            raise InputError(f"--bins must be >= 1, got {args.bins}")
        chosen, rejected, tasks = read_score_pairs(args.scores)
    except InputError as err:
        print(f"eval-reward: error: {err}", file=sys.stderr)
        return 2
    summary = evaluate(chosen, rejected, tasks, args.bins)
    label = args.label or Path(args.scores).stem
    out = Path(args.output_dir)
    plots.plot_calibration(out / "fig2_calibration.png", {label: summary["reliability_curve"]})
    plots.plot_score_histograms(out / "fig3_score_hist.png", {label: (chosen, rejected)})
    plots.plot_task_stats(out / "fig4_task_scores.png", {label: summary["per_task"]})
    with atomic_output(out / "summary.md") as tmp:
        tmp.write_text(markdown_summary(summary, args.scores), encoding="utf-8")
    write_json(out / "summary.json", summary)
    print_summary(
        "eval-reward",
        pairs=summary["num_pairs"],
        accuracy=summary["accuracy"],
        ece=summary["ece"],
        ties=summary["ties"],
        tasks=len(summary["per_task"]),
        output=str(out),
    )
    return 0
