"""Save on a signal, leave nothing behind (issue 24, items 1 and 6).

- ``train.exit_signals`` are parsed and caught; the per-step agreement returns the signal.
- train-reward (1 rank): SIGTERM at a random step (a second one during the save) -> exit 75,
  a checkpoint of the last completed step; relaunched, every logged number and the final
  checkpoint's tensors equal the uninterrupted run's bit for bit; no process of the run is left.
- Killing the trainer itself (SIGKILL, not its process group) leaves no child behind.
- train-ppo on 4 ranks with per-role layouts, asynchronous (one step stale: every checkpoint
  holds a rollout in flight), and train-reward on DeepSpeed ZeRO-3 on 2 ranks, one chaos
  sequence each: SIGTERM to every worker at a random step -> checkpoint, relaunch; SIGKILL of
  the launcher and every worker after a random later checkpoint -> relaunch: the end is
  bit-for-bit the uninterrupted run's, and no process is left at any stop.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from test_checkpoint_integrity import is_wall_clock
from test_checkpoint_safety import reward_argv, reward_setup  # noqa: F401  (fixture)
from torchrun_util import launch_env, torchrun_command

REPO = Path(__file__).resolve().parents[1]
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
EXIT_SAVED_ON_SIGNAL = 75


def run_env(marker: str, threads: int | None = None) -> dict:
    """The environment of a launched run; ``marker`` lets us find every process it started."""
    env = launch_env(I24_RUN=marker, OMP_NUM_THREADS=str(threads or torch.get_num_threads()))
    for key in DIST_ENV:
        env.pop(key, None)
    return env


def processes_of(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("I24_RUN") == marker:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def wait_gone(marker: str, seconds: float = 10.0) -> list[psutil.Process]:
    deadline = time.time() + seconds
    while time.time() < deadline and processes_of(marker):
        time.sleep(0.1)
    return processes_of(marker)


def logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(
        1
        for line in path.read_text().splitlines()
        if '"train/loss"' in line or "reward/mean" in line
    )


def metrics(run: Path) -> list[dict]:
    """metrics.jsonl without wall-clock figures."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not is_wall_clock(k)} for row in rows]


def shards(checkpoint: Path) -> dict[str, bytes]:
    """The tensors of a checkpoint: torch_dist shards, or the HF model of backend=deepspeed."""
    files = [*checkpoint.glob("*.distcp"), *checkpoint.glob("*.safetensors")]
    return {p.name: p.read_bytes() for p in sorted(files)}


def test_exit_signals_are_parsed_caught_and_agreed():
    from megatron_rlhf.training.signals import ExitSignals, parse_signals
    from megatron_rlhf.utils import InputError

    assert parse_signals(["SIGTERM", "usr1", 12]) == [
        signal.SIGTERM,
        signal.SIGUSR1,
        signal.SIGUSR2,
    ]
    with pytest.raises(InputError, match=r"train.exit_signals: 'SIGFOO' is not a signal"):
        parse_signals(["SIGFOO"])
    with pytest.raises(InputError, match="SIGKILL cannot be caught"):
        parse_signals(["KILL"])
    before = signal.getsignal(signal.SIGUSR1)
    signals = ExitSignals(["SIGUSR1"])
    try:
        assert signals.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
        assert signals.agreed() == signal.SIGUSR1
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_the_slurm_template_asks_for_the_signal_ahead_of_the_time_limit():
    text = (REPO / "examples/ppo/launch_176b_slurm.sbatch").read_text()
    assert "#SBATCH --signal=USR1@" in text
    # torchrun ignores it; the workers save and exit 75
    assert """srun bash -c 'trap "" USR1; exec "$@"'""" in text


