"""The one-GPU script stays runnable without a GPU: its dry run checks every step it would take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_gpu_check_dry_run_passes(tmp_path):
    out = tmp_path / "gpu_check"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    bundle = tmp_path / "returned" / "gpu_check.tar.gz"  # the device returns few files
    cmd = [sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--output-dir", str(out),
           "--bundle", str(bundle)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "dry-run"
    assert list(summary["steps"]) == [
        "setup",
        "stack",
        "first_run",
        "gpu_tests",
        "kernels",
        "attention",
        "scaling",
        "plan",
    ]
    assert all(step["ok"] and not step["problems"] for step in summary["steps"].values())
    first_run = json.loads((out / "first_run_cpu" / "first_run.json").read_text())
    assert {name: r["status"] for name, r in first_run.items()} == {
        "load_train_step": "ok", "save_strict_load": "ok", "logits_bf16": "needs a GPU",
        "logits_te": "needs a GPU", "triton_logprobs": "needs a GPU", "generate": "ok",
        "ppo_step": "ok", "faiss_kmeans": "needs a GPU", "deepspeed_zero2": "needs a GPU",
        "vllm_reload": "needs a GPU", "megatron_to_hf": "ok", "mfu_560m": "ok",
    }  # fmt: skip
    # The plan for the machine this project is lent: a bare CUDA image plus the wheelhouse.
    bare = summary["bare_image"]
    assert bare["required_missing"] == []
    assert bare["carried_bytes"] == bare["tree_bytes"] + bare["wheelhouse_bytes"]
    assert bare["carried_bytes"] <= 64 * 2**20
    assert bare["planned_s"] <= 300 and bare["limit_s"] <= 8 * 60
    assert bare["worst_case_s"] <= 10 * 60
    assert "compiles up front: before the budget's clock" in proc.stdout
    assert bare["first_run_optional_checks"] == {
        "logits_te": "not on this machine", "faiss_kmeans": "not on this machine",
        "deepspeed_zero2": "runs", "vllm_reload": "not on this machine",
    }  # fmt: skip
    assert "carried: wheelhouse" in proc.stdout and "MiB of 64 MiB" in proc.stdout
    import tarfile

    with tarfile.open(bundle) as tar:
        names = tar.getnames()
    assert "gpu_check/summary.json" in names and "gpu_check/first_run_cpu/first_run.json" in names
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
    from megatron_rlhf.planner.sweep import main

    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gpu_stack_problems_name_what_to_fix():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import stack_problems

    bare = {"torch": "2.11.0", "triton": "3.6.0", "megatron-core": "0.16.1"}
    assert stack_problems(bare, "13.0") == []  # TE, faiss-gpu, vLLM absent: not problems
    good = {**bare, "transformer-engine-cu12": "2.20", "faiss-gpu-cu12": "1.14"}
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
    assert "triton is not installed" in missing
    assert any(
        p.startswith("megatron-core is not installed: build the wheelhouse") for p in missing
    )
    assert stack_problems({**bare, "megatron-core": "0.17.0"}, "13.0") == [
        "megatron-core 0.17.0 is installed; the project pins 0.16.1"
    ]
    both = stack_problems({**good, "faiss-cpu": "1.15"}, "12.4")
    assert both == ["faiss-cpu and faiss-gpu are both installed (both provide `faiss`)"]


# A step like first_run: it runs a child the way first_run does (nested), and that child starts a
# grandchild in a session of its own (as torchrun starts its workers); each writes its pid.
NESTED_STEP = """
import subprocess, sys, time
sys.path.insert(0, {benchmarks!r})
from gpu_check import run_in_process_group
grandchild = (
    "import os, time; open({pids!r} + '/grandchild', 'w').write(str(os.getpid())); time.sleep(120)"
)
child = (
    "import os, subprocess, sys, time\\n"
    f"open({pids!r} + '/child', 'w').write(str(os.getpid()))\\n"
    f"subprocess.Popen([sys.executable, '-c', {{grandchild!r}}], start_new_session=True)\\n"
    "time.sleep(120)\\n"
)
open({pids!r} + "/step", "w").write(str(__import__("os").getpid()))
run_in_process_group([sys.executable, "-c", child], 300, nested=True)
"""
# A torchrun worker that takes argv[2] seconds to stop after SIGTERM (a CUDA or NCCL teardown):
# torchrun waits for it, and a launcher SIGKILLed before then leaves it running in its own session.
TORCHRUN_WORKER = """
import os, signal, sys, time
def stop(*_):
    open(sys.argv[1] + "/worker_got_sigterm", "w").close()
    time.sleep(float(sys.argv[2]))
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + "/worker", "w").write(str(os.getpid()))
time.sleep(120)
"""
# Its times, scaled down from the GPU's (a worker that takes 20 s to stop, torchrun's 30 s wait,
# TORCHRUN_GRACE_S = 35, which test_the_plan_fits_a_device_session... checks) so that the
# launcher is SIGKILLed while its worker is still stopping: the worker takes longer than the
# grace and the polling below together, so only a SIGKILL that reaches it in its own session
# ends it in time. Both start in ~1 s; the limit leaves room for a loaded machine.
WORKER_STOP_S, WORKER_GRACE_S, TORCHRUN_LIMIT_S = 60, 2, 8


@pytest.mark.launch(ranks=1)  # launches Python, and torchrun with one worker
@pytest.mark.parametrize("kind", ["nested", "torchrun"])
def test_a_step_past_its_limit_leaves_no_process(tmp_path, kind):
    """A step's children must not outlive its limit holding the GPU. first_run's children ran in
    sessions of their own and torchrun's workers do, so killing the step's process group missed
    them; and torchrun was SIGKILLed 10 s after SIGTERM while it waits up to 30 s for its
    workers. Here a step times out with a grandchild in another session (or a torchrun worker
    that takes longer than the grace to stop) alive, and afterwards none of its processes is
    running."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import TORCHRUN_GRACE_S, run_in_process_group

    pids = tmp_path / "pids"
    pids.mkdir()
    if kind == "nested":
        step = NESTED_STEP.format(benchmarks=str(REPO / "benchmarks"), pids=str(pids))
        command, expected, limit = [sys.executable, "-c", step], {"step", "child", "grandchild"}, 8
        grace = TORCHRUN_GRACE_S  # the nested step's processes stop at once
    else:
        worker = tmp_path / "worker.py"
        worker.write_text(TORCHRUN_WORKER)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "1", str(worker), str(pids), str(WORKER_STOP_S)]  # fmt: skip
        expected, limit, grace = {"worker"}, TORCHRUN_LIMIT_S, WORKER_GRACE_S
    start = time.monotonic()
    rc, _ = run_in_process_group(command, limit, log=tmp_path / "log", grace_s=grace)
    assert rc == 124
    if kind == "torchrun":  # SIGTERM first: the grace is for an orderly stop
        assert (pids / "worker_got_sigterm").exists()
        (pids / "worker_got_sigterm").unlink()
    started = {path.name: int(path.read_text()) for path in pids.iterdir()}
    assert set(started) == expected, f"not all started within {limit} s: {started}"
    for _ in range(50):  # orphans are reaped by init shortly after
        if all(_proc_state(pid) == "Z" for pid in started.values()):
            break
        time.sleep(0.1)
    assert {name: _proc_state(pid) for name, pid in started.items()} == dict.fromkeys(started, "Z")
    killed = 5 if kind == "torchrun" else 0  # end_tree waits up to 5 s for a SIGKILL to land
    assert time.monotonic() - start < limit + grace + killed


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def test_wheelhouse_lock_pins_what_the_bare_image_lacks():
    """Every wheel is pinned with a hash (built wheels: their sdist's), fits the carry limit with
    room for the tree, and covers megatron-core and DeepSpeed's own requirements."""
    lock = json.loads((REPO / "benchmarks" / "gpu_wheelhouse.json").read_text())
    names = {w["name"]: w for w in lock["wheels"]}
    assert names["megatron-core"]["version"] == "0.16.1"
    assert names["deepspeed"]["version"] == "0.19.8"
    assert {"hjson", "pydantic", "pydantic-core"} <= set(names)
    for wheel in lock["wheels"]:
        assert len(wheel.get("sha256") or wheel["sdist_sha256"]) == 64
        assert wheel["file"].endswith(".whl") and wheel["version"] in wheel["file"]
        assert "cp312" in wheel["file"] or "py3-none-any" in wheel["file"]
    assert sum(w["bytes"] for w in lock["wheels"]) < 16 * 2**20


