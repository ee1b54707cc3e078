"""The ``train-sft`` command line, parsed before torch and megatron-core are imported (so
``--help`` answers at once); the training itself is :mod:`megatron_rlhf.training.sft`."""

from __future__ import annotations

import argparse

from megatron_rlhf.config import config_parser

DESCRIPTION = """\
Supervised fine-tuning of the SFT policy (NLL of the response tokens).

    torchrun --nproc-per-node 8 -m megatron_rlhf train-sft \\
        --config examples/sft/tiny_cpu.yaml parallel.tp=2 parallel.pp=2 optim.lr=1e-5

Any tp/pp/dp; checkpoints in train.output_dir/step_N resume exactly and load as a policy
anywhere. Every config key, its default and meaning: --print-config.
"""


def build_parser() -> argparse.ArgumentParser:
    return config_parser("python -m megatron_rlhf train-sft", DESCRIPTION, "examples/sft/")


def main(argv: list[str]) -> int:
    build_parser().parse_args(argv)  # --help and usage errors before the heavy imports
    from megatron_rlhf.training.sft import main as train

    return train(argv)
