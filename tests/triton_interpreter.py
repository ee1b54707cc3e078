"""Running Triton kernels under ``TRITON_INTERPRET=1`` from the test suite.

Triton reads that variable when a kernel is decorated, so a test file re-runs itself (or a
benchmark's ``--smoke``) in a subprocess with it set; the subprocess runs named checks, each with
a fresh recorded seed, and writes their results as JSON for the parent's tests to report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def run_python(args: list[str], quiet: bool = True) -> subprocess.CompletedProcess:
    """``python *args`` on the CPU under the interpreter, with this checkout first on the path."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    if quiet:
        env["PYTHONWARNINGS"] = "ignore"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=600
    )


def interpreter_results(script: str, out: Path, quiet: bool = True) -> dict:
    """Run ``script --out out`` under the interpreter; its checks' results."""
    proc = run_python([script, "--out", str(out)], quiet)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"interpreter run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def run_checks(checks: dict[str, Callable[[torch.Generator], str]], out: Path) -> None:
    """Each check with a generator of a fresh seed; ``{name: {ok, detail}}`` written to ``out``."""
    results = {}
    for name, check in checks.items():
        seed = torch.seed() % 2**31
        try:
            detail = check(torch.Generator().manual_seed(seed))
            results[name] = {"ok": True, "detail": f"seed {seed}: {detail}"}
        except Exception:  # recorded for the parent test to report
            results[name] = {
                "ok": False,
                "detail": f"seed {seed}: {traceback.format_exc()[-3000:]}",
            }
    out.write_text(json.dumps(results, indent=1))
