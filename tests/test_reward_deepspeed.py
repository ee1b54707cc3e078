"""``train-reward backend=deepspeed`` (transformers BLOOM under ZeRO) against the Megatron path.

One 2-process torchrun launch (tests/dist_reward_deepspeed.py) trains the AM under ZeRO-1, 2
and 3, resumes a killed ZeRO-3 run, scores pairs with the ZeRO-3 checkpoint at TP=2 and TP=1,
and runs a train-ppo step with it as reward model and critic. Here, in this process: the same
AM trained by the Megatron path on one process (same seed, data, hyperparameters, fresh head
initialised identically); per-step train and evaluation losses must agree to rel. 2e-3 and the
two trained models must score the pairs alike; the checkpoints convert both ways.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from ppo_fixtures import make_ppo_setup
from torchrun_util import REPO, assert_check, run_checks

STAGES = (1, 2, 3)
TOLERANCE = 2e-3
DIST_CHECKS = [f"zero{s}_trains" for s in STAGES] + [
    "zero3_killed_and_resumed_losses_equal_uninterrupted_bitwise",
    "zero3_killed_and_resumed_final_evaluation_equal",
    "score_zero3_checkpoint_tp2_equals_tp1",
    "ppo_step_with_zero3_am_as_reward_and_critic",
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_pairs(prefix: Path, vocab_size: int, count: int = 24) -> Path:
    """Random preference pairs over the PPO setup's vocabulary, ragged lengths."""
    from megatron_rlhf.data import Example, write_preference_dataset

    generator = torch.Generator().manual_seed(3)

    def tokens(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high, (1,), generator=generator))
        return torch.randint(4, vocab_size, (length,), generator=generator).tolist()

    examples = []
    for _ in range(count):
        chosen, rejected = tokens(2, 6), tokens(2, 6)
        if chosen == rejected:
            rejected = rejected + [5]
        examples.append(Example(tokens(2, 7), (chosen, rejected), None))
    write_preference_dataset(prefix, examples, vocab_size=vocab_size, pad_id=3, append_eos=False)
    return prefix


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom
    from megatron_rlhf.reward import score
    from megatron_rlhf.reward import train as train_reward

    root = tmp_path_factory.mktemp("reward_deepspeed")
    ppo = make_ppo_setup(root / "ppo")
    save_random_hf_bloom(root / "hf_trunk", ppo["arch"], seed=5)  # no score head: a fresh one
    data = write_pairs(root / "pairs", ppo["arch"].vocab_size)
    config = {
        "loss": "am",
        "model": {"load": str(root / "hf_trunk")},
        "data": {"train": str(data), "eval_fraction": 0.25},
        "am": {"margin": 1.5},
        "optim": {"lr": 3e-3, "warmup_fraction": 0.25, "weight_decay": 0.01},
        "train": {
            "global_batch_size": 4,
            "steps": 4,
            "eval_interval": 2,
            "save_interval": 2,
            "log_interval": 1,
            "seed": 11,
        },
    }
    (root / "am.yaml").write_text(yaml.safe_dump(config))
    megatron_dir = root / "megatron"
    assert (
        train_reward.main(["--config", str(root / "am.yaml"), f"train.output_dir={megatron_dir}"])
        == 0
    )
    megatron_ckpt = megatron_dir / (megatron_dir / "latest_checkpoint.txt").read_text().strip()
    argv = ["--load", str(megatron_ckpt), "--input", str(data)]
    assert score.main([*argv, "--output", str(root / "scores_megatron.jsonl")]) == 0
    results = run_checks(
        REPO / "tests" / "dist_reward_deepspeed.py",
        2,
        root / "results",
        "--config",
        str(root / "am.yaml"),
        "--data",
        str(data),
        "--ppo-config",
        str(ppo["config"]),
        "--work",
        str(root / "work"),
    )
    return {"root": root, "results": results, "data": data, "megatron_ckpt": megatron_ckpt}


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("check", DIST_CHECKS)
def test_deepspeed_launch(runs, check):
    assert_check(runs["results"], check)


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("stage", STAGES)
def test_zero_losses_match_megatron_on_one_process(runs, stage):
    megatron = read_jsonl(runs["root"] / "megatron" / "metrics.jsonl")
    deepspeed = read_jsonl(runs["root"] / "work" / f"zero{stage}" / "metrics.jsonl")
    assert [sorted(r) for r in deepspeed] == [sorted(r) for r in megatron]
    assert [r["step"] for r in megatron if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in megatron if "eval/loss" in r] == [2, 4]
    compared = ("loss", "accuracy", "lr", "grad_norm", "ece")
    for ours, theirs in zip(deepspeed, megatron):
        for key in [k for k in theirs if k.split("/")[-1] in compared]:
            gap = abs(ours[key] - theirs[key]) / max(abs(theirs[key]), 1e-6)
            assert gap < TOLERANCE, (stage, ours["step"], key, ours[key], theirs[key])
    moved = [r["train/loss"] for r in megatron if "train/loss" in r]
    assert max(moved) - min(moved) > 1e-3, f"training did not change the loss: {moved}"


