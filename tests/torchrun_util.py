"""The pytest side of the multi-rank tests: launch ``torchrun`` on the CPU and read the results.

A torchrun launch costs 10-15 s of imports on these machines, so a worker script
(``torchrun_harness.py``) runs many checks in one launch; :func:`run_checks` launches it and
merges what its ranks recorded into ``{check: {"ok": bool, "detail": str}}``, and tests are
parametrised over the check names (:func:`assert_check`). :func:`torchrun_command` and
:func:`launch_env` are for the tests that run a command itself under torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
OUTPUT_TAIL = 6000  # characters of each of stdout and stderr shown when a launch fails


def launch_env(**extra: str) -> dict:
    """The environment of a launched process: CPU only, one thread, tests/ and the repo
    importable."""
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


def torchrun_command(nproc: int, *target: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node nproc *target`` (a script and its arguments, or
    ``-m module ...``). ``--standalone``: the rendezvous binds a port the OS picks, so parallel
    launches never race for one (a free port picked here could be taken before torchrun binds
    it)."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--standalone", *target,
    ]  # fmt: skip


def launch(nproc: int, *target: str | Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``target`` on ``nproc`` ranks; raise with the workers' output if it fails or
    outlives ``timeout`` seconds (then every process of the launch is killed)."""
    command = torchrun_command(nproc, *map(str, target))
    proc = subprocess.Popen(
        command, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RuntimeError(f"{_named(target)} ran past {timeout} s:\n{_tail(out, err)}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{_named(target)} failed (rc={proc.returncode}):\n{_tail(out, err)}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def run_torchrun(script: str | Path, nproc: int, out_json: Path, *args: str, timeout: int = 900):
    """Launch a script that writes one JSON file on rank 0 (``--out out_json``); return it."""
    launch(nproc, script, "--out", out_json, *args, timeout=timeout)
    if not out_json.exists():
        raise RuntimeError(f"{script} exited 0 without writing {out_json}")
    return json.loads(out_json.read_text())


def run_checks(worker: str | Path, nproc: int, out_dir: Path, *args: str, timeout: int = 900):
    """Launch a ``torchrun_harness`` worker once; return its checks merged over the ranks."""
    # the worker's own watchdog fires first, so its stacks reach the output shown here
    hang = ["--hang-seconds", str(max(timeout - 30, 30))]
    proc = launch(nproc, worker, "--out", out_dir, *hang, *args, timeout=timeout)
    files = sorted(out_dir.glob("rank*.json"))
    if len(files) != nproc:
        raise RuntimeError(
            f"{len(files)} of {nproc} ranks wrote results:\n{_tail(proc.stdout, proc.stderr)}"
        )
    return merge_ranks({int(f.stem[4:]): json.loads(f.read_text()) for f in files})


def merge_ranks(per_rank: dict[int, dict]) -> dict[str, dict]:
    """One record per check: ok when every rank that recorded it passed; the detail of the
    failing ranks (else of every rank), each with its rank."""
    merged: dict[str, dict] = {}
    for name in dict.fromkeys(n for records in per_rank.values() for n in records):
        ranks = {rank: records[name] for rank, records in per_rank.items() if name in records}
        failed = {rank: r for rank, r in ranks.items() if not r["ok"]}
        shown = failed or ranks
        detail = " ".join(f"[rank {rank}] {r['detail']}" for rank, r in shown.items())
        merged[name] = {"ok": not failed, "detail": detail}
    return merged


def assert_check(results: dict[str, dict], name: str) -> None:
    """The check ``name`` ran and passed (else: its detail, or the checks that failed)."""
    if name not in results:
        failed = {n: r["detail"] for n, r in results.items() if not r["ok"]}
        raise AssertionError(f"the worker did not record {name}; failed: {failed}")
    assert results[name]["ok"], results[name]["detail"]


def _named(target) -> str:
    return "torchrun " + " ".join(map(str, target[:2]))


def _tail(out: str, err: str) -> str:
    return f"{out[-OUTPUT_TAIL:]}\n{err[-OUTPUT_TAIL:]}"
