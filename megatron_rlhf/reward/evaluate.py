"""``python -m megatron_rlhf eval-reward --scores FILE --output-dir DIR``: accuracy, ECE, per-task
score statistics and the paper's Fig. 2-4 plots for any reward model's scores.

FILE holds one pair per line: ``{"chosen_score": float, "rejected_score": float, "task": str}``
(task optional; pairs without one, or with null, are grouped as "untagged"). Equal chosen and rejected scores
are legitimate ties: they are counted and reported, never an error (conventions in
calibration.py). DIR receives fig2_calibration.png, fig3_score_hist.png, fig4_task_scores.png,
summary.md and summary.json, all or none (written to temporaries, renamed at the end); earlier
results there are replaced only with ``--overwrite``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_rlhf.utils import (
    InputError,
    check_output_path,
    print_summary,
    read_jsonl,
    require_finite,
    run_command,
)

OUTPUT_FILES = (
    "fig2_calibration.png",
    "fig3_score_hist.png",
    "fig4_task_scores.png",
    "summary.md",
    "summary.json",
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
    from megatron_rlhf.reward import calibration

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
    parser.add_argument("--overwrite", action="store_true", help="replace earlier results in DIR")
    args = parser.parse_args(argv)
    return run_command("eval-reward", lambda: run(args))


def run(args) -> int:
    import json

    from megatron_rlhf.rehearsal.staging import staged_outputs
    from megatron_rlhf.reward import plots
    from megatron_rlhf.runtime import locks

    out = Path(args.output_dir)
    if out.is_file():
        raise InputError(f"--output-dir {out}: is a file; give a directory")
    for name in OUTPUT_FILES:
        check_output_path(out / name, args.overwrite, "--output-dir")
    locks.lock_output(out, "--output-dir")
    if args.bins < 1:
        raise InputError(f"--bins must be >= 1, got {args.bins}")
    chosen, rejected, tasks = read_score_pairs(args.scores)
    summary = evaluate(chosen, rejected, tasks, args.bins)
    label = args.label or Path(args.scores).stem
    with staged_outputs() as staging:
        fig2, fig3, fig4, markdown, summary_json = (staging.file(out / n) for n in OUTPUT_FILES)
        plots.plot_calibration(fig2, {label: summary["reliability_curve"]})
        plots.plot_score_histograms(fig3, {label: (chosen, rejected)})
        plots.plot_task_stats(fig4, {label: summary["per_task"]})
        markdown.write_text(markdown_summary(summary, args.scores), encoding="utf-8")
        summary_json.write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n", "utf-8")
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
