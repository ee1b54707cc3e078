"""A tiny PPO setup on disk: random HF BLOOM actor, prompt and rehearsal datasets, a config."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import yaml

VOCAB = 64


def make_ppo_setup(
    root: Path, vocab_size: int = VOCAB, hidden_size: int = 32, num_heads: int = 4
) -> dict:
    """``hidden_size`` / ``num_heads``: vLLM's CPU attention needs heads of >= 32 (64 / 2)."""
    from megatron_rlhf.data import write_prompt_dataset, write_sft_dataset
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    arch = tiny_architecture(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=2, num_heads=num_heads
    )
    save_random_hf_bloom(root / "actor", arch, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(4, vocab_size, (int(torch.randint(2, 6, (1,), generator=generator)),),
                      generator=generator).tolist()
        for _ in range(64)
    ]  # fmt: skip
    write_prompt_dataset(root / "prompts", prompts, vocab_size=vocab_size, eos_id=2, pad_id=3)
    write_sft_dataset(
        root / "rehearsal", [(p, [9, 10, 11]) for p in prompts[:16]],
        vocab_size=vocab_size, eos_id=2, pad_id=3,
    )  # fmt: skip
    config = {
        "models": {
            "actor": str(root / "actor"),
            "critic": str(root / "actor"),
            "reward_fn": "ppo_reward:target_token_share",
        },
        "data": {"prompts": str(root / "prompts")},
        "rollout": {"prompts_per_step": 16, "max_new_tokens": 8},
        "ppo": {"num_minibatches": 2, "epochs": 2, "kl": {"coef": 0.01}},
        "actor_optim": {"lr": 2.0e-2, "warmup_fraction": 0.0},
        "critic_optim": {"lr": 3.0e-3, "warmup_fraction": 0.0},
        # Seed 1: since sampling draws one uniform per (step, row) (fe42945) the 12-step outcome
        # depends on the seed: mean reward of steps 10-12 was 0.42 / 0.91 / 0.80 / 0.51 for seeds
        # 1234 / 1 / 2 / 3 (every seed rises from ~0.02). The tests' bounds are unchanged. With
        # seed 2, TP=2 samples what TP=1 does for 6 steps, then rounding flips a token
        # (tests/test_ppo_training.py test_seed_2_tp2_samples_equal_tp1_until_rounding_flips_one).
        "train": {
            "steps": 12,
            "save_interval": 4,
            "sample_interval": 4,
            "seed": 1,
            "micro_batch_size": 4,
        },
    }
    (root / "ppo.yaml").write_text(yaml.safe_dump(config))
    return {"root": root, "config": root / "ppo.yaml", "arch": arch}


def make_advantage_model(root: Path, hf_dir: Path) -> Path:
    """A 2-output (r, e_tau) scalar-head checkpoint on the HF trunk: a stand-in for a trained
    Advantage Model (its head is the model's seeded random init). Saved in a child process, so
    the caller's torch.distributed state is untouched."""
    import subprocess
    import sys

    target = root / "am"
    script = (
        "from megatron_rlhf.checkpoint import load_bloom\n"
        "from megatron_rlhf.checkpoint import dist as ckpt\n"
        "from megatron_rlhf.distributed import initialize, destroy\n"
        "if __name__ == '__main__':\n"
        "    initialize()\n"
        f"    model = load_bloom({str(hf_dir)!r}, head='scalar', num_scalar_outputs=2)\n"
        f"    ckpt.save({str(target)!r}, model.sharded_state_dict(), ckpt.model_metadata(model))\n"
        "    destroy()\n"
    )
    script_path = root / "make_am.py"
    script_path.write_text(script)
    subprocess.run([sys.executable, str(script_path)], check=True, capture_output=True)
    return target


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def launcher_env_kept():
    """A command run in this process leaves the launcher's variables as it found them."""
    saved = {key: os.environ.get(key) for key in LAUNCHER_ENV}
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.update({key: value})
