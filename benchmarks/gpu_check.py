"""Everything that needs a GPU, in one run on one H200 (planned <= 5 min, limits <= 8 min).

The machine this project is lent is a bare CUDA image: Python 3.12, torch 2.11 (cu130), Triton
3.6, transformers; no megatron-core, DeepSpeed, Transformer Engine, faiss or vLLM; no network;
64 MiB carried with the working tree. So the run brings its own wheels:

    python benchmarks/gpu_wheelhouse.py --build              # here: .whl/ (git-ignored), ~8 MB
    python3 benchmarks/gpu_check.py --output-dir /tmp/gpu_check --bundle "$OUT/gpu_check.tar.gz"
                                              # there, with .whl carried; the device returns $OUT
    python benchmarks/gpu_check.py --dry-run --output-dir /tmp/gpu_check_dry   # CPU: the plan

Steps, in this order (each with a time limit and a planned time on the bare image; each writes
``<step>.log``; ``summary.json`` and the bundle are rewritten after every step, so a run stopped
from outside keeps what it did; a failed setup or stack stops the run there, since every later
step needs them). The device returns only ``$OUT``: the bundle must go there, the results folder
elsewhere (its ``site/`` holds thousands of files); a GPU run refuses other places.
  1. setup        the wheelhouse (``--wheelhouse``, default ``.whl``), checked against
                  ``benchmarks/gpu_wheelhouse.json`` (a missing or altered wheel fails the step),
                  installed with ``--no-index --no-deps`` into a folder of its own that every
                  later step has on PYTHONPATH (the project runs from the tree: no install)
  2. stack        what imports, at which version: torch (CUDA), Triton, transformers,
                  megatron-core 0.16.1 and ``megatron_rlhf.kernels`` are required; DeepSpeed,
                  Transformer Engine, faiss-gpu and vLLM are optional ("not on this machine")
  3. first_run    ``benchmarks/gpu_first_run.py``: every command's model path on the GPU (load
                  and bf16 step, save and strict load, bf16 logits at 2,048 tokens, TE's
                  attention, Triton log-probs past 2**31 elements, generate vs transformers, a
                  train-ppo run with a checkpoint, faiss-gpu k-means, DeepSpeed ZeRO-2, vLLM's
                  weight reload, megatron-to-hf, MFU of bloom-560m)
  4. gpu_tests    ``pytest -m gpu tests/test_gpu.py`` (a skip is a failure unless its reason
                  says the optional package is "not on this machine")
  5. kernels      ``benchmarks/gpu_kernels.py --tokens 2048`` (agreement, then tables)
  6. attention    ``benchmarks/gpu_attention.py``: the fused Triton ALiBi attention against the
                  PyTorch path (and TE where installed) at 512-4,096 tokens, BLOOM-7b1's and
                  176B's heads per TP rank: agreement in bf16 steps, time, peak memory; its
                  Triton kernels compiled before the budget's clock, its JSON after each size
  7. scaling      ``tools/scaling_study.py`` for bloom-560m (actor/critic train, scoring,
                  generation): tokens/s, peak memory planned vs measured, MFU
  8. plan         ``tools/plan_parallelism.py --json`` for the paper's 176B + 7B1 setting on
                  80 x 80 GB, beside the measurements
A check whose optional package is missing reports "not on this machine", neither a pass nor a
failure; with the full stack installed (``pip install -e ".[gpu-cu13]"``, vLLM) every check runs.
Each step runs in a process group of its own; at its limit it, its group and every process
below it (torchrun's workers start sessions of their own) get SIGTERM, then SIGKILL after the
step's grace; gpu_check adopts orphans (a child subreaper) and ends whatever a step left behind
before the next one starts. Transformer Engine logs the attention backend it selects
(``NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2``); those lines go into ``summary.json``.

Multi-GPU checks need a machine with >= 4 GPUs and are not part of the one-GPU run
(``--multi-gpu`` runs them after the steps above): TP/PP over NCCL against TP=1
(``tests/test_bloom_parallel.py``, ``tests/test_engine_parallel.py``) and the NCCL refit of the
per-role layouts (``tests/test_layouts_parallel.py``).

The plan (``--dry-run`` prints it): planned times add up to <= 300 s, so that a machine start
(1-3 min) and a targeted rerun fit the device session's 15 minutes; limits to <= 480 s, and with
each step's grace to <= 600 s. No timed or budgeted call includes a Triton compile: each step
compiles its kernels first (``Step.compiles`` names them; the dry run prints them).

``--dry-run`` (CPU, run in CI by tests/test_gpu_check.py) takes every step up to the point where
a GPU is needed: the files exist, ``pytest -m gpu --collect-only`` finds the real GPU tests, each
command's ``--help`` works, ``gpu_first_run.py --cpu`` runs every check at tiny shapes, the
scaling study's sizes validate, the stack check runs (its problems are reported, not fatal, on a
CPU), the time limits and plans fit the budget, and the bare image's plan is printed: which
checks run there, and the wheelhouse (from ``benchmarks/gpu_wheelhouse.json``) plus the working
tree within the 64 MiB carried.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO))  # the tree's megatron_rlhf: the device gets a copy, not an install
from megatron_rlhf.runtime.processes import (  # noqa: E402
    become_subreaper,
    descendants,
    die_with_parent,
    end_tree,
)

PYTHON = sys.executable
TERM_GRACE_S = 10  # SIGTERM to SIGKILL, for a step past its limit
TORCHRUN_GRACE_S = 35  # torchrun waits up to 30 s for its workers after a SIGTERM
SCALING_ARGS = [
    "--sizes", "bloom-560m", "--layouts", "1x1", "--nproc", "1",
    "--micro-batch", "4", "--prompt-len", "512", "--response-len", "128", "--microbatches", "2",
]  # fmt: skip
PLAN_ARGS = [
    "--actor", "bloomz-176b", "--critic", "bloomz-7b1", "--reward", "bloomz-7b1",
    "--gpus", "80", "--gpu-memory-gb", "80", "--gpu", "H200", "--json",
]  # fmt: skip
MIN_GPU_TESTS = 4
# A device session has 15 minutes: machine start (1-3 min), the planned run, and a targeted rerun.
PLANNED_BUDGET_S = 300  # the steps' planned times: what one run should take
LIMIT_BUDGET_S = 8 * 60  # the steps' limits
WORST_CASE_BUDGET_S = 10 * 60  # every step at its limit, plus its grace
CARRY_LIMIT_BYTES = 64 * 2**20  # what the device machine receives: the tree and what it carries
NOT_ON_THIS_MACHINE = "not on this machine"
MULTI_GPU_TESTS = [
    "tests/test_bloom_parallel.py", "tests/test_engine_parallel.py", "tests/test_layouts_parallel.py",
]  # fmt: skip
# Transformer Engine's attention-backend choice, logged under NVTE_DEBUG (kept in the summary).
TE_DEBUG_ENV = {"NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"}

# The image of the GPU machine this project is lent (DESIGN.md section 6), as Python modules: what
# the bare-image plan assumes is there before the wheelhouse is installed.
BARE_IMAGE = {
    "python": "3.12",
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "transformers": "5.17.0",
}
# module -> (distribution, required?, what needs it)
STACK = {
    "torch": ("torch", True, "everything"),
    "triton": ("triton", True, "the fused kernels"),
    "transformers": ("transformers", True, "the numerical reference, conversion"),
    "megatron.core": ("megatron-core", True, "the parallel engine (pinned 0.16.1)"),
    "megatron_rlhf.kernels": ("megatron-rlhf", True, "the project's kernels (from the tree)"),
    "deepspeed": ("deepspeed", False, "train-reward backend=deepspeed"),
    "transformer_engine.pytorch": ("transformer-engine", False, "TE attention and fused Adam"),
    "faiss": ("faiss-gpu", False, "k-means on the GPU"),
    "vllm": ("vllm", False, "rollout.engine=vllm"),
}
MEGATRON_CORE_VERSION = "0.16.1"
# The first run's checks and the optional module each needs (absent: "not on this machine").
FIRST_RUN_NEEDS = {
    "logits_te": "transformer_engine.pytorch",
    "faiss_kmeans": "faiss",
    "deepspeed_zero2": "deepspeed",
    "vllm_reload": "vllm",
}


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
    """What it should take on one H200 with the bare image and cold caches (Python start-up
    and imports included: ~10-15 s a process with megatron-core, measured warm on CPU at 4-6 s;
    Triton compiles as measured for sm_90 with Triton 3.6 on a 2-core machine, an upper bound):
    the plans add up to at most PLANNED_BUDGET_S."""
    compiles: str = ""
    """The Triton compiles it front-loads, so that no timed or budgeted call includes one (the
    dry run prints them beside the plan)."""
    files: list[str]
    """Repository files it needs."""
    grace_s: int = TERM_GRACE_S
    """From SIGTERM to SIGKILL when it passes its limit (part of the worst case)."""
    dry_run: list[list[str]] = field(default_factory=list)
    """Commands that check it on the CPU (help texts, collection, validation)."""


def steps(output: Path) -> list[Step]:
    scaling_dir = str(output / "scaling")
    pytest = [PYTHON, "-m", "pytest", "-p", "no:cacheprovider"]
    here = [PYTHON, "benchmarks/gpu_check.py"]
    return [
        Step(
            name="setup",
            command=[*here, "--setup-only", "--output-dir", str(output)],
            timeout_s=20,
            planned_s=8,  # verify 7.3 MiB of wheels, pip install --target: 4-8 s
            files=["benchmarks/gpu_wheelhouse.py", "benchmarks/gpu_wheelhouse.json"],
            dry_run=[[PYTHON, "benchmarks/gpu_wheelhouse.py", "--plan"]],
        ),
        Step(
            name="stack",
            command=[*here, "--stack-only", "--output-dir", str(output)],
            timeout_s=25,
            planned_s=15,  # imports torch, megatron-core, DeepSpeed, transformers: 10-18 s
            files=["setup.py"],
            dry_run=[[*here, "--stack-only", "--report-only", "--output-dir", str(output)]],
        ),
        Step(
            name="first_run",
            command=[
                PYTHON,
                "benchmarks/gpu_first_run.py",
                "--output-dir",
                str(output / "first_run"),
            ],
            timeout_s=210,  # the estimate's top (180 s) plus headroom
            planned_s=140,  # 4 processes' imports, 1.2 GB HF saves and loads: 110-180 s
            compiles=(
                "load_train_step's untimed step: Triton probe, bf16 D=64 attention (fwd, bwd_kv, "
                "bwd_q), log-probs at its shape; triton_logprobs: one untimed call at 8,704 rows "
                "before the timed one; generate, mfu_560m: an untimed call first; the ppo_step "
                "child: D=16 attention, KL, shaped rewards, GAE, log-probs (untimed)"
            ),
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
            timeout_s=45,
            planned_s=30,  # 25-32 s; nothing timed
            compiles="nothing timed: each test compiles what it runs",
            files=["tests/test_gpu.py", "pyproject.toml"],
            dry_run=[[*pytest, "-m", "gpu", "--collect-only", "-q", "tests/test_gpu.py"]],
        ),
        Step(
            name="kernels",
            command=[PYTHON, "benchmarks/gpu_kernels.py", "--tokens", "2048"],
            timeout_s=50,
            planned_s=30,  # 25-40 s
            compiles=(
                "the agreement pass compiles the log-prob, hidden log-prob, KL, shaped-reward "
                "and GAE kernels; every timed call follows an untimed one of its shape"
            ),
            files=["benchmarks/gpu_kernels.py"],
            dry_run=[[PYTHON, "benchmarks/gpu_kernels.py", "--help"]],
        ),
        Step(
            name="attention",
            command=[
                PYTHON,
                "benchmarks/gpu_attention.py",
                "--budget-s",
                "15",
                "--json",
                str(output / "attention.json"),
            ],  # fmt: skip
            timeout_s=60,
            planned_s=42,  # imports 8 + compiles ~15 (2 x 3 kernels) + budget 15 + the last config
            compiles=(
                "before the budget's clock: bf16 attention fwd, bwd_kv, bwd_q at D=128 for 32 "
                "heads per rank and for 8/14 (two specialisations of each kernel)"
            ),
            files=["benchmarks/gpu_attention.py", "kernels/fused/triton_alibi_attention.py"],
            dry_run=[[PYTHON, "benchmarks/gpu_attention.py", "--help"]],
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
            ],  # fmt: skip
            timeout_s=60,
            planned_s=33,  # torchrun + 4 rows of bloom-560m: 30-50 s
            compiles="each row's untimed warm-up step (measure.py) compiles what its timed one runs",
            grace_s=TORCHRUN_GRACE_S,
            files=["tools/scaling_study.py", "megatron_rlhf/planner/measure.py"],
            dry_run=[
                [PYTHON, "tools/scaling_study.py", "--help"],
                [
                    PYTHON,
                    "-c",
                    "import sys; from megatron_rlhf.planner.sweep import build_parser, plan_rows; "
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
            planned_s=2,  # arithmetic only
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


# ----------------------------------------------------------------------------- processes


def run_in_process_group(
    command: list[str],
    timeout_s: float,
    *,
    cwd=None,
    env=None,
    log: Path | None = None,
    nested: bool = False,
    grace_s: float = TERM_GRACE_S,
) -> tuple[int, str]:
    """Run ``command`` and return (exit code, output); at ``timeout_s`` end it and every process
    below it. A timeout returns 124. Output goes to ``log`` when given (and is returned empty),
    else it is captured and returned.

    gpu_check's steps run in a session of their own (one process group), so the group's signal
    reaches every member. A step's own children (``nested``: first_run's ppo_step, DeepSpeed and
    convert children) stay in the step's group, where that signal reaches them too (in sessions of
    their own they outlived a killed step, holding the GPU). Each process started here dies with
    its parent (PR_SET_PDEATHSIG), as its own watchdog died with that parent. Processes that leave
    the group anyway (torchrun starts each worker in a session of its own) are found in /proc:
    at the limit all of them get SIGTERM at once, and SIGKILL ``grace_s`` later (torchrun waits
    up to 30 s for its workers before killing them itself)."""
    handle = open(log, "w", encoding="utf-8") if log is not None else subprocess.PIPE
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, text=True,
        start_new_session=not nested, preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        _end(proc, grace_s, own_group=not nested)
        output, _ = proc.communicate()
        rc = 124
    finally:
        if log is not None:
            handle.close()
    return rc, output or ""


def _end(proc: subprocess.Popen, grace_s: float, own_group: bool) -> None:
    """SIGTERM to ``proc``, its group (when it is its own) and its descendants; SIGKILL to what
    is left after ``grace_s``. The tree is read before the first signal: a parent that dies
    first hands its children to init, out of reach."""
    tree = [proc.pid, *descendants(proc.pid)]
    if own_group:  # members that /proc shows under another parent, or not yet
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    end_tree(proc.pid, grace_s, also=tree)
    if own_group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- the stack


def site_dir(output: Path) -> Path:
    """Where the setup step installs the wheelhouse (a folder of the run, on PYTHONPATH)."""
    return output / "site"


def install_wheelhouse(wheelhouse: Path, site: Path, timeout_s: float = 120) -> tuple[int, str]:
    """``pip install --no-index --no-deps`` of the locked wheels of ``wheelhouse`` into ``site``.

    Refused (exit 1, each problem named with its fix) when a locked wheel is missing or differs
    from ``benchmarks/gpu_wheelhouse.json``: a setup that installed nothing said "ok", and every
    later step then failed at ``import megatron.core``, minutes of device time gone."""
    from gpu_wheelhouse import load_lock, verify

    lock = load_lock()
    problems = verify(wheelhouse, lock)
    if problems:
        fix = (
            "build the wheelhouse here (python benchmarks/gpu_wheelhouse.py --build) and carry "
            f"{wheelhouse.name} with the tree, or pass --wheelhouse DIR"
        )
        return 1, "\n".join(f"error: setup: {p}" for p in problems) + f"\nerror: setup: {fix}"
    wheels = [str(wheelhouse / w["file"]) for w in lock["wheels"]]
    command = [
        PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", str(site), *wheels,
    ]  # fmt: skip
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, f"error: setup: pip install did not finish in {timeout_s:.0f} s"
    return (
        proc.returncode,
        f"installed {len(wheels)} wheels into {site}\n{proc.stdout}{proc.stderr}",
    )


def installed_distributions() -> dict[str, str]:
    """name -> version of every distribution this interpreter sees (names lower case, '-')."""
    from importlib.metadata import distributions

    return {d.metadata["Name"].lower().replace("_", "-"): d.version for d in distributions()}


def stack_problems(distributions: dict[str, str], torch_cuda: str | None) -> list[str]:
    """What is wrong with the installed stack for the GPU check (``distributions``: name ->
    version, names normalised to lower case with '-'): a CPU torch, a missing or mis-pinned
    required package, faiss-cpu beside faiss-gpu, a CUDA-specific package built for another CUDA
    major than torch's. Optional packages that are absent are not problems (their checks report
    "not on this machine")."""
    import re

    if torch_cuda is None:
        return ["torch has no CUDA build (torch.version.cuda is None): install a CUDA torch"]
    major = torch_cuda.split(".")[0]
    names = set(distributions)
    problems = []
    if "triton" not in names:
        problems.append("triton is not installed")
    core = distributions.get("megatron-core")
    if core is None:
        problems.append(
            "megatron-core is not installed: build the wheelhouse (python "
            "benchmarks/gpu_wheelhouse.py --build) and carry .whl, or pip install -e ."
        )
    elif core != MEGATRON_CORE_VERSION:
        problems.append(
            f"megatron-core {core} is installed; the project pins {MEGATRON_CORE_VERSION}"
        )
    faiss_gpu = [n for n in names if n.startswith("faiss-gpu")]
    if faiss_gpu and "faiss-cpu" in names:
        problems.append("faiss-cpu and faiss-gpu are both installed (both provide `faiss`)")
    for name in sorted(names):
        built = re.search(r"-cu(\d+)", name)
        if built and built.group(1) != major and name.split("-cu")[0] in (
            "transformer-engine", "faiss-gpu", "transformer-engine-torch",
        ):  # fmt: skip
            problems.append(f"{name} is built for CUDA {built.group(1)}, torch for CUDA {major}")
    return problems


def import_status(module: str) -> dict:
    """Whether ``module`` imports here: ``{"status": "ok" | NOT_ON_THIS_MACHINE | "FAILED",
    "detail": ...}``; a package that is installed but fails to import (a CUDA or ABI mismatch)
    is FAILED, never absent."""
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return {
                "status": NOT_ON_THIS_MACHINE,
                "detail": f"{module.split('.')[0]} not installed",
            }
        imported = importlib.import_module(module)
    except Exception as err:
        return {"status": "FAILED", "detail": f"{type(err).__name__}: {err}"}
    return {"status": "ok", "detail": getattr(imported, "__file__", "") or ""}


def stack_check(report_only: bool, output: Path | None) -> int:
    import torch

    import megatron_rlhf  # noqa: F401  (warnings filters, the kernels' finder)

    distributions = installed_distributions()
    problems = stack_problems(distributions, torch.version.cuda)
    imports = {}
    for module, (distribution, required, needed_by) in STACK.items():
        imports[module] = import_status(module) | {"required": required, "for": needed_by}
        status = imports[module]["status"]
        if status == "FAILED" or (required and status != "ok"):
            problems.append(
                f"import {module} ({distribution}): {status}: {imports[module]['detail']}"
            )
    for problem in problems:
        print(f"[gpu_check] stack: {problem}", file=sys.stderr)
    absent = [m for m, r in imports.items() if r["status"] == NOT_ON_THIS_MACHINE]
    print(f"[gpu_check] stack: torch {torch.__version__} CUDA {torch.version.cuda}, "
          f"{len(problems)} problem(s), not on this machine: {absent or 'none'}")  # fmt: skip
    if output is not None:
        record = {"torch_cuda": torch.version.cuda, "problems": problems, "imports": imports,
                  "distributions": distributions}  # fmt: skip
        write_json(output / "stack.json", record)
    return 0 if report_only or not problems else 1


# ----------------------------------------------------------------------------- the plan


def bare_image_plan(lock: dict) -> dict:
    """What runs on the bare image with the wheelhouse of ``lock`` installed: the first run's
    checks that find their optional module, those that report "not on this machine", and the
    bytes carried (the wheels; the tree is added by the caller)."""
    carried = {w["module"] for w in lock["wheels"] if w.get("module")}
    present = {"torch", "triton", "transformers", "megatron_rlhf.kernels"} | carried
    absent = {m for m in STACK if m not in present and m.split(".")[0] not in present}
    checks = {
        name: NOT_ON_THIS_MACHINE if module in absent else "runs"
        for name, module in FIRST_RUN_NEEDS.items()
    }
    return {
        "image": BARE_IMAGE,
        "wheels": [f"{w['name']}=={w['version']}" for w in lock["wheels"]],
        "wheelhouse_bytes": sum(w["bytes"] for w in lock["wheels"]),
        "not_on_this_machine": sorted(absent),
        "first_run_optional_checks": checks,
        "required_missing": sorted(m for m in absent if STACK[m][1]),
    }


def tree_bytes() -> int:
    """Bytes of the working tree that travels: git's tracked and untracked-not-ignored files."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if proc.returncode != 0:  # not a git checkout: every file under the repository
        return sum(
            p.stat().st_size for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts
        )
    return sum(
        (REPO / name).stat().st_size
        for name in proc.stdout.split("\0")
        if name and (REPO / name).is_file()
    )


