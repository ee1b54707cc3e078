"""The README's main job: ``python -m megatron_rlhf demo`` runs every stage and says where."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from torchrun_util import REPO

ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
COMMAND = [sys.executable, "-m", "megatron_rlhf", "demo", "--output-dir"]
# Each tiny example as shipped (its documented inputs, two steps): the reward one on the data of
# its own prepare_tiny.py, the PPO one on the demo's outputs (it names demo_output/...).
EXAMPLES = f"""
import sys
if __name__ == "__main__":
    sys.path.insert(0, {str(REPO / "examples" / "reward")!r})
    from pathlib import Path
    from prepare_tiny import main as prepare
    from megatron_rlhf.reward.train import main as train_reward
    from megatron_rlhf.ppo.train_cli import main as train_ppo
    prepare(Path("runs/tiny"))
    assert train_reward(["--config", {str(REPO / "examples/reward/tiny_cpu.yaml")!r},
                         "train.steps=2"]) == 0
    assert train_ppo(["--config", {str(REPO / "examples/ppo/tiny_cpu.yaml")!r},
                      "train.steps=2"]) == 0
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    out = root / "demo_output"
    proc = subprocess.run(
        [*COMMAND, str(out)], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root, out, proc


@pytest.mark.e2e
def test_demo_runs_the_whole_pipeline(demo):
    _, out, proc = demo
    env, command = ENV, [*COMMAND, str(out)]
    for stage in range(1, 8):
        assert f"=== [{stage}/7]" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("[demo] done: seconds=")
    report = json.loads((out / "eval" / "eval_policy.json").read_text())
    assert set(report["sets"]) == {"main", "forget"}
    # main: 6 prompts of each preference family; forget: 5 of each family (seven)
    for name, prompts in (("main", 4 * 6), ("forget", 7 * 5)):
        counts = report["sets"][name]
        assert counts["win"] + counts["tie"] + counts["lose"] == counts["num_prompts"] == prompts
    for loss in ("rm", "am"):
        assert json.loads((out / loss / "eval" / "summary.json").read_text())["num_pairs"] == 96
        assert json.loads((out / loss / "config.json").read_text())["loss"] == loss
    ppo_config = json.loads((out / "ppo" / "config.json").read_text())
    assert ppo_config["rehearsal"]["enabled"] and ppo_config["models"]["reward_kind"] == "am"
    for arm, kind in (("am_ppo", "am"), ("rm_ppo", "rm")):
        config = json.loads((out / f"ppo_{arm}" / "config.json").read_text())
        assert not config["rehearsal"]["enabled"] and config["models"]["reward_kind"] == kind
        assert config["ppo"] == ppo_config["ppo"]  # same beta, steps, batches for every arm
        assert config["actor_optim"] == ppo_config["actor_optim"]
    gold = json.loads((out / "gold_judgments.json").read_text())
    assert set(gold) == {"am_ppo_sr", "am_ppo", "rm_ppo"}
    judgments = [json.loads(x) for x in (out / "eval" / "judgments.jsonl").read_text().splitlines()]
    assert len(judgments) == 4 * 6 + 7 * 5
    assert {j["outcome"] for j in judgments} <= {"win", "tie", "lose"}
    assert (out / "rehearsal" / "d_r.bin").exists() and (out / "rehearsal" / "d_r.idx").exists()
    assert (out / "ppo" / "latest_checkpoint.txt").exists()
    metrics = [
        json.loads(line) for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all("actor/rehearsal_nll" in m for m in metrics)
    assert any(key.startswith("reward_by_cluster/") for key in metrics[-1])

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr


@pytest.mark.e2e
def test_tiny_examples_run_as_shipped(demo):
    root, _, _ = demo
    (root / "examples.py").write_text(EXAMPLES)
    proc = subprocess.run(
        [sys.executable, "examples.py"],
        cwd=root,
        env=dict(ENV, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (root / "runs" / "tiny" / "am" / "step_0000002" / "manifest.json").exists()
    metrics = (root / "demo_output" / "ppo_example" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]