@pytest.mark.launch  # launches Python
def test_a_bare_copy_of_the_tree_imports_its_own_kernels(tmp_path):
    """The GPU machine gets a copy of the working tree, not an install: with PYTHONPATH at the
    copy, ``megatron_rlhf.kernels`` must be the copy's ``kernels/fused/`` (it raised
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
        str(tmp_path / "kernels" / "fused" / "__init__.py"),
        str(tmp_path / "kernels" / "fused" / "logprobs.py"),
    ]  # fmt: skip


def test_setup_refuses_a_wheelhouse_without_the_locked_wheels(tmp_path):
    """A setup with no wheels said "nothing installed" and exited 0; every later step then failed
    at ``import megatron.core``. Each missing locked wheel is named, with the fix."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import install_wheelhouse

    lock = json.loads((REPO / "benchmarks" / "gpu_wheelhouse.json").read_text())
    wheelhouse = tmp_path / "whl"
    wheelhouse.mkdir()
    rc, message = install_wheelhouse(wheelhouse, tmp_path / "site")
    assert rc == 1 and not (tmp_path / "site").exists()
    for wheel in lock["wheels"]:
        assert f"{wheelhouse / wheel['file']}: missing" in message
    assert "python benchmarks/gpu_wheelhouse.py --build" in message


