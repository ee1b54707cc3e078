"""Worker for test_reward_deepspeed.py: ``train-reward backend=deepspeed`` on 2 gloo ranks.

One launch (a launch costs 10-15 s of imports):
- the AM trained under ZeRO stage 1 (with activation checkpointing), 2 and 3
  (``train.output_dir`` = WORK/zero{1,2,3}); the test compares their metrics.jsonl with the
  Megatron path's on one process;
- ZeRO-3 killed during step 3 and resumed from its step-2 checkpoint repeats the uninterrupted
  losses and final evaluation bit for bit;
- ``score`` of the preference pairs with the ZeRO-3 checkpoint at TP=2 and at TP=1 (DP=2)
  (WORK/scores_tp{2,1}.jsonl; the test compares them with the Megatron-trained AM's scores);
- one ``train-ppo`` step with the ZeRO-3 AM as ``models.reward`` and as ``models.critic``'s
  trunk, at TP=2.
Rank 0 writes ``{check: {"ok", "detail"}}`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

STAGES = (1, 2, 3)


class Killed(Exception):
    """Stands in for the process being killed in the middle of a step."""


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_args(args, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--config",
        args.config,
        f"train.output_dir={output_dir}",
        "backend=deepspeed",
        *extra,
    ]


def train(args, output_dir: Path, *extra: str):
    from megatron_rlhf.config import load_config
    from megatron_rlhf.reward.train import RewardTrainConfig
    from megatron_rlhf.reward.train import train as train_reward

    argv = train_args(args, output_dir, *extra)
    return train_reward(load_config(RewardTrainConfig, argv[1], argv[2:]))


def stage_checks(args, work: Path) -> dict:
    checks = {}
    for stage in STAGES:
        # ZeRO-1 with transformers' gradient checkpointing: recomputation must not change a loss
        extra = ["model.recompute_activations=true"] if stage == 1 else []
        result = train(args, work / f"zero{stage}", f"deepspeed.zero_stage={stage}", *extra)
        losses = [m["loss"] for m in result["history"]]
        checks[f"zero{stage}_trains"] = (
            len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses))),
            f"losses {losses}",
        )
    return checks


def resume_checks(args, work: Path) -> dict:
    from megatron_rlhf.training.deepspeed_engine import DeepSpeedTrainEngine

    whole = read_jsonl(work / "zero3" / "metrics.jsonl")
    original_step, calls = DeepSpeedTrainEngine.step, []

    def dying_step(self, microbatches, loss_fn, forward_only=False):
        if not forward_only:
            calls.append(1)
            if len(calls) == 3:
                raise Killed("killed during step 3")
        return original_step(self, microbatches, loss_fn, forward_only)

    killed = work / "zero3_killed"
    DeepSpeedTrainEngine.step = dying_step
    try:
        train(args, killed, "deepspeed.zero_stage=3")
    except Killed:
        pass
    finally:
        DeepSpeedTrainEngine.step = original_step
    resumed = train(args, killed, "deepspeed.zero_stage=3")
    whole_train = [m["train/loss"] for m in whole if "train/loss" in m]
    whole_eval = {k.removeprefix("eval/"): v for k, v in whole[-1].items()}
    resumed_losses = [m["loss"] for m in resumed["history"]]
    return {
        "zero3_killed_and_resumed_losses_equal_uninterrupted_bitwise": (
            len(calls) == 3 and resumed_losses == whole_train[2:],
            f"uninterrupted {whole_train}, resumed {resumed_losses}",
        ),
        "zero3_killed_and_resumed_final_evaluation_equal": (
            resumed["eval"]["loss"] == whole_eval["loss"]
            and resumed["eval"]["accuracy"] == whole_eval["accuracy"],
            f"uninterrupted {whole_eval['loss']!r} vs resumed {resumed['eval']['loss']!r}",
        ),
    }


def score_checks(args, work: Path) -> dict:
    """``score`` reads the ZeRO-3 checkpoint at TP=2 and at TP=1 (DP=2) alike."""
    from megatron_rlhf.reward import score

    checkpoint = (work / "zero3" / "latest_checkpoint.txt").read_text().strip()
    lines = {}
    for tp in (2, 1):
        out = work / f"scores_tp{tp}.jsonl"
        argv = ["--load", str(work / "zero3" / checkpoint), "--input", args.data]
        score.run(score.build_parser().parse_args([*argv, "--output", str(out), "--tp", str(tp)]))
        dist.barrier()
        lines[tp] = read_jsonl(out)
    gap = max(
        abs(a[key] - b[key])
        for a, b in zip(lines[2], lines[1])
        for key in ("chosen_score", "rejected_score")
    )
    return {
        "score_zero3_checkpoint_tp2_equals_tp1": (
            len(lines[2]) == len(lines[1]) > 0 and gap < 1e-5,
            f"{len(lines[2])} pairs, max gap {gap:.2e}",
        )
    }


def ppo_checks(args, work: Path) -> dict:
    """One train-ppo step, TP=2, with the ZeRO-3 AM as reward model and critic trunk."""
    from megatron_rlhf.ppo import train_cli as ppo_train

    checkpoint = work / "zero3" / (work / "zero3" / "latest_checkpoint.txt").read_text().strip()
    output_dir = work / "ppo"
    code = ppo_train.main(
        [
            "--config",
            args.ppo_config,
            f"train.output_dir={output_dir}",
            f"models.reward={checkpoint}",
            "models.reward_fn=null",
            "models.reward_kind=am",
            f"models.critic={checkpoint}",
            "train.steps=1",
            "parallel.tp=2",
        ]
    )
    # main() has torn the process group down; rank 0 wrote the metrics and reports
    records = read_jsonl(output_dir / "metrics.jsonl") if os.environ["RANK"] == "0" else []
    return {
        "ppo_step_with_zero3_am_as_reward_and_critic": (
            code == 0
            and [r["step"] for r in records] == [1]
            and torch.isfinite(torch.tensor(records[0]["reward/mean"])).item(),
            f"exit {code}, metrics {records}",
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--ppo-config", dest="ppo_config", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    try:
        checks = stage_checks(args, work)
        checks.update(resume_checks(args, work))
        checks.update(score_checks(args, work))
        checks.update(ppo_checks(args, work))
        results = {
            name: {"ok": bool(ok), "detail": detail} for name, (ok, detail) in checks.items()
        }
    except Exception:  # report instead of hanging the other ranks
        results = {"worker": {"ok": False, "detail": traceback.format_exc()}}
        print(f"rank {os.environ['RANK']}: {traceback.format_exc()}", file=sys.stderr, flush=True)
    if os.environ["RANK"] == "0":
        Path(args.out).write_text(json.dumps(results))
    if dist.is_initialized():  # train-ppo's main tears the groups down itself
        from megatron_rlhf.distributed import destroy

        destroy()


if __name__ == "__main__":
    main()
