"""``python -m megatron_rlhf <command> [args]``, with or without torchrun.

Each command lives in its own module exposing ``main(argv: list[str]) -> int``; modules are
imported only when their command runs, so ``--help`` stays fast (megatron-core costs ~7 s).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys

# command -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("megatron_rlhf.demo", "the whole pipeline on a tiny random BLOOM on the CPU"),
    "generate": ("megatron_rlhf.generation.cli", "batched KV-cached generation at any TP/PP"),
    "train-sft": ("megatron_rlhf.training.sft_cli", "supervised fine-tuning of the SFT policy"),
    "train-reward": ("megatron_rlhf.reward.train_cli", "train a Reward Model or Advantage Model"),
    "score": ("megatron_rlhf.reward.score", "score (prompt, response) pairs with an RM/AM"),
    "eval-reward": ("megatron_rlhf.reward.evaluate", "accuracy, ECE and per-task score stats"),
    "train-ppo": ("megatron_rlhf.ppo.train_cli", "PPO (optionally with Selective Rehearsal)"),
    "eval-policy": ("megatron_rlhf.ppo.evaluate", "win/tie/lose of a policy against SFT"),
    "study": ("megatron_rlhf.study.run", "the paper's claims measured with seeds and intervals"),
}


def _usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        "usage: python -m megatron_rlhf <command> [--help] [args]  |  --version",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(version_report())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


def version_report() -> str:
    """Versions of the stack and which optional GPU back-ends are present (nothing imported)."""
    from megatron_rlhf import __version__

    lines = [f"megatron-rlhf {__version__}"]
    for package in ("torch", "megatron-core", "transformers"):
        try:
            lines.append(f"  {package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            lines.append(f"  {package} not installed")
    for module, name in (("transformer_engine", "Transformer Engine"), ("apex", "Apex")):
        if importlib.util.find_spec(module) is None:
            lines.append(
                f"  {name} not installed: Megatron-Core uses its local PyTorch layers, norms and "
                "optimizers (its import-time warning about this is silenced)"
            )
        else:
            lines.append(f"  {name} installed")
    triton = importlib.util.find_spec("triton") is not None
    lines.append(f"  Triton {'installed' if triton else 'not installed: PyTorch kernels'}")
    return "\n".join(lines)