def test_results_go_where_the_device_returns_them(tmp_path, monkeypatch):
    """The device returns only ``$OUT``: the documented ``--bundle results/...`` was written in
    the tree and lost; a results folder under ``$OUT`` has too many files to come back."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import returned_problems

    out, work = tmp_path / "out", tmp_path / "work"
    monkeypatch.delenv("OUT", raising=False)
    assert "inside the working tree" in returned_problems(
        work, REPO / "results" / "b.tar.gz", False
    )
    assert "--bundle is required" in returned_problems(work, None, False)
    assert returned_problems(work, None, True) is None  # a dry run returns nothing
    monkeypatch.setenv("OUT", str(out))
    assert "not under $OUT" in returned_problems(work, tmp_path / "b.tar.gz", False)
    assert "under $OUT, which returns few files" in returned_problems(
        out / "work", out / "b.tar.gz", False
    )
    assert returned_problems(work, out / "gpu_check.tar.gz", False) is None


@pytest.mark.launch  # launches Python (the setup step and the environment probe)
def test_a_failed_setup_stops_the_run_and_the_bundle_comes_back(tmp_path):
    """Setup fails on an empty wheelhouse, no later step runs (each is listed as not run), and
    the summary still reaches the bundle under ``$OUT``. gpu_check runs in a process of its own
    (it makes itself a subreaper and ends what its steps leave), told it has a GPU."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "whl").mkdir()
    argv = ["--output-dir", str(tmp_path / "work"), "--wheelhouse", str(tmp_path / "whl"),
            "--bundle", str(out / "gpu_check.tar.gz")]  # fmt: skip
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); import gpu_check\n"
        "gpu_check._has_gpu = lambda: True  # this machine has none\n"
        f"sys.exit(gpu_check.main({argv!r}))\n"
    )
    env = dict(os.environ, OUT=str(out))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "setup failed: the later steps are not run" in proc.stderr
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert summary["stopped_after"] == "setup"
    assert summary["steps"]["setup"]["ok"] is False and summary["steps"]["setup"]["rc"] == 1
    later = [name for name in summary["steps"] if name != "setup"]
    assert later == ["stack", "first_run", "gpu_tests", "kernels", "attention", "scaling", "plan"]
    assert all(summary["steps"][name].get("not_run") for name in later)
    assert "missing" in (tmp_path / "work" / "setup.log").read_text()
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        assert "work/summary.json" in tar.getnames()


def test_the_plan_fits_a_device_session_and_names_what_it_compiles_first(tmp_path):
    """15 device-minutes hold a machine start (1-3 min), the planned run and a targeted rerun:
    the plan is <= 300 s (it was 325 s, with the attention step's budget spent on compiles);
    every step that times or budgets Triton kernels names the compiles it does first, and the
    attention step's limit holds its imports, compiles and budget."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import budget_problems, steps

    planned = {step.name: step for step in steps(tmp_path)}
    assert budget_problems(list(planned.values())) == []
    assert sum(step.planned_s for step in planned.values()) <= 300
    assert "8,704" in planned["first_run"].compiles  # the timed log-prob call's own shape
    assert "D=128" in planned["attention"].compiles and "8/14" in planned["attention"].compiles
    assert "untimed" in planned["kernels"].compiles
    attention = planned["attention"]
    budget = float(attention.command[attention.command.index("--budget-s") + 1])
    assert 8 + 20 + budget + 10 <= attention.timeout_s  # imports, compiles, budget, last size
    assert planned["scaling"].grace_s >= 35  # torchrun waits 30 s for its workers
