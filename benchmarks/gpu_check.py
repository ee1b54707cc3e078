"""Everything that needs a GPU, in one run on one H200 (<= 8 minutes), into one results folder.

    python benchmarks/gpu_check.py --output-dir results/gpu_check            # on the GPU machine
    python benchmarks/gpu_check.py --dry-run --output-dir /tmp/gpu_check     # CPU: check every step

Steps (each with its own time limit; each writes ``<step>.log`` in the folder):
  1. gpu_tests      ``pytest -m gpu tests/``: TE ALiBi attention vs the CPU path, Triton kernels vs
                    PyTorch, distributed optimizer + resume, bf16 BLOOM logits vs transformers
  2. kernels        ``benchmarks/gpu_kernels.py --tokens 1024 2048`` (agreement, then tables)
  3. scaling        ``tools/scaling_study.py`` for bloom-560m and bloom-1b7 (actor/critic train,
                    scoring, generation) with tokens/s, peak memory planned vs measured, MFU
  4. plan           ``tools/plan_parallelism.py --json`` for the paper's 176B + 7B1 setting on
                    80 x 80 GB, beside the measurements
``summary.json`` lists each step's command, exit code and seconds; the run exits 1 if any failed.

``--dry-run`` (CPU, run in CI by tests/test_gpu_check.py) takes every step up to the point where
a GPU is needed: the files exist, ``pytest -m gpu --collect-only`` finds the real GPU tests, each
command's ``--help`` works, the scaling study's sizes and layouts validate, the optional GPU
packages (transformer_engine, triton) import or are reported missing, and the folder is writable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
SCALING_ARGS = [
    "--sizes", "bloom-560m", "bloom-1b7", "--layouts", "1x1", "--nproc", "1",
    "--micro-batch", "4", "--prompt-len", "512", "--response-len", "256", "--microbatches", "4",
]  # fmt: skip
PLAN_ARGS = [
    "--actor", "bloomz-176b", "--critic", "bloomz-7b1", "--reward", "bloomz-7b1",
    "--gpus", "80", "--gpu-memory-gb", "80", "--gpu", "H200", "--json",
]  # fmt: skip
MIN_GPU_TESTS = 4


@dataclass(kw_only=True)
class Step:
    """One command of the check."""

    name: str
    """Log file stem and summary key."""
    command: list[str]
    """What runs on the GPU machine."""
    timeout_s: int
    """Its share of the 8-minute budget."""
    files: list[str]
    """Repository files it needs."""
    dry_run: list[list[str]] = field(default_factory=list)
    """Commands that check it on the CPU (help texts, collection, validation)."""


def steps(output: Path) -> list[Step]:
    scaling_dir = str(output / "scaling")
    return [
        Step(
            name="gpu_tests",
            command=[PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/"],
            timeout_s=120,
            files=["tests/test_gpu.py", "pyproject.toml"],
            dry_run=[
                [
                    PYTHON,
                    "-m",
                    "pytest",
                    "-m",
                    "gpu",
                    "--collect-only",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/test_gpu.py",
                ]
            ],
        ),
        Step(
            name="kernels",
            command=[PYTHON, "benchmarks/gpu_kernels.py", "--tokens", "1024", "2048"],
            timeout_s=150,
            files=["benchmarks/gpu_kernels.py"],
            dry_run=[[PYTHON, "benchmarks/gpu_kernels.py", "--help"]],
        ),
        Step(
            name="scaling",
            command=[
                PYTHON,
                "tools/scaling_study.py",
                *SCALING_ARGS,
                "--output-dir",
                scaling_dir,
                "--overwrite",
            ],
            timeout_s=180,
            files=["tools/scaling_study.py", "megatron_rlhf/planning/study.py"],
            dry_run=[
                [PYTHON, "tools/scaling_study.py", "--help"],
                [
                    PYTHON,
                    "-c",
                    "import sys; from megatron_rlhf.planning.sweep import build_parser, plan_rows; "
                    "rows = plan_rows(build_parser().parse_args(sys.argv[1:])); print(len(rows), 'scaling rows')",
                    *SCALING_ARGS,
                    "--output-dir",
                    scaling_dir,
                ],
            ],
        ),
        Step(
            name="plan",
            command=[PYTHON, "tools/plan_parallelism.py", *PLAN_ARGS],
            timeout_s=30,
            files=["tools/plan_parallelism.py"],
            dry_run=[[PYTHON, "tools/plan_parallelism.py", *PLAN_ARGS, "--top", "1"]],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", required=True, help="the results folder")
    parser.add_argument("--dry-run", action="store_true", help="check every step on the CPU")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    args = parser.parse_args(argv)
    output = Path(args.output_dir).resolve()
    if output.exists() and any(output.iterdir()) and not args.overwrite:
        print(f"error: {output}: exists and is not empty; pass --overwrite", file=sys.stderr)
        return 2
    output.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    if not args.dry_run and not _has_gpu():
        print("error: no CUDA GPU here; run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    summary = {
        "mode": "dry-run" if args.dry_run else "gpu",
        "steps": {},
        "environment": environment(),
    }
    failed = False
    for step in steps(output):
        record = dry_run(step, output, env) if args.dry_run else run(step, output, env)
        summary["steps"][step.name] = record
        failed |= not record["ok"]
        print(
            f"[gpu_check] {step.name:<10} {'ok' if record['ok'] else 'FAILED'} ({record['seconds']:.0f} s)",
            flush=True,
        )
    (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"[gpu_check] done: mode={summary['mode']} failed={[n for n, r in summary['steps'].items() if not r['ok']]} output_dir={output}"
    )
    return 1 if failed else 0


def run(step: Step, output: Path, env: dict) -> dict:
    start = time.time()
    log = output / f"{step.name}.log"
    with open(log, "w", encoding="utf-8") as handle:
        try:
            rc = subprocess.run(
                step.command,
                cwd=REPO,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=step.timeout_s,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if step.name == "plan" and rc == 0:  # keep the plan's JSON as a file of its own
        (output / "plan_176b_80gpus.json").write_text(
            log.read_text().split("\n[plan_parallelism]")[0]
        )
    return {
        "command": step.command,
        "rc": rc,
        "ok": rc == 0,
        "seconds": time.time() - start,
        "log": log.name,
    }


def dry_run(step: Step, output: Path, env: dict) -> dict:
    """Every check of ``step`` that runs without a GPU; ok when all pass."""
    start, problems = time.time(), []
    problems += [f"missing {name}" for name in step.files if not (REPO / name).is_file()]
    log = output / f"{step.name}.dry-run.log"
    with open(log, "w", encoding="utf-8") as handle:
        handle.write("would run: " + " ".join(step.command) + f"  (limit {step.timeout_s} s)\n")
        for command in step.dry_run:
            handle.write("$ " + " ".join(command) + "\n")
            handle.flush()
            proc = subprocess.run(
                command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300
            )
            handle.write(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                problems.append(f"{' '.join(command[:3])}... exited {proc.returncode}")
            if "--collect-only" in command:
                collected = [line for line in proc.stdout.splitlines() if "::test_" in line]
                if len(collected) < MIN_GPU_TESTS:
                    problems.append(
                        f"pytest -m gpu collected {len(collected)} tests, expected >= {MIN_GPU_TESTS}"
                    )
    if sum(s.timeout_s for s in steps(output)) > 8 * 60:
        problems.append("the steps' time limits exceed the 8-minute budget")
    return {
        "command": step.command,
        "ok": not problems,
        "problems": problems,
        "seconds": time.time() - start,
        "log": log.name,
    }


def environment() -> dict:
    """What the optional GPU stack looks like here (imports guarded: absence is reported)."""
    import importlib.util

    import torch

    found = {
        name: importlib.util.find_spec(name) is not None
        for name in ("transformer_engine", "triton")
    }
    return {
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        **{f"has_{name}": present for name, present in found.items()},
    }


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
