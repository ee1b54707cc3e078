"""Everything that needs a GPU, in one run on one H200 (limits <= 8 min, ~5 min planned).

    python benchmarks/gpu_check.py --output-dir results/gpu_check            # on the GPU machine
    python benchmarks/gpu_check.py --dry-run --output-dir /tmp/gpu_check     # CPU: check every step

Steps, in this order (each with a time limit and a planned time; each writes ``<step>.log``):
  1. stack        the GPU extras: TransformerEngine, Triton and faiss-gpu import and are built for
                  torch's CUDA major (``.[gpu-cu12]`` / ``.[gpu-cu13]``); missing is a failure
  2. first_run    ``benchmarks/gpu_first_run.py``: load through load_bloom/TrainEngine with no
                  ``.cuda()`` and a bf16 step; save then strict load with TE; logits TE on / off /
                  fp32 at 2,048 tokens; Triton log-probs at 8,704 x 250,880; greedy generate vs
                  transformers and tokens/s; a tiny train-ppo run and its peak memory; faiss-gpu
                  k-means vs the CPU; a DeepSpeed ZeRO-2 bf16 step; megatron-to-hf of the
                  GPU-trained checkpoint; MFU of a bloom-560m training step
  3. gpu_tests    ``pytest -m gpu tests/``: TE ALiBi attention and the PyTorch path against fp32,
                  Triton kernels vs PyTorch, distributed optimizer + resume, bf16 logits vs
                  transformers (a skip counts as a failure)
  4. kernels      ``benchmarks/gpu_kernels.py --tokens 2048`` (agreement, then tables)
  5. scaling      ``tools/scaling_study.py`` for bloom-560m (actor/critic train, scoring,
                  generation): tokens/s, peak memory planned vs measured, MFU
  6. plan         ``tools/plan_parallelism.py --json`` for the paper's 176B + 7B1 setting on
                  80 x 80 GB, beside the measurements
``summary.json`` lists each step's command, exit code and seconds; the run exits 1 if any failed.

Multi-GPU checks need a machine with >= 4 GPUs and are not part of the one-GPU run
(``--multi-gpu`` runs them after the steps above): TP/PP over NCCL against TP=1
(``tests/test_bloom_parallel.py``, ``tests/test_engine_parallel.py``) and the NCCL refit of the
per-role layouts (``tests/test_layouts_parallel.py``).

``--dry-run`` (CPU, run in CI by tests/test_gpu_check.py) takes every step up to the point where
a GPU is needed: the files exist, ``pytest -m gpu --collect-only`` finds the real GPU tests, each
command's ``--help`` works, ``gpu_first_run.py --cpu`` runs every check at tiny shapes, the
scaling study's sizes validate, the stack check runs (its problems are reported, not fatal, on a
CPU), and the time limits and plans fit the budget.
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
    "--sizes", "bloom-560m", "--layouts", "1x1", "--nproc", "1",
    "--micro-batch", "4", "--prompt-len", "512", "--response-len", "128", "--microbatches", "4",
]  # fmt: skip
PLAN_ARGS = [
    "--actor", "bloomz-176b", "--critic", "bloomz-7b1", "--reward", "bloomz-7b1",
    "--gpus", "80", "--gpu-memory-gb", "80", "--gpu", "H200", "--json",
]  # fmt: skip
MIN_GPU_TESTS = 4
LIMIT_BUDGET_S = 8 * 60 - 30  # the steps' limits, with 30 s of headroom in the 8 minutes
PLANNED_BUDGET_S = 6 * 60
MULTI_GPU_TESTS = [
    "tests/test_bloom_parallel.py", "tests/test_engine_parallel.py", "tests/test_layouts_parallel.py",
]  # fmt: skip


@dataclass(kw_only=True)
class Step:
    """One command of the check."""

    name: str
    """Log file stem and summary key."""
    command: list[str]
    """What runs on the GPU machine."""
    timeout_s: int
    """Its limit: the limits add up to at most LIMIT_BUDGET_S."""
    planned_s: int
    """What it should take on one H200: the plans add up to at most PLANNED_BUDGET_S."""
    files: list[str]
    """Repository files it needs."""
    dry_run: list[list[str]] = field(default_factory=list)
    """Commands that check it on the CPU (help texts, collection, validation)."""


def steps(output: Path) -> list[Step]:
    scaling_dir = str(output / "scaling")
    pytest = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider"]
    return [
        Step(
            name="stack",
            command=[PYTHON, "benchmarks/gpu_check.py", "--stack-only"],
            timeout_s=30,
            planned_s=10,
            files=["setup.py"],
            dry_run=[[PYTHON, "benchmarks/gpu_check.py", "--stack-only", "--report-only"]],
        ),
        Step(
            name="first_run",
            command=[
                PYTHON,
                "benchmarks/gpu_first_run.py",
                "--output-dir",
                str(output / "first_run"),
            ],
            timeout_s=170,
            planned_s=110,
            files=["benchmarks/gpu_first_run.py", "tests/ppo_fixtures.py"],
            dry_run=[
                [
                    PYTHON,
                    "benchmarks/gpu_first_run.py",
                    "--cpu",
                    "--output-dir",
                    str(output / "first_run_cpu"),
                ],
            ],  # fmt: skip
        ),
        Step(
            name="gpu_tests",
            command=[*pytest, "-m", "gpu", "-q", "-rs", "tests/test_gpu.py"],
            timeout_s=90,
            planned_s=60,
            files=["tests/test_gpu.py", "pyproject.toml"],
            dry_run=[[*pytest, "-m", "gpu", "--collect-only", "-q", "tests/test_gpu.py"]],
        ),
        Step(
            name="kernels",
            command=[PYTHON, "benchmarks/gpu_kernels.py", "--tokens", "2048"],
            timeout_s=60,
            planned_s=40,
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
            timeout_s=90,
            planned_s=60,
            files=["tools/scaling_study.py", "megatron_rlhf/planning/tools/study.py"],
            dry_run=[
                [PYTHON, "tools/scaling_study.py", "--help"],
                [
                    PYTHON,
                    "-c",
                    "import sys; from megatron_rlhf.planning.tools.sweep import build_parser, plan_rows; "
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
            timeout_s=10,
            planned_s=5,
            files=["tools/plan_parallelism.py"],
            dry_run=[[PYTHON, "tools/plan_parallelism.py", *PLAN_ARGS, "--top", "1"]],
        ),
    ]


def multi_gpu_steps() -> list[Step]:
    """TP/PP over NCCL and the NCCL refit: the multi-rank tests, launched on >= 4 GPUs."""
    return [
        Step(
            name="multi_gpu",
            command=[PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MULTI_GPU_TESTS],
            timeout_s=600,
            planned_s=300,
            files=MULTI_GPU_TESTS,
        )
    ]


def stack_problems(distributions: dict[str, str], torch_cuda: str | None) -> list[str]:
    """What is wrong with the installed GPU stack (``distributions``: name -> version, names
    normalised to lower case with '-'); empty when TE, Triton and faiss-gpu are there and every
    CUDA-specific package is built for torch's CUDA major."""
    import re

    if torch_cuda is None:
        return ["torch has no CUDA build (torch.version.cuda is None): install a CUDA torch"]
    major = torch_cuda.split(".")[0]
    problems = []
    names = set(distributions)
    if not any(n.startswith("transformer-engine") for n in names):
        problems.append(f"transformer-engine is not installed: pip install -e '.[gpu-cu{major}]'")
    if "triton" not in names:
        problems.append("triton is not installed")
    faiss_gpu = [n for n in names if n.startswith("faiss-gpu")]
    if not faiss_gpu:
        problems.append(f"faiss-gpu is not installed: pip install -e '.[gpu-cu{major}]'")
    if faiss_gpu and "faiss-cpu" in names:
        problems.append("faiss-cpu and faiss-gpu are both installed (both provide `faiss`)")
    for name in sorted(names):
        built = re.search(r"-cu(\d+)", name)
        if built and built.group(1) != major and name.split("-cu")[0] in (
            "transformer-engine", "faiss-gpu", "transformer-engine-torch",
        ):  # fmt: skip
            problems.append(f"{name} is built for CUDA {built.group(1)}, torch for CUDA {major}")
    return problems