def run_to_end(
    command: list[str], marker: str, threads: int | None = None
) -> subprocess.CompletedProcess:
    """Run a training command to its end (it must succeed); its processes carry ``marker``."""
    done = subprocess.run(command, env=run_env(marker, threads), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def launch_until_step(command, run: Path, target: int, env: dict, timeout: float = 300):
    """Start ``command`` (its output piped) and return the process once ``run`` has logged step
    ``target``."""
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + timeout
    while logged_steps(run) < target:
        assert proc.poll() is None and time.time() < deadline, "the run ended before the signal"
        time.sleep(0.01)
    return proc


@pytest.mark.chaos
def test_sigterm_at_a_random_step_saves_and_the_resumed_run_is_bit_identical(
    reward_setup,  # noqa: F811
    tmp_path,
):
    steps = 8
    argv = reward_argv(reward_setup, tmp_path / "x", steps)  # logs every step
    argv = [a for a in argv if not a.startswith(("train.output_dir", "train.save_interval"))]
    argv.append("train.save_interval=100")  # only the signal (and the end) save
    command = [sys.executable, "-m", "megatron_rlhf", "train-reward", *argv]
    reference, run = tmp_path / "reference", tmp_path / "run"
    marker = uuid.uuid4().hex
    run_to_end([*command, f"train.output_dir={reference}"], marker)

    target = random.Random(os.getpid()).randint(1, steps - 3)
    proc = launch_until_step([*command, f"train.output_dir={run}"], run, target, run_env(marker))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # a second signal, during the step or the save
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_SAVED_ON_SIGNAL, err[-3000:]
    stopped = logged_steps(run)
    assert target <= stopped < steps, (target, stopped)
    assert (run / "latest_checkpoint.txt").read_text().strip() == f"step_{stopped:07d}"
    assert f"stopped by SIGTERM after step {stopped}; checkpoint" in err
    assert "SIGTERM again: already stopping" in err
    assert "stopped_by=SIGTERM" in out + err
    assert wait_gone(marker) == [], "a process of the run outlived it"

    resumed = run_to_end([*command, f"train.output_dir={run}"], marker)
    assert f"resumed from {run / f'step_{stopped:07d}'}" in resumed.stderr
    assert metrics(run) == metrics(reference)
    final = f"step_{steps:07d}"
    assert shards(run / final) and shards(run / final) == shards(reference / final)
    assert wait_gone(marker) == []


@pytest.mark.chaos
def test_killing_the_trainer_leaves_no_child_behind(reward_setup, tmp_path):  # noqa: F811
    """Megatron's checkpoint writer keeps a forked Manager process; SIGKILL of the trainer
    alone (not its process group, as an OOM killer would) must take it down too."""
    argv = [*reward_argv(reward_setup, tmp_path / "run", 200), "train.save_interval=1"]
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rlhf", "train-reward", *argv], env=run_env(marker),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    while not (tmp_path / "run" / "latest_checkpoint.txt").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "expected the checkpoint writer's Manager process"
    proc.kill()
    proc.wait()
    assert wait_gone(marker) == [], "a child of the killed trainer is still alive"


PPO_LAYOUTS = [
    "parallel.actor.tp=2", "parallel.actor.pp=2", "parallel.critic.tp=2",
    "parallel.rollout.tp=2", "parallel.rollout.pp=1",
]  # fmt: skip


def torchrun(nproc: int, *args: str) -> list[str]:
    return torchrun_command(nproc, "-m", "megatron_rlhf", *args)


def interrupt(command, run: Path, steps: int, marker: str, seed: int, nproc: int) -> int:
    """Launch ``command``; once a random step is logged, SIGTERM every worker (as Slurm does,
    a few ms apart); check the save and that nothing is left. Returns the step it stopped at."""
    target = random.Random(seed).randint(1, steps - 3)
    proc = launch_until_step(command, run, target, run_env(marker, threads=1), timeout=500)
    workers = psutil.Process(proc.pid).children()
    assert len(workers) == nproc
    for worker in workers:
        worker.send_signal(signal.SIGTERM)
        time.sleep(random.Random(worker.pid).uniform(0, 0.05))
    out, err = proc.communicate(timeout=500)
    stopped = logged_steps(run)
    assert target <= stopped < steps - 1, (target, stopped, err[-3000:])
    assert (run / "latest_checkpoint.txt").read_text().strip() == f"step_{stopped:07d}", err[-3000:]
    assert f"stopped by SIGTERM after step {stopped}" in err
    assert "exitcode  : 75" in err  # torchrun's report of its workers' exit code
    assert wait_gone(marker) == [], "a process of the run outlived it"
    return stopped


def resume_and_kill(command, run: Path, stopped: int, steps: int, marker: str, seed: int) -> int:
    """Relaunch ``command`` (a checkpoint every step) on the stopped run; once it has resumed
    from ``stopped`` and saved a random later step, SIGKILL the launcher and every worker;
    check nothing is left. Returns the step of the last checkpoint."""
    target = random.Random(seed).randint(stopped + 1, steps - 1)
    log = run.with_name(run.name + "_killed.log")  # a file: a full pipe would stall the run
    with log.open("w") as sink:
        proc = subprocess.Popen(
            command, env=run_env(marker, threads=1), stdout=sink, stderr=subprocess.STDOUT
        )
    pointer, deadline = run / "latest_checkpoint.txt", time.time() + 500
    while int(pointer.read_text().strip()[5:] or 0) < target:
        assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
        time.sleep(0.02)
    for process in [*psutil.Process(proc.pid).children(), psutil.Process(proc.pid)]:
        process.kill()
    proc.wait()
    out = log.read_text()
    assert f"resumed from {run / f'step_{stopped:07d}'}" in out, out[-3000:]
    assert wait_gone(marker) == [], "a process of the killed run is still alive"
    latest = int(pointer.read_text().strip()[5:])
    assert target <= latest < steps
    return latest


def stopped_and_killed_runs_resume_exactly(args: list[str], nproc: int, steps: int, tmp_path):
    """An uninterrupted ``nproc``-rank run of ``args``, and one chaos sequence on a second run:
    SIGTERM at a random step (the signal's checkpoint is its only one) -> relaunch, which
    resumes and saves every step -> SIGKILL of the launcher and every worker after a random
    later checkpoint -> relaunch (the killed run's lock record is stale and taken over) to the
    end, with the reference's metrics and checkpoint shards."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    marker, seed = uuid.uuid4().hex, os.getpid()
    run_to_end(torchrun(nproc, *args, f"train.output_dir={reference}"), marker, threads=1)
    stopped = interrupt(
        torchrun(nproc, *args, f"train.output_dir={run}"), run, steps, marker, seed, nproc
    )
    every_step = torchrun(nproc, *args, "train.save_interval=1", f"train.output_dir={run}")
    killed = resume_and_kill(every_step, run, stopped, steps, marker, seed + 1)
    resumed = subprocess.run(
        every_step, env=run_env(marker, threads=1), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / f'step_{killed:07d}'}" in resumed.stdout + resumed.stderr
    assert "stale lock, held by no process on this host" in resumed.stderr
    assert wait_gone(marker) == []
    final = f"step_{steps:07d}"
    assert metrics(run) == metrics(reference)
    assert shards(run / final) and shards(run / final) == shards(reference / final)


ASYNC = ["async.max_staleness=1", "async.value_targets=vtrace", "async.is_cap=2"]
"""One step stale, both corrections (V-trace targets, importance weights capped at 2)."""


@pytest.mark.chaos
def test_async_train_ppo_per_role_layouts_on_4_ranks_sigterm_sigkill_resume_is_bit_identical(
    tmp_path,
):
    """An asynchronous run (``async.max_staleness=1``, V-trace, ``is_cap=2``): every step
    after the first trains on a rollout the previous step's actor generated, so each
    checkpoint, the signal's and the ones the SIGKILL cuts off after, holds one rollout in
    flight. The resumed runs train on those rollouts as saved: they are persisted in the
    checkpoint, not regenerated (no checkpoint holds the older actor that generated them), and
    the end is the uninterrupted run's bit for bit. The synchronous step's SIGKILL resume is
    tests/test_ppo_training.py's (1 rank)."""
    from ppo_fixtures import make_ppo_setup

    setup, steps = make_ppo_setup(tmp_path / "setup"), 5
    args = [
        "train-ppo", "--config", str(setup["config"]), f"train.steps={steps}",
        "train.save_interval=100", "rollout.prompts_per_step=8", "train.micro_batch_size=2",
        "ppo.num_minibatches=2", "ppo.epochs=1", "train.sample_interval=100", *PPO_LAYOUTS,
        *ASYNC,
    ]  # fmt: skip
    stopped_and_killed_runs_resume_exactly(args, 4, steps, tmp_path)


@pytest.mark.chaos
def test_train_reward_deepspeed_on_2_ranks_sigterm_then_resume_is_bit_identical(
    reward_setup,  # noqa: F811
    tmp_path,
):
    steps = 6
    args = [
        "train-reward", *reward_argv(reward_setup, tmp_path / "x", steps), "backend=deepspeed",
        "deepspeed.zero_stage=3", "train.global_batch_size=8", "train.save_interval=100",
        "train.log_interval=1",
    ]  # fmt: skip
    args = [a for a in args if not a.startswith("train.output_dir")]
    stopped_and_killed_runs_resume_exactly(args, 2, steps, tmp_path)


@pytest.mark.chaos
def test_train_sft_sigusr1_at_a_random_step_then_resume_is_bit_identical(tmp_path):
    """SIGUSR1, the signal Slurm's ``--signal`` sends: train-sft saves and resumes exactly."""
    from megatron_rlhf.data import write_sft_dataset
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    save_random_hf_bloom(tmp_path / "hf", tiny_architecture(vocab_size=64), seed=0)
    examples = [([5 + i % 7, 6, 7 + i % 5], [9, 8 + i % 3]) for i in range(32)]
    write_sft_dataset(tmp_path / "train", examples, vocab_size=64, eos_id=2, pad_id=0)
    steps = 8
    args = [
        "train-sft", f"model.load={tmp_path / 'hf'}", f"data.train={tmp_path / 'train'}",
        f"train.steps={steps}", "train.global_batch_size=4", "train.micro_batch_size=2",
        "train.save_interval=100", "train.log_interval=1", "train.eval_interval=0",
        "optim.warmup_fraction=0",
    ]  # fmt: skip
    command = [sys.executable, "-m", "megatron_rlhf", *args]
    reference, run, marker = tmp_path / "reference", tmp_path / "run", uuid.uuid4().hex
    run_to_end([*command, f"train.output_dir={reference}"], marker)
    target = random.Random(os.getpid()).randint(1, steps - 3)
    proc = launch_until_step([*command, f"train.output_dir={run}"], run, target, run_env(marker))
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_SAVED_ON_SIGNAL, err[-3000:]
    stopped = logged_steps(run)
    assert f"stopped by SIGUSR1 after step {stopped}" in err
    assert (run / "latest_checkpoint.txt").read_text().strip() == f"step_{stopped:07d}"
    run_to_end([*command, f"train.output_dir={run}"], marker)
    assert metrics(run) == metrics(reference)
    final = f"step_{steps:07d}"
    assert shards(run / final) and shards(run / final) == shards(reference / final)
    assert wait_gone(marker) == []


def test_a_second_signal_during_the_save_does_not_cut_it_off(tmp_path, monkeypatch, capfd):
    """The first SIGTERM stops the run; another one arriving while the checkpoint is written
    is only reported: the save completes and its manifest verifies."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_rlhf.checkpoint import dist as dist_ckpt
    from megatron_rlhf.checkpoint import manifest
    from megatron_rlhf.distributed import parallel
    from megatron_rlhf.training.signals import ExitSignals

    write_manifest = manifest.write_manifest

    def signalled_mid_save(directory):
        os.kill(os.getpid(), signal.SIGTERM)  # after the shards, before the manifest
        time.sleep(0.05)
        write_manifest(directory)

    monkeypatch.setattr(manifest, "write_manifest", signalled_mid_save)
    parallel.initialize()
    signals = ExitSignals(["SIGTERM"])
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.agreed() == signal.SIGTERM
        weight = torch.arange(6.0).reshape(2, 3)
        state = {"w": ShardedTensor.from_rank_offsets("w", weight.clone(), replica_id=0)}
        saved = dist_ckpt.save(tmp_path / "step_0000003", state, {"architecture": {}})
        manifest.verify(saved)
        loaded = dist_ckpt.load(
            saved, {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=0)}
        )
        assert torch.equal(loaded["w"], weight)
        assert "SIGTERM again: already stopping; the save is not cut off" in capfd.readouterr().err
    finally:
        signals.restore()
        parallel.destroy()
