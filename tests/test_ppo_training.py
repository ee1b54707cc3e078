"""train-ppo end to end on a known reward: it learns, TP=2 follows TP=1, a kill resumes exactly.

The reward is the share of response tokens equal to token 7 (tests/ppo_reward.py); a random
tiny BLOOM starts near 1/64.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ppo_fixtures import make_ppo_setup
from torchrun_util import launch_env, torchrun_command

_env = launch_env  # the name test_layouts_parallel imports


def _command(setup: dict, output_dir: Path, nproc: int, *overrides: str) -> list[str]:
    launcher = torchrun_command(nproc) if nproc > 1 else [sys.executable]
    return launcher + [
        "-m", "megatron_rlhf", "train-ppo", "--config", str(setup["config"]),
        f"train.output_dir={output_dir}", *overrides,
    ]  # fmt: skip


def _run(setup, output_dir, nproc=1, *overrides):
    proc = subprocess.run(
        _command(setup, output_dir, nproc, *overrides),
        env=_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _rewards(output_dir: Path) -> dict[int, dict]:
    """The logged metrics of every step (each step once, also after a resume)."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return {record["step"]: record for record in records}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_ppo_setup(tmp_path_factory.mktemp("ppo"))


@pytest.fixture(scope="module")
def tp1_run(setup):
    output_dir = setup["root"] / "tp1"
    _run(setup, output_dir)
    return _rewards(output_dir)


