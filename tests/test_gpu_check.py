"""The one-GPU script stays runnable without a GPU: its dry run checks every step it would take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_passes(tmp_path):
    out = tmp_path / "gpu_check"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry-run"
    assert list(summary["steps"]) == [
        "stack",
        "first_run",
        "gpu_tests",
        "kernels",
        "scaling",
        "plan",
    ]
    assert all(step["ok"] and not step["problems"] for step in summary["steps"].values())
    first_run = json.loads((out / "first_run_cpu" / "first_run.json").read_text())
    assert {name: r["status"] for name, r in first_run.items()} == {
        "load_train_step": "ok", "save_strict_load": "ok", "logits_te_fallback": "needs a GPU",
        "triton_logprobs": "needs a GPU", "generate": "ok", "ppo_step": "ok",
        "faiss_kmeans": "needs a GPU", "deepspeed_zero2": "needs a GPU", "megatron_to_hf": "ok",
        "mfu_560m": "ok",
    }  # fmt: skip
    collected = (out / "gpu_tests.dry-run.log").read_text()
    assert collected.count("tests/test_gpu.py::test_") >= 4
    # Without a GPU the real run refuses with a one-line error instead of failing half-way.
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--output-dir", str(tmp_path / "real")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "tiny", "--layouts", "2"], "expected TPxPP"),
        (["--sizes", "tiny", "--layouts", "2x1", "--nproc", "1"], "needs tp*pp to divide"),
        (["--sizes", "bloom-2b"], "neither a BLOOM preset"),
        ([], "give --sizes"),
        (["--sizes", "tiny", "--micro-batch", "0"], "--micro-batch must be >= 1"),
    ],
)
def test_scaling_study_bad_input(tmp_path, capsys, argv, message):
    from megatron_rlhf.planning.tools.sweep import main

    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gpu_stack_problems_name_what_to_fix():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import stack_problems

    good = {"transformer-engine-cu12": "2.20", "triton": "3.9", "faiss-gpu-cu12": "1.14"}
    assert stack_problems(good, "12.8") == []
    assert stack_problems(good, None) == [
        "torch has no CUDA build (torch.version.cuda is None): install a CUDA torch"
    ]
    mismatched = stack_problems(good, "13.0")
    assert any(
        "transformer-engine-cu12 is built for CUDA 12, torch for CUDA 13" in p for p in mismatched
    )
    assert any("faiss-gpu-cu12 is built for CUDA 12" in p for p in mismatched)
    missing = stack_problems({"faiss-cpu": "1.15"}, "13.0")
    assert "transformer-engine is not installed: pip install -e '.[gpu-cu13]'" in missing
    assert "triton is not installed" in missing
    assert "faiss-gpu is not installed: pip install -e '.[gpu-cu13]'" in missing
    both = stack_problems({**good, "faiss-cpu": "1.15"}, "12.4")
    assert both == ["faiss-cpu and faiss-gpu are both installed (both provide `faiss`)"]


def test_a_bare_copy_of_the_tree_imports_its_own_kernels(tmp_path):
    """The GPU machine gets a copy of the working tree, not an install: with PYTHONPATH at the
    copy, ``megatron_rlhf.kernels`` must be the copy's top-level ``kernels/`` (it raised
    ModuleNotFoundError there, and here an editable install answered with another tree's)."""
    import shutil

    for name in ("megatron_rlhf", "kernels"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "setup.py", tmp_path)
    code = (
        "import megatron_rlhf.kernels as k, megatron_rlhf.kernels.logprobs as l; "
        "print(k.__file__); print(l.__file__)"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        str(tmp_path / "kernels" / "__init__.py"), str(tmp_path / "kernels" / "logprobs.py"),
    ]  # fmt: skip
