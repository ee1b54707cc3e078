"""Per-role layouts on 4 gloo ranks, in one torchrun launch (``dist_layouts_worker.py``):

- Megatron-Core's global state sealed; packed rows' logits equal the padded rows' and
  transformers' at TP2xPP2, TP2 and TP1; hand-offs between layouts; rollouts from the training layout (TP2xPP2), the resharded rollout
  layout (TP2, DP2, refit by Megatron-Core's ``swap_model_weights``) and TP1/DP4 give identical
  greedy and row-seeded sampled tokens;
- then one ``train-ppo`` step with actor/reference TP2xPP2, critic TP2 (DP2), reward TP1 (DP4)
  and rollout TP2 (DP2), from a tiny demo-like setup (AM reward, rehearsal on), gives the
  single-process step's reward, KL, response length, policy loss, rehearsal NLL and value loss;
- a single process resumes that 4-rank run's checkpoint and takes the single-process step 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_bloom_common import ARCH_A, save_hf_bloom
from ppo_fixtures import make_advantage_model, make_ppo_setup
from test_ppo_training import _env
from torchrun_util import assert_check, run_checks

from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom

pytestmark = pytest.mark.launch(ranks=4)  # one 4-rank launch (~1 min) behind every test here

WORKER = Path(__file__).with_name("dist_layouts_worker.py")
CHECKS = [
    "global_state_sealed",
    "handoff_gather_rows",
    "packed_rows_layouts",
    "rollout_greedy_layouts",
    "rollout_sampled_layouts",
]
LAYOUTS = [
    "parallel.actor.tp=2", "parallel.actor.pp=2", "parallel.critic.tp=2", "parallel.reward.tp=1",
    "parallel.rollout.tp=2", "parallel.rollout.pp=1",
]  # fmt: skip
METRICS = [
    "reward/mean", "kl/mean", "response/length", "actor/policy_loss", "actor/rehearsal_nll",
    "critic/value_loss",
]  # fmt: skip


def _overrides(root: Path, output_dir: Path, steps: int) -> list[str]:
    return [
        "--config", str(root / "ppo.yaml"), f"models.reward={root / 'am'}",
        f"models.reference={root / 'reference'}",
        "models.reward_fn=null", "rehearsal.enabled=true", f"rehearsal.dataset={root / 'rehearsal'}",
        f"train.steps={steps}", "train.save_interval=1", "rollout.prompts_per_step=8",
        "train.micro_batch_size=2", "ppo.num_minibatches=2", "ppo.epochs=1",
        f"train.output_dir={output_dir}",
        # constant LR: the 4-rank run stops at step 1 and the single process runs 2 steps, so a
        # cosine schedule over train.steps would give them different step-1 learning rates
        "actor_optim.min_lr_ratio=1.0", "critic_optim.min_lr_ratio=1.0",
    ]  # fmt: skip


def _single(*args: str) -> None:
    cmd = [sys.executable, "-m", "megatron_rlhf", "train-ppo", *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def _metrics(output_dir: Path) -> dict[int, dict]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record for record in map(json.loads, lines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    save_hf_bloom(root / "hf", ARCH_A)
    setup = make_ppo_setup(root)
    make_advantage_model(root, root / "actor")
    save_random_hf_bloom(root / "reference", setup["arch"], seed=1)  # KL(actor || ref) > 0
    _single(*_overrides(root, root / "single", steps=2))
    checks = run_checks(
        WORKER, 4, root / "checks", "--hf", str(root / "hf"),
        "--train-ppo", *_overrides(root, root / "layouts", steps=1), *LAYOUTS,
    )  # fmt: skip
    shutil.copytree(root / "layouts", root / "resumed")
    _single(*_overrides(root, root / "resumed", steps=2))
    return {
        "checks": checks,
        "single": _metrics(root / "single"),
        "layouts": _metrics(root / "layouts"),
        "resumed": _metrics(root / "resumed"),
    }


@pytest.mark.parametrize("check", CHECKS + ["train_ppo"])
def test_layouts(runs, check):
    assert_check(runs["checks"], check)


@pytest.mark.parametrize("metric", METRICS)
def test_ppo_step_in_per_role_layouts_equals_single_process(runs, metric):
    single, layouts = runs["single"][1][metric], runs["layouts"][1][metric]
    assert layouts == pytest.approx(single, rel=1e-3, abs=1e-6), (metric, layouts, single)


@pytest.mark.parametrize("metric", METRICS)
def test_resume_at_another_world_size_and_layout(runs, metric):
    single, resumed = runs["single"][2][metric], runs["resumed"][2][metric]
    assert resumed == pytest.approx(single, rel=1e-3, abs=1e-6), (metric, resumed, single)