@pytest.mark.e2e
def test_ppo_raises_a_known_reward(tp1_run, setup):
    first = sum(tp1_run[s]["reward/mean"] for s in (1, 2, 3)) / 3
    last = sum(tp1_run[s]["reward/mean"] for s in (10, 11, 12)) / 3
    print(f"reward: first three steps {first:.3f}, last three {last:.3f}")
    assert first < 0.15 and last > 0.5, (first, last)
    for key in ("kl/mean", "actor/entropy", "actor/clip_fraction", "actor/approx_kl",
                "critic/explained_variance", "response/length", "time/rollout_s",
                "time/step_s", "throughput/tokens_per_s"):  # fmt: skip
        assert key in tp1_run[12], key
    # end to end: prompt and response tokens, so more than the response tokens alone
    assert tp1_run[12]["throughput/tokens_per_s"] > tp1_run[12]["throughput/response_tokens_per_s"]
    samples = (setup["root"] / "tp1" / "samples.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in samples} == {4, 8, 12}
    assert list((setup["root"] / "tp1" / "tensorboard").iterdir())


@pytest.fixture(scope="module")
def tp2_run(setup):
    output_dir = setup["root"] / "tp2"
    _run(setup, output_dir, 2, "parallel.tp=2")
    return output_dir


@pytest.mark.e2e(ranks=2)
def test_tp2_follows_the_tp1_trajectory(tp1_run, tp2_run):
    """Same seed, same data: TP=2 reproduces TP=1 until a near-tie sample flips (logits agree
    to ~1e-7, so the first steps are identical), and learns as well."""
    tp2 = _rewards(tp2_run)
    for step in (1, 2, 3):
        assert tp2[step]["reward/mean"] == pytest.approx(tp1_run[step]["reward/mean"], abs=1e-6)
        assert tp2[step]["kl/mean"] == pytest.approx(tp1_run[step]["kl/mean"], abs=1e-4)
    for step in range(1, 13):
        assert abs(tp2[step]["reward/mean"] - tp1_run[step]["reward/mean"]) < 0.15
    assert sum(tp2[s]["reward/mean"] for s in (10, 11, 12)) / 3 > 0.5


@pytest.mark.e2e(ranks=2)
def test_seed_2_tp2_samples_equal_tp1_until_rounding_flips_one(setup):
    """Issue 47, item 6: the gap once kept in tests/ppo_fixtures.py (seed 2, TP=2 differing
    from TP=1 at step 1: reward 0.023 vs 0.044) no longer holds. Measured (this fixture, CPU):
    with seed 2 the two runs sample the very same tokens for 6 steps (every reward equal);
    their other metrics differ by rounding only, growing with the updates (largest relative
    difference 1e-6 at step 2, 6e-5 at step 4, 3e-4 at step 5: TP=2 sums each matmul in two
    halves); at step 7 2 of 16 rows first sample another token (response positions 2 and 4),
    where a row's uniform draw falls between the two layouts' CDF boundaries, and the
    trajectories part from there (77 of 192 rows by step 12). This pins the first 6 steps:
    the samples and rewards are identical."""
    runs = {}
    for nproc, tp in ((1, "parallel.tp=1"), (2, "parallel.tp=2")):
        output_dir = setup["root"] / f"seed2_tp{nproc}"
        _run(setup, output_dir, nproc, tp, "train.seed=2", "train.steps=6",
             "train.sample_interval=1", "train.save_interval=0")  # fmt: skip
        runs[nproc] = (_rewards(output_dir), (output_dir / "samples.jsonl").read_text())
    (tp1, tp1_samples), (tp2, tp2_samples) = runs[1], runs[2]
    assert tp2_samples == tp1_samples
    assert [tp2[s]["reward/mean"] for s in range(1, 7)] == [
        tp1[s]["reward/mean"] for s in range(1, 7)
    ]


@pytest.mark.e2e
def test_rollout_logprobs_as_old_logprobs_equal_a_recomputing_forward(setup):
    """ppo.old_logprobs: log pi_old taken from the rollout (the default here: fp32,
    temperature 1) and from an actor forward over the finished sequences (recompute) give
    the same steps to rounding: the same samples, KL, losses and gradient norms."""
    runs = {}
    for choice in ("rollout", "recompute"):
        output_dir = setup["root"] / f"old_logprobs_{choice}"
        _run(setup, output_dir, 1, f"ppo.old_logprobs={choice}", "train.steps=3")
        runs[choice] = _rewards(output_dir)
    for step in (1, 2, 3):
        reused, recomputed = runs["rollout"][step], runs["recompute"][step]
        assert reused["reward/mean"] == recomputed["reward/mean"], step
        assert reused["kl/mean"] == pytest.approx(recomputed["kl/mean"], rel=1e-5, abs=1e-6)
        for key in ("actor/policy_loss", "actor/grad_norm", "critic/value_loss"):
            assert reused[key] == pytest.approx(recomputed[key], rel=1e-4, abs=1e-6), key


@pytest.mark.e2e(ranks=2)
def test_tp2_checkpoint_exports_policy_and_critic_to_hf(tp2_run, tmp_path):
    """megatron-to-hf on a checkpoint saved at TP=2: the HF policy generates our tokens."""
    from test_checkpoint_integrity import check_export_matches_checkpoint

    check_export_matches_checkpoint(tp2_run / "step_0000012", tmp_path)


@pytest.mark.chaos
def test_killed_run_resumes_exactly(tp1_run, setup):
    """SIGKILL after the step-4 checkpoint, relaunch: steps 5..12 equal the uninterrupted run."""
    output_dir = setup["root"] / "killed"
    proc = subprocess.Popen(
        _command(setup, output_dir, 1), env=_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    pointer = output_dir / "latest_checkpoint.txt"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if pointer.exists() and pointer.read_text().strip() == "step_0000004":
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    _run(setup, output_dir)
    resumed = _rewards(output_dir)
    for step in range(5, 13):
        for key in ("reward/mean", "kl/mean", "actor/policy_loss", "critic/value_loss"):
            assert resumed[step][key] == tp1_run[step][key], (step, key)
    samples = (output_dir / "samples.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in samples]  # logs cut back to the resumed step
    assert sorted(set(steps)) == [4, 8, 12] and steps.count(4) == steps.count(8) == 16


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory):
    """The same task on a model whose 32-wide heads vLLM's CPU attention takes."""
    return make_ppo_setup(tmp_path_factory.mktemp("ppo_vllm"), hidden_size=64, num_heads=2)


@pytest.mark.e2e
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason='vLLM is not installed: pip install -e ".[vllm]" '
    "&& pip uninstall -y torchvision torchaudio torchcodec",
)
def test_vllm_rollouts_learn_as_ours_and_follow_every_update(vllm_setup):
    """rollout.engine=vllm against megatron on the known reward: both rise into the same band,
    and every step the vLLM rollout's log-probs equal the updated actor's recomputed ones (the
    weights reached vLLM: a missed sync shows as a gap of order 1)."""
    runs = {}
    for engine in ("megatron", "vllm"):
        output_dir = vllm_setup["root"] / engine
        _run(vllm_setup, output_dir, 1, f"rollout.engine={engine}")
        runs[engine] = _rewards(output_dir)
    for engine, run in runs.items():
        first = sum(run[s]["reward/mean"] for s in (1, 2, 3)) / 3
        last = sum(run[s]["reward/mean"] for s in (10, 11, 12)) / 3
        print(f"{engine}: reward first three steps {first:.3f}, last three {last:.3f}")
        assert first < 0.15 and last > 0.5, (engine, first, last)
    vllm = runs["vllm"]
    gaps = [vllm[s]["rollout/logprob_diff_max"] for s in range(1, 13)]
    print("vLLM rollout vs actor log-prob gap per step:", [f"{g:.1e}" for g in gaps])
    assert max(gaps) < 1e-2, gaps
    assert all(vllm[s]["time/weight_sync_s"] > 0 for s in range(1, 13))
    assert "time/weight_sync_s" not in runs["megatron"][1]
    # every step logs the sync: its seconds and this rank's bytes (the whole model at TP 1,
    # all of it copied from the rank's own actor); the training-layout engine copies nothing
    assert all(vllm[s]["rollout/sync_s"] == vllm[s]["time/weight_sync_s"] for s in range(1, 13))
    sync_bytes = {vllm[s]["rollout/sync_bytes_per_rank"] for s in range(1, 13)}
    assert len(sync_bytes) == 1 and sync_bytes.pop() > 0
    assert all(vllm[s]["rollout/sync_remote_bytes_per_rank"] == 0 for s in range(1, 13))
    assert runs["megatron"][1]["rollout/sync_bytes_per_rank"] == 0
