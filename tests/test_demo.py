"""The README's main job: ``python -m megatron_rlhf demo`` runs every stage and says where."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from torchrun_util import REPO


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "megatron_rlhf", "demo", "--output-dir", str(out)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for stage in range(1, 8):
        assert f"=== [{stage}/7]" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("[demo] done: seconds=")
    report = json.loads((out / "eval" / "eval_policy.json").read_text())
    assert set(report["sets"]) == {"main", "forget"}
    for name in ("main", "forget"):
        counts = report["sets"][name]
        assert counts["win"] + counts["tie"] + counts["lose"] == counts["num_prompts"] == 24
    assert json.loads((out / "am" / "eval" / "summary.json").read_text())["num_pairs"] == 96
    assert (out / "rehearsal" / "d_r.bin").exists() and (out / "rehearsal" / "d_r.idx").exists()
    assert (out / "ppo" / "latest_checkpoint.txt").exists()
    metrics = [
        json.loads(line) for line in (out / "ppo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all("actor/rehearsal_nll" in m for m in metrics)
    assert any(key.startswith("reward_by_cluster/") for key in metrics[-1])

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr
