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
  trunk, at TP=2 (its main tears the process group down, so it runs last and only rank 0
  judges it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torchrun_harness import Harness, run_killed_during_step

STAGES = (1, 2, 3)
harness = Harness(__doc__)
harness.parser.add_argument("--config", required=True)
harness.parser.add_argument("--data", required=True)
harness.parser.add_argument("--ppo-config", dest="ppo_config", required=True)
harness.parser.add_argument("--work", type=Path, required=True)


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


@harness.check
def zero_stages(args) -> None:
    for stage in STAGES:
        # ZeRO-1 with transformers' gradient checkpointing: recomputation must not change a loss
        extra = ["train.recompute_activations=true"] if stage == 1 else []
        result = train(args, args.work / f"zero{stage}", f"deepspeed.zero_stage={stage}", *extra)
        losses = [m["loss"] for m in result["history"]]
        harness.record(
            f"zero{stage}_trains",
            len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses))),
            f"losses {losses}",
        )


@harness.check
def zero3_resume(args) -> None:
    from megatron_rlhf.training.deepspeed_engine import DeepSpeedTrainEngine

    whole = read_jsonl(args.work / "zero3" / "metrics.jsonl")
    killed = args.work / "zero3_killed"
    begun = run_killed_during_step(
        DeepSpeedTrainEngine, 3, lambda: train(args, killed, "deepspeed.zero_stage=3")
    )
    resumed = train(args, killed, "deepspeed.zero_stage=3")
    whole_train = [m["train/loss"] for m in whole if "train/loss" in m]
    whole_eval = {k.removeprefix("eval/"): v for k, v in whole[-1].items()}
    resumed_losses = [m["loss"] for m in resumed["history"]]
    harness.record(
        "zero3_killed_and_resumed_losses_equal_uninterrupted_bitwise",
        begun == 3 and resumed_losses == whole_train[2:],
        f"uninterrupted {whole_train}, resumed {resumed_losses}",
    )
    harness.record(
        "zero3_killed_and_resumed_final_evaluation_equal",
        resumed["eval"]["loss"] == whole_eval["loss"]
        and resumed["eval"]["accuracy"] == whole_eval["accuracy"],
        f"uninterrupted {whole_eval['loss']!r} vs resumed {resumed['eval']['loss']!r}",
    )


@harness.check
def score_zero3(args) -> None:
    """``score`` reads the ZeRO-3 checkpoint at TP=2 and at TP=1 (DP=2) alike."""
    from megatron_rlhf.reward import score

    work = args.work
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
    harness.record(
        "score_zero3_checkpoint_tp2_equals_tp1",
        len(lines[2]) == len(lines[1]) > 0 and gap < 1e-5,
        f"{len(lines[2])} pairs, max gap {gap:.2e}",
    )


@harness.check
def ppo_with_zero3_am(args) -> None:
    """One train-ppo step, TP=2, with the ZeRO-3 AM as reward model and critic trunk."""
    from megatron_rlhf.ppo import train_cli as ppo_train

    work = args.work
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
    # main() has torn the process group down; rank 0 wrote the metrics and judges
    if os.environ["RANK"] != "0":
        return
    records = read_jsonl(output_dir / "metrics.jsonl")
    harness.record(
        "ppo_step_with_zero3_am_as_reward_and_critic",
        code == 0
        and [r["step"] for r in records] == [1]
        and torch.isfinite(torch.tensor(records[0]["reward/mean"])).item(),
        f"exit {code}, metrics {records}",
    )


if __name__ == "__main__":
    harness.main()
