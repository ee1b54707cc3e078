"""The ``train-ppo`` command line, parsed before torch and megatron-core are imported (so
``--help`` answers at once); the trainer itself is :mod:`megatron_rlhf.ppo.train`."""

from __future__ import annotations

import argparse

from megatron_rlhf.config import config_parser

DESCRIPTION = """\
AM-PPO-SR and its baselines (RM-PPO, RM-PPO w/ MA, AM-PPO, rejection sampling).

    torchrun --nproc-per-node N -m megatron_rlhf train-ppo --config FILE [key=value ...]

Each step: rollout (sample the actor) -> score (old/reference log-probs, values, AM/RM
scores) -> advantages (-beta*KL shaped rewards, GAE, whitening) -> update (PPO epochs; with
rehearsal, L_PPO + gamma*NLL(D_R)). Every config key, its default and meaning: --print-config.
"""


def build_parser() -> argparse.ArgumentParser:
    return config_parser("python -m megatron_rlhf train-ppo", DESCRIPTION, "examples/ppo/")


def main(argv: list[str]) -> int:
    """``train-ppo``: --help and usage errors before the heavy imports, then the trainer."""
    args = build_parser().parse_args(argv)
    if args.print_config:
        from megatron_rlhf.config import describe_config
        from megatron_rlhf.ppo.config import TrainPPOConfig

        print(describe_config(TrainPPOConfig))
        return 0
    from megatron_rlhf.ppo.train import train
    from megatron_rlhf.utils import run_command

    return run_command("train-ppo", lambda: train(args), distributed=True)
