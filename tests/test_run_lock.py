"""One run per output directory (issue 24, item 2).

A second run on a directory in use exits 2 naming the holder (host, pid, start time) and writes
nothing; a lock left by a killed run on this host is stale and taken over; one from another host
is refused with the command that clears it; the first run's files equal a solo run's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint_safety import reward_argv, reward_setup  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[1]
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
HOLD = """
import multiprocessing, sys, time
from megatron_rlhf.runtime import locks
from megatron_rlhf.runtime.processes import forks_die_with_parent
locks.acquire(sys.argv[1])
fork = multiprocessing.get_context("fork")
with forks_die_with_parent():  # as checkpoint saves fork Megatron's writers
    dies = fork.Process(target=time.sleep, args=(120,))
    dies.start()
orphan = fork.Process(target=time.sleep, args=(120,))  # e.g. a data-loader worker
orphan.start()
print("held", dies.pid, orphan.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def child_env() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    for key in DIST_ENV:
        env.pop(key, None)
    return env


def snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.launch
def test_a_second_run_on_a_locked_directory_exits_2_naming_the_holder(
    reward_setup,  # noqa: F811
    tmp_path,
    capsys,
):
    from megatron_rlhf.reward.train import main

    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], env=child_env(), stdout=subprocess.PIPE, text=True
    )
    orphan = None
    try:
        word, dies, orphan = holder.stdout.readline().split()
        dies, orphan = int(dies), int(orphan)
        assert word == "held"
        before = snapshot(tmp_path)
        assert main(reward_argv(reward_setup, run, steps=1)) == 2
        err = capsys.readouterr().err
        line = [x for x in err.splitlines() if x.startswith("train-reward: error:")]
        assert len(line) == 1 and "Traceback" not in err, err
        assert f"train.output_dir={run}: another run is using this directory" in line[0]
        assert f"host {socket.gethostname()}, pid {holder.pid}, started 20" in line[0]
        assert "choose another train.output_dir" in line[0]
        assert snapshot(tmp_path) == before  # nothing written, the holder's record untouched
        holder.kill()
        holder.wait()
        # A child forked inside forks_die_with_parent dies with the holder; one forked outside
        # lives on, orphaned, but closed its copy of the lock's descriptor at the fork.
        deadline = time.monotonic() + 10
        while alive(dies) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(dies)
        assert alive(orphan)
        # The kernel dropped the killed holder's lock; its record is stale and taken over.
        assert main(reward_argv(reward_setup, run, steps=1)) == 0
    finally:
        holder.kill()
        holder.wait()
        if orphan is not None and alive(orphan):
            os.kill(orphan, signal.SIGKILL)
    err = capsys.readouterr().err
    assert f"{run / '.run.lock'}: stale lock, held by no process on this host" in err
    assert f"pid {holder.pid}" in err
    assert not (run / ".run.lock").exists()  # released at the end of the run


def test_a_record_from_another_host_is_refused_with_how_to_clear_it(tmp_path):
    from megatron_rlhf.runtime import locks
    from megatron_rlhf.utils import InputError

    (tmp_path / ".run.lock").write_text(
        json.dumps({"host": "node-17", "pid": 4242, "started": "2026-01-01T00:00:00+00:00"})
    )
    with pytest.raises(InputError, match=r"another host \(host node-17, pid 4242, started 2026"):
        locks.acquire(tmp_path)
    with pytest.raises(InputError, match=rf"clear the lock with `rm {tmp_path / '.run.lock'}`"):
        locks.acquire(tmp_path)
    (tmp_path / ".run.lock").unlink()
    locks.acquire(tmp_path)
    locks.acquire(tmp_path)  # held by this process already: a no-op
    assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == os.getpid()
    locks.release()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.chaos
def test_concurrent_launches_one_runs_the_other_exits_2(reward_setup, tmp_path):  # noqa: F811
    """Two launches on one directory: the first is stopped (SIGSTOP) while it holds the lock,
    the second runs to its end meanwhile (exit 2, the holder named), the first resumes and
    finishes; its files equal those of a solo run in the same directory byte for byte."""
    run, env = tmp_path / "run", child_env()
    command = [sys.executable, "-m", "megatron_rlhf", "train-reward"]
    argv = [*reward_argv(reward_setup, run, steps=3), "train.log_interval=1"]
    solo = subprocess.run([*command, *argv], env=env, capture_output=True, text=True)
    assert solo.returncode == 0, solo.stderr[-3000:]
    run.rename(tmp_path / "solo")

    first = subprocess.Popen([*command, *argv], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / ".run.lock").exists() or not (run / ".run.lock").read_text():
        assert time.time() < deadline and first.poll() is None, "the first run never locked"
        time.sleep(0.01)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = subprocess.run([*command, *argv], env=env, capture_output=True, text=True)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    assert f"another run is using this directory (host {socket.gethostname()}, " in second.stderr
    assert f"pid {first.pid}, started " in second.stderr

    def files(root: Path) -> dict:
        """Every file but TensorBoard's (wall-clock stamps) and metrics.jsonl (timings); left
        out too: Python's and numpy's global RNG states (nothing seeds or uses them), torch's per-save id in
        ``.metadata``, and their hashes."""
        from megatron_rlhf.checkpoint.safe_pickle import load_metadata

        kept = {}
        for name, data in snapshot(root).items():
            if name.startswith("tensorboard") or name == "metrics.jsonl":
                continue
            if "/rank_state/" in name:
                rng = {**json.loads(data)["rng"], "python": None, "numpy": None}
                data = {**json.loads(data), "rng": rng}
            elif name.endswith(".metadata"):
                data = load_metadata(root / name)
                data.storage_meta = None
            elif name.endswith("manifest.json"):
                listed = json.loads(data)["files"].items()
                data = {k: v for k, v in listed if not k.startswith(("rank_state/", ".metadata"))}
            kept[name] = data
        return kept

    def metrics(root: Path) -> list[dict]:
        rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
        return [
            {k: v for k, v in r.items() if "/time/" not in k and "per_s" not in k} for r in rows
        ]

    assert files(run) == files(tmp_path / "solo")
    assert metrics(run) == metrics(tmp_path / "solo")
    assert [r["step"] for r in metrics(run) if "train/loss" in r] == [1, 2, 3]


@pytest.mark.launch
def test_without_flock_the_record_alone_guards_the_directory(tmp_path, monkeypatch, capsys):
    import errno

    from megatron_rlhf.runtime import locks
    from megatron_rlhf.utils import InputError

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(locks.fcntl, "flock", no_flock)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"host": socket.gethostname(), "pid": alive.pid, "started": "2026-01-01"}
        (tmp_path / ".run.lock").write_text(json.dumps(record))
        with pytest.raises(InputError, match=rf"another run is using .*pid {alive.pid}, started"):
            locks.acquire(tmp_path)
    finally:
        alive.kill()
        alive.wait()
    locks.acquire(tmp_path)  # its pid is gone now: stale, taken over
    err = capsys.readouterr().err
    assert "does not support flock (Function not implemented)" in err
    assert f"stale lock, held by no process on this host (host {socket.gethostname()}" in err
    assert json.loads((tmp_path / ".run.lock").read_text())["pid"] == os.getpid()
    locks.release()
    assert not (tmp_path / ".run.lock").exists()
