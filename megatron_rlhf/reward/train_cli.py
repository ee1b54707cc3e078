"""The ``train-reward`` command line, parsed before torch and megatron-core are imported (so
``--help`` answers at once); the training itself is :mod:`megatron_rlhf.reward.train`."""

from __future__ import annotations

import argparse

from megatron_rlhf.config import config_parser

DESCRIPTION = """\
Train a Reward Model (loss: rm, Eq. 1) or an Advantage Model (loss: am, Eqs. 5-8).

    torchrun --nproc-per-node 8 -m megatron_rlhf train-reward \\
        --config examples/reward/bloomz_7b1_am.yaml parallel.tp=2 optim.lr=5e-6

Any tp/pp/dp; checkpoints in train.output_dir/step_N resume exactly and are model checkpoints
for score and train-ppo. Every config key, its default and meaning: --print-config.
"""


def build_parser() -> argparse.ArgumentParser:
    return config_parser("python -m megatron_rlhf train-reward", DESCRIPTION, "examples/reward/")


def main(argv: list[str]) -> int:
    build_parser().parse_args(argv)  # --help and usage errors before the heavy imports
    from megatron_rlhf.reward.train import main as train

    return train(argv)