@pytest.mark.launch(ranks=2)
def test_both_trained_models_score_pairs_alike(runs):
    megatron = read_jsonl(runs["root"] / "scores_megatron.jsonl")
    deepspeed = read_jsonl(runs["root"] / "work" / "scores_tp2.jsonl")
    assert len(megatron) == len(deepspeed) == 24
    for ours, theirs in zip(deepspeed, megatron):
        for key in ("chosen_score", "rejected_score"):
            assert abs(ours[key] - theirs[key]) < TOLERANCE * max(1.0, abs(theirs[key]))


@pytest.mark.launch(ranks=2)
def test_checkpoints_convert_both_ways(runs, tmp_path):
    """hf-to-megatron of the ZeRO-3 checkpoint scores as it does; megatron-to-hf of the
    Megatron-trained AM loads into the DeepSpeed model with both head outputs."""
    from megatron_rlhf.checkpoint.convert import main as convert
    from megatron_rlhf.reward import score
    from megatron_rlhf.reward.model import advantage_scores, read_scalars
    from megatron_rlhf.reward.train_deepspeed import load_scalar_bloom

    zero3 = runs["root"] / "work" / "zero3"
    zero3_ckpt = zero3 / (zero3 / "latest_checkpoint.txt").read_text().strip()
    assert (
        convert(["hf-to-megatron", "--load", str(zero3_ckpt), "--save", str(tmp_path / "m")]) == 0
    )
    out = tmp_path / "scores.jsonl"
    assert (
        score.main(
            ["--load", str(tmp_path / "m"), "--input", str(runs["data"]), "--output", str(out)]
        )
        == 0
    )
    converted, original = read_jsonl(out), read_jsonl(runs["root"] / "work" / "scores_tp1.jsonl")
    gap = max(abs(a["chosen_score"] - b["chosen_score"]) for a, b in zip(converted, original))
    assert len(converted) == 24 and gap < 1e-5

    assert (
        convert(
            ["megatron-to-hf", "--load", str(runs["megatron_ckpt"]), "--save", str(tmp_path / "hf")]
        )
        == 0
    )
    model = load_scalar_bloom(tmp_path / "hf", num_outputs=2, dtype=torch.float32).eval()
    from megatron_rlhf.data import PreferenceDataset

    pair = PreferenceDataset(str(runs["data"]))[0]
    ids = torch.cat([pair["prompt_ids"], pair["chosen_ids"]])[None]
    with torch.no_grad():
        rewards, expected = read_scalars(
            model(ids, torch.ones_like(ids)),
            torch.ones_like(ids),
            torch.tensor([len(pair["prompt_ids"])]),
        )
    megatron_first = read_jsonl(runs["root"] / "scores_megatron.jsonl")[0]
    assert (
        abs(float(advantage_scores(rewards, expected)[0]) - megatron_first["chosen_score"]) < 1e-5
    )
    assert (
        convert(["megatron-to-hf", "--load", str(zero3_ckpt), "--save", str(tmp_path / "copy")])
        == 0
    )
    assert (tmp_path / "copy" / "model.safetensors").exists()


def test_zero3_example_keeps_the_paper_settings():
    from megatron_rlhf.config import load_config
    from megatron_rlhf.reward.train import RewardTrainConfig

    config = load_config(RewardTrainConfig, REPO / "examples/reward/bloomz_7b1_am_zero3.yaml")
    megatron = load_config(RewardTrainConfig, REPO / "examples/reward/bloomz_7b1_am.yaml")
    assert config.backend == "deepspeed" and config.deepspeed.zero_stage == 3
    assert config.optim == megatron.optim and config.am == megatron.am
    assert config.train.global_batch_size == megatron.train.global_batch_size == 180
    script = (REPO / "examples/reward/train_bloomz_7b1_am_zero3.sh").read_text()
    assert "GPUS_PER_NODE:-6" in script and 180 % 6 == 0


def test_deepspeed_backend_refuses_model_parallel_layouts(tmp_path):
    from megatron_rlhf.config import load_config
    from megatron_rlhf.reward.train import RewardTrainConfig, train
    from megatron_rlhf.utils import InputError

    config = load_config(
        RewardTrainConfig,
        None,
        [
            "backend=deepspeed",
            "model.load=/nonexistent",
            "parallel.tp=2",
            "deepspeed.zero_stage=4",
            "data.train=/nonexistent",
            f"train.output_dir={tmp_path}",
        ],
    )
    with pytest.raises(InputError, match="parallel.tp=1 parallel.pp=1") as error:
        train(config)
    assert "deepspeed.zero_stage=4 must be 1, 2 or 3" in str(error.value)