def installed_distributions() -> dict[str, str]:
    from importlib.metadata import distributions

    return {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}


def stack_check(report_only: bool) -> int:
    import importlib.util

    import torch

    problems = stack_problems(installed_distributions(), torch.version.cuda)
    for module in ("transformer_engine.pytorch", "triton", "faiss"):
        try:
            if importlib.util.find_spec(module.split(".")[0]) is not None:
                importlib.import_module(module)
        except Exception as err:  # a CUDA/driver mismatch shows here
            problems.append(f"import {module} failed: {type(err).__name__}: {err}")
    for problem in problems:
        print(f"[gpu_check] stack: {problem}", file=sys.stderr)
    print(f"[gpu_check] stack: torch {torch.__version__} CUDA {torch.version.cuda}, "
          f"{len(problems)} problem(s)")  # fmt: skip
    return 0 if report_only or not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", help="the results folder (required but with --stack-only)")
    parser.add_argument("--dry-run", action="store_true", help="check every step on the CPU")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--multi-gpu", action="store_true", help="then the >= 4-GPU checks")
    parser.add_argument("--stack-only", action="store_true", help="only check the GPU extras")
    parser.add_argument("--report-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stack_only:
        return stack_check(args.report_only)
    if args.output_dir is None:
        parser.error("--output-dir is required")
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
    planned = steps(output) + (multi_gpu_steps() if args.multi_gpu else [])
    for step in planned:
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
    if step.name == "gpu_tests" and rc == 0 and " skipped" in log.read_text():
        rc = 1  # a GPU test that skips (TE or Triton missing) is a failure on the GPU machine
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
            if "FAILED" in proc.stdout and "gpu_first_run" in " ".join(command):
                problems.append("gpu_first_run --cpu reported a failed check")
            if "--collect-only" in command:
                collected = [line for line in proc.stdout.splitlines() if "::test_" in line]
                if len(collected) < MIN_GPU_TESTS:
                    problems.append(
                        f"pytest -m gpu collected {len(collected)} tests, expected >= {MIN_GPU_TESTS}"
                    )
    if sum(s.timeout_s for s in steps(output)) > LIMIT_BUDGET_S:
        problems.append(f"the steps' time limits exceed {LIMIT_BUDGET_S} s")
    if sum(s.planned_s for s in steps(output)) > PLANNED_BUDGET_S:
        problems.append(f"the steps' planned times exceed {PLANNED_BUDGET_S} s")
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