# ----------------------------------------------------------------------------- running


def returned_problems(output: Path, bundle: Path | None, dry_run: bool) -> str | None:
    """Why the results would not come back from the device machine, or None. The device returns
    only what is written under ``$OUT`` (and few files of it): the bundle belongs there, the
    results folder (its ``site/`` alone holds thousands of files) outside it."""
    out = os.environ.get("OUT")
    if dry_run:
        return None
    if bundle is None:
        return "--bundle is required: the results come back as one file (--bundle $OUT/x.tar.gz)"
    bundle = bundle.resolve()
    if out:
        if not bundle.is_relative_to(Path(out).resolve()):
            return f"--bundle {bundle}: not under $OUT ({out}), which is all the device returns"
        if output.is_relative_to(Path(out).resolve()):
            return (
                f"--output-dir {output}: under $OUT, which returns few files (site/ alone holds "
                "thousands); put it outside (e.g. /tmp/gpu_check) and --bundle into $OUT"
            )
    elif bundle.is_relative_to(REPO):
        return (
            f"--bundle {bundle}: inside the working tree, which the device does not return; "
            "write it under $OUT (--bundle $OUT/gpu_check.tar.gz)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", help="the results folder (required)")
    parser.add_argument("--dry-run", action="store_true", help="check every step on the CPU")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--multi-gpu", action="store_true", help="then the >= 4-GPU checks")
    parser.add_argument(
        "--wheelhouse", default=str(REPO / ".whl"),
        help="wheels to install before the steps (benchmarks/gpu_wheelhouse.py --build)",
    )  # fmt: skip
    parser.add_argument(
        "--bundle", help="also write the results folder as this .tar.gz after every step"
    )
    parser.add_argument("--stack-only", action="store_true", help="only check the stack")
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    output = Path(args.output_dir).resolve() if args.output_dir else None
    if args.stack_only:
        return stack_check(args.report_only, output)
    if output is None:
        parser.error("--output-dir is required")
    if args.setup_only:
        rc, message = install_wheelhouse(Path(args.wheelhouse), site_dir(output))
        print(message)
        return rc
    if output.exists() and any(output.iterdir()) and not args.overwrite:
        print(f"error: {output}: exists and is not empty; pass --overwrite", file=sys.stderr)
        return 2
    if not args.dry_run and not _has_gpu():
        print("error: no CUDA GPU here; run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    where = returned_problems(output, Path(args.bundle) if args.bundle else None, args.dry_run)
    if where:
        print(f"error: {where}", file=sys.stderr)
        return 2
    output.mkdir(parents=True, exist_ok=True)
    become_subreaper()  # orphans of a step (a detached worker) stay ours to end after it
    site = site_dir(output)
    path = [str(site), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **TE_DEBUG_ENV)
    summary = {"mode": "dry-run" if args.dry_run else "gpu", "steps": {}}
    planned = steps(output) + (multi_gpu_steps() if args.multi_gpu else [])
    setup_args = ["--wheelhouse", args.wheelhouse]
    for step in planned:
        if step.name == "setup":
            step.command = [*step.command, *setup_args]
        if summary.get("stopped_after"):  # recorded as not run, so the summary lists every step
            summary["steps"][step.name] = {"ok": False, "seconds": 0.0, "not_run": True}
            continue
        record = dry_run(step, output, env) if args.dry_run else run(step, output, env)
        summary["steps"][step.name] = record
        if step.name in ("setup", "stack") and not args.dry_run:
            summary["environment"] = environment(env)
            if not record["ok"]:  # every later step needs the stack: fail here, loudly
                summary["stopped_after"] = step.name
                print(f"[gpu_check] {step.name} failed: the later steps are not run; see "
                      f"{output / record['log']}", file=sys.stderr)  # fmt: skip
        summary["te_attention_backends"] = te_backend_lines(output)
        write_json(output / "summary.json", summary)
        if args.bundle:
            bundle(output, Path(args.bundle))
        print(
            f"[gpu_check] {step.name:<10} {'ok' if record['ok'] else 'FAILED'} ({record['seconds']:.0f} s)",
            flush=True,
        )
    if args.dry_run:
        summary["bare_image"] = report_bare_image_plan(output)
    write_json(output / "summary.json", summary)
    if args.bundle:
        bundle(output, Path(args.bundle))
    failed = [n for n, r in summary["steps"].items() if not r["ok"] and not r.get("not_run")]
    not_run = [n for n, r in summary["steps"].items() if r.get("not_run")]
    print(f"[gpu_check] done: mode={summary['mode']} failed={failed} not run={not_run} "
          f"output_dir={output}")  # fmt: skip
    return 1 if failed else 0


def run(step: Step, output: Path, env: dict) -> dict:
    start = time.time()
    log = output / f"{step.name}.log"
    rc, _ = run_in_process_group(
        step.command, step.timeout_s, cwd=REPO, env=env, log=log, grace_s=step.grace_s
    )
    end_tree(os.getpid(), step.grace_s, reap=True)  # anything the step left, however detached
    text = log.read_text(errors="replace")
    if step.name == "plan" and rc == 0:  # keep the plan's JSON as a file of its own
        (output / "plan_176b_80gpus.json").write_text(text.split("\n[plan_parallelism]")[0])
    skipped = [line for line in text.splitlines() if line.startswith("SKIPPED")]
    unexplained = [line for line in skipped if NOT_ON_THIS_MACHINE not in line]
    if step.name == "gpu_tests" and rc == 0 and unexplained:
        rc = 1  # a GPU test that skips for another reason than an absent optional package
    return {
        "command": step.command,
        "rc": rc,
        "ok": rc == 0,
        "timed_out": rc == 124,
        "seconds": time.time() - start,
        "limit_s": step.timeout_s,
        "planned_s": step.planned_s,
        "log": log.name,
        "not_on_this_machine": [line for line in skipped if NOT_ON_THIS_MACHINE in line],
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
            rc, text = run_in_process_group(command, 300, cwd=REPO, env=env)
            end_tree(os.getpid(), TERM_GRACE_S, reap=True)
            handle.write(text)
            if rc != 0:
                problems.append(f"{' '.join(command[:3])}... exited {rc}")
            if "FAILED" in text and "gpu_first_run" in " ".join(command):
                problems.append("gpu_first_run --cpu reported a failed check")
            if "--collect-only" in command:
                collected = [line for line in text.splitlines() if "::test_" in line]
                if len(collected) < MIN_GPU_TESTS:
                    problems.append(
                        f"pytest -m gpu collected {len(collected)} tests, expected >= {MIN_GPU_TESTS}"
                    )
    problems += budget_problems(steps(output))
    return {
        "command": step.command,
        "ok": not problems,
        "problems": problems,
        "seconds": time.time() - start,
        "limit_s": step.timeout_s,
        "planned_s": step.planned_s,
        "log": log.name,
    }


def budget_problems(planned: list[Step]) -> list[str]:
    """The time plan against the device session: planned times, limits, and the worst case
    (every step at its limit, then its grace)."""
    problems = []
    if sum(s.planned_s for s in planned) > PLANNED_BUDGET_S:
        problems.append(f"the steps' planned times exceed {PLANNED_BUDGET_S} s")
    if sum(s.timeout_s for s in planned) > LIMIT_BUDGET_S:
        problems.append(f"the steps' time limits exceed {LIMIT_BUDGET_S} s")
    if sum(s.timeout_s + s.grace_s for s in planned) > WORST_CASE_BUDGET_S:
        problems.append(f"the steps' limits and graces exceed {WORST_CASE_BUDGET_S} s")
    return problems


def report_bare_image_plan(output: Path) -> dict:
    """Print and return the bare image's plan: steps, times, what is not on that machine, and
    the bytes carried (the wheelhouse from its lock file plus the working tree)."""
    lock = json.loads((REPO / "benchmarks" / "gpu_wheelhouse.json").read_text())
    plan = bare_image_plan(lock)
    plan["tree_bytes"] = tree_bytes()
    plan["carried_bytes"] = plan["tree_bytes"] + plan["wheelhouse_bytes"]
    plan["carry_limit_bytes"] = CARRY_LIMIT_BYTES
    planned = steps(output)
    plan["planned_s"] = sum(s.planned_s for s in planned)
    plan["limit_s"] = sum(s.timeout_s for s in planned)
    plan["worst_case_s"] = sum(s.timeout_s + s.grace_s for s in planned)
    plan["steps"] = {
        s.name: {"planned_s": s.planned_s, "limit_s": s.timeout_s, "grace_s": s.grace_s,
                 "compiles_up_front": s.compiles}
        for s in planned
    }  # fmt: skip
    mib = 2**20
    print(f"[gpu_check] bare image {plan['image']}: + wheelhouse {', '.join(plan['wheels'])}")
    print(f"[gpu_check] carried: wheelhouse {plan['wheelhouse_bytes'] / mib:.1f} MiB + tree "
          f"{plan['tree_bytes'] / mib:.1f} MiB = {plan['carried_bytes'] / mib:.1f} MiB of "
          f"{CARRY_LIMIT_BYTES / mib:.0f} MiB")  # fmt: skip
    for step in planned:
        print(f"[gpu_check]   {step.name:<10} planned {step.planned_s:>4} s, limit "
              f"{step.timeout_s:>4} s + {step.grace_s} s grace")  # fmt: skip
        if step.compiles:
            print(f"[gpu_check]   {'':<10} compiles up front: {step.compiles}")
    print(f"[gpu_check] total: planned {plan['planned_s']} s (<= {PLANNED_BUDGET_S}), limit "
          f"{plan['limit_s']} s (<= {LIMIT_BUDGET_S}), worst case with graces "
          f"{plan['worst_case_s']} s (<= {WORST_CASE_BUDGET_S}); {NOT_ON_THIS_MACHINE}: "
          f"{', '.join(plan['not_on_this_machine'])}")  # fmt: skip
    return plan


def te_backend_lines(output: Path) -> list[str]:
    """Transformer Engine's attention-backend lines (NVTE_DEBUG) from the step logs."""
    lines = []
    for log in sorted(output.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "DotProductAttention" in line and "backend" in line.lower() and line not in lines:
                lines.append(line.strip()[:300])
    return lines[:50]


def environment(env: dict) -> dict:
    """Versions as the steps see them (the wheelhouse on PYTHONPATH), and the GPU."""
    code = (
        "import json, torch, importlib.metadata as m\n"
        "d = {x.metadata['Name'].lower().replace('_', '-'): x.version for x in m.distributions()}\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "  'device': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',\n"
        "  'python': __import__('sys').version.split()[0], 'distributions': d}))"
    )
    try:
        proc = subprocess.run(
            [PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return {"error": "no answer in 60 s (a hung CUDA initialisation?)"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout)


def write_json(path: Path, data: dict) -> None:
    """``path`` replaced whole (a temporary name, then a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def bundle(output: Path, target: Path) -> None:
    """``output`` as one .tar.gz (the device returns at most 8 files), the site folder left out;
    written under a temporary name, then renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(output, arcname=output.name, filter=lambda t: None if "/site" in t.name else t)
    tmp.replace(target)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
