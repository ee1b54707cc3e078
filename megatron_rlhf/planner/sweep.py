"""``tools/scaling_study.py``: sizes x layouts x stages, measured and planned, in one folder.

    python tools/scaling_study.py --quick --output-dir study/            # CPU, <= 5 min, 2 ranks
    python tools/scaling_study.py --sizes bloom-560m bloom-1b7 --layouts 1x1 --nproc 1 \\
        --output-dir study_gpu/                                           # one GPU, with MFU

Each world size is one torchrun launch (``python -m megatron_rlhf.planner.measure``) running
every row of that size; a layout ``TPxPP`` gets DP = nproc / (TP * PP). Writes
``results.csv`` (one row per run: model, params, tp, pp, dp, stage, tokens_per_s,
peak_mem_measured_mb, peak_mem_planned_mb, mfu, plus step_s and planned/measured), ``table.md``,
``throughput.png`` and ``memory.png`` (planned vs measured against model size).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_rlhf.utils import InputError, check_output_dir

COLUMNS = (
    "model", "params", "tp", "pp", "dp", "stage", "tokens_per_s", "peak_mem_measured_mb",
    "peak_mem_planned_mb", "mfu", "step_s", "planned_over_measured",
)  # fmt: skip
QUICK_SIZES = ("tiny", "small", "medium", "560m-shaped")
QUICK_LAYOUTS = ("1x1", "2x1", "1x2")
BIG_QUICK_LAYOUTS = ("2x1", "1x2")  # 560m-shaped: DP=2 would hold two fp32 Adam copies
STAGES = ("actor_train", "critic_train", "score", "generate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tools/scaling_study.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU sweep tiny -> 560m-shaped, 2 ranks"
    )
    parser.add_argument(
        "--sizes", nargs="+", help="tiny small medium 560m-shaped or bloom-* / config.json"
    )
    parser.add_argument(
        "--layouts", nargs="+", default=["1x1"], help="TPxPP per run, e.g. 1x1 2x1 1x2"
    )
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument(
        "--nproc", type=int, default=1, help="processes per launch (GPUs or CPU ranks)"
    )
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--response-len", type=int, default=32, help="response tokens per sequence")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per train step")
    parser.add_argument("--output-dir", required=True, help="folder for results.csv and plots")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing output folder"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rows, work = plan_rows(args), work_from_args(args)
        output = check_output_dir(args.output_dir, args.overwrite)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    nproc = 2 if args.quick else args.nproc
    results = run_launch(rows, work, nproc)
    write_outputs(results, output)
    worst = max(abs(r["planned_over_measured"] - 1) for r in results)
    print(markdown_table(results))
    print(f"[scaling_study] done: rows={len(results)} worst_planned_vs_measured={worst:.1%} "
          f"output_dir={output}")  # fmt: skip
    return 0


def work_from_args(args) -> dict:
    for name in ("micro_batch", "prompt_len", "response_len", "microbatches"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1")
    return {
        "micro_batch": args.micro_batch,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "microbatches": args.microbatches,
    }


def plan_rows(args) -> list[list]:
    """``[size, tp, pp, stage]`` for every run of the sweep."""
    from megatron_rlhf.planner.measure import study_shape

    if args.quick:
        return [
            [size, tp, pp, stage]
            for size in QUICK_SIZES
            for tp, pp in map(
                parse_layout, BIG_QUICK_LAYOUTS if size == "560m-shaped" else QUICK_LAYOUTS
            )
            for stage in args.stages
        ]
    if not args.sizes:
        raise InputError("give --sizes (e.g. --sizes bloom-560m bloom-1b7) or --quick")
    rows = []
    for size in args.sizes:
        shape = study_shape(size)
        for tp, pp in map(parse_layout, args.layouts):
            if args.nproc % (tp * pp) or shape.num_heads % tp or shape.num_layers % pp:
                raise InputError(
                    f"--layouts {tp}x{pp}: needs tp*pp to divide --nproc {args.nproc}, tp to "
                    f"divide {size}'s {shape.num_heads} heads and pp its {shape.num_layers} layers"
                )
            rows += [[size, tp, pp, stage] for stage in args.stages]
    return rows


def parse_layout(text: str) -> tuple[int, int]:
    try:
        tp, pp = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise InputError(f"--layouts {text!r}: expected TPxPP, e.g. 2x1") from None
    if tp < 1 or pp < 1:
        raise InputError(f"--layouts {text!r}: TP and PP must be >= 1")
    return tp, pp


def run_launch(rows: list[list], work: dict, nproc: int) -> list[dict]:
    """One torchrun launch over every row; returns rank 0's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        if "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--standalone", "-m", "megatron_rlhf.planner.measure",
            "--rows", json.dumps(rows), "--work", json.dumps(work), "--out", str(out),
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"scaling study launch failed (rc={proc.returncode})")
        results = json.loads(out.read_text())
    for row in results:
        row["planned_over_measured"] = row["peak_mem_planned_mb"] / row["peak_mem_measured_mb"]
    return results


def write_outputs(results: list[dict], output: Path) -> None:
    """results.csv, table.md and the plots, written to a temporary folder then renamed."""
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "results.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)
    (tmp / "table.md").write_text(markdown_table(results) + "\n", encoding="utf-8")
    plot(results, tmp)
    if output.exists():
        shutil.rmtree(output)
    os.replace(tmp, output)


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| model | params | TPxPPxDP | stage | tokens/s | peak MB measured | planned | planned/measured | MFU |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        mfu = f"{r['mfu']:.1%}" if isinstance(r["mfu"], float) else "-"
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['tp']}x{r['pp']}x{r['dp']} | "
            f"{r['stage']} | {r['tokens_per_s']:.0f} | {r['peak_mem_measured_mb']:.1f} | "
            f"{r['peak_mem_planned_mb']:.1f} | {r['planned_over_measured']:.3f} | {mfu} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], folder: Path) -> None:
    """Throughput and memory (planned dashed, measured solid) against parameters, per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}
    for r in results:
        series.setdefault((r["stage"], f"{r['tp']}x{r['pp']}x{r['dp']}"), []).append(r)
    for name, keys in (
        ("throughput", ("tokens_per_s",)),
        ("memory", ("peak_mem_measured_mb", "peak_mem_planned_mb")),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for (stage, layout), rows in sorted(series.items()):
            rows = sorted(rows, key=lambda r: r["params"])
            for key in keys:
                style = "--" if key == "peak_mem_planned_mb" else "-o"
                label = f"{stage} {layout}" + (" planned" if style == "--" else "")
                ax.plot([r["params"] for r in rows], [r[key] for r in rows], style, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("tokens/s" if name == "throughput" else "peak memory per rank (MB)")
        ax.set_title(f"scaling study: {name} (TPxPPxDP)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(folder / f"{name}.png", dpi=110)
        plt.close(fig)
