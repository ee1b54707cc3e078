"""One cadence for every trainer (issue 47, item 3): training/run.py's ``Run.due`` decides when
train-sft, train-reward and train-ppo save, log, evaluate and dump samples.

The rule: every ``train.<what>_interval`` steps and at the last step; 0 means only at the last.
Before it, train-ppo divided by ``train.save_interval`` and ``train.sample_interval`` (0 was a
ZeroDivisionError after the first step, its work lost) and never read ``train.log_interval``.
Each trainer here runs 3 steps with ``save_interval=0`` and ``log_interval=2``: one checkpoint
(step 3) and log lines for steps 2 and 3 only.
"""

from __future__ import annotations

import json
from pathlib import Path

from ppo_fixtures import launcher_env_kept, make_ppo_setup
from test_reward_train import save_hf_bloom, write_synthetic_pairs

CADENCE = ["train.steps=3", "train.save_interval=0", "train.log_interval=2"]


def logged_steps(run: Path, key: str) -> list[int]:
    """The steps of metrics.jsonl's lines that hold ``key``."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if key in row]


def checkpoints(run: Path) -> list[str]:
    return sorted(path.name for path in run.glob("step_*"))


def test_the_rule_is_every_interval_and_the_last_step():
    from types import SimpleNamespace

    from megatron_rlhf.training.run import Run

    run = object.__new__(Run)
    run.total_steps = 7
    run.config = SimpleNamespace(
        train=SimpleNamespace(save_interval=0, log_interval=3, sample_interval=1, save_at=[])
    )
    assert [s for s in range(1, 8) if run.due("save", s)] == [7]
    assert [s for s in range(1, 8) if run.due("log", s)] == [3, 6, 7]
    assert [s for s in range(1, 8) if run.due("sample", s)] == list(range(1, 8))
    assert [s for s in range(1, 8) if run.due("eval", s)] == [7]  # no such key: the end only
    run.config.train.save_at = [2, 5, 9]  # the study's curve steps: saved there, not between
    assert [s for s in range(1, 8) if run.due("save", s)] == [2, 5, 7]
    run.config.train.save_interval = 3
    assert [s for s in range(1, 8) if run.due("save", s)] == [2, 3, 5, 6, 7]


def test_save_at_steps_below_1_are_refused_by_every_trainers_check(tmp_path):
    from types import SimpleNamespace

    from megatron_rlhf.ppo.config import TrainSection
    from megatron_rlhf.training.config import TrainConfig, config_problems

    data = SimpleNamespace(eval_fraction=0.0, eval=None)
    message = "train.save_at=[4, 0]: steps must be >= 1, got [0]"
    assert message in config_problems(TrainConfig(output_dir=str(tmp_path), save_at=[4, 0]), data)
    assert message in TrainSection(save_at=[4, 0]).problems()
    assert TrainSection(save_at=[4]).problems() == []


def test_train_ppo_saves_at_the_listed_step_and_the_end_and_logs_every_other_step(tmp_path):
    """Failed before: ZeroDivisionError after step 1 (``ppo/train.py``'s ``done %
    save_interval``), and every step logged. ``train.save_at=[1]`` adds the step-1 checkpoint."""
    from megatron_rlhf.ppo.train_cli import main

    setup, run = make_ppo_setup(tmp_path), tmp_path / "run"
    argv = ["--config", str(setup["config"]), f"train.output_dir={run}", *CADENCE]
    short = ["rollout.prompts_per_step=8", "ppo.epochs=1", "ppo.num_minibatches=1"]
    with launcher_env_kept():
        settings = ["train.micro_batch_size=8", "train.sample_interval=0", "train.save_at=[1]"]
        assert main([*argv, *short, *settings]) == 0
    assert checkpoints(run) == ["step_0000001", "step_0000003"]
    assert logged_steps(run, "reward/mean") == [2, 3]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {row["step"] for row in samples} == {3}


def test_train_ppo_refuses_a_negative_interval_naming_the_key(tmp_path, capsys):
    from megatron_rlhf.ppo.train_cli import main

    setup = make_ppo_setup(tmp_path)
    argv = ["--config", str(setup["config"]), f"train.output_dir={tmp_path / 'run'}"]
    assert main([*argv, "train.sample_interval=-1", "train.log_interval=0"]) == 2
    err = capsys.readouterr().err
    assert "train.sample_interval=-1 must be >= 0" in err
    assert "train.log_interval=0 must be >= 1" in err


def test_train_reward_saves_only_at_the_end_and_logs_every_other_step(tmp_path):
    from megatron_rlhf.reward.train import main

    data = write_synthetic_pairs(tmp_path / "pairs", pairs_per_task=10)
    trunk = save_hf_bloom(tmp_path / "hf", num_outputs=None, seed=2)
    run = tmp_path / "run"
    argv = [
        f"model.load={trunk}", f"data.train={data}", f"train.output_dir={run}",
        "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_interval=0",
    ]  # fmt: skip
    with launcher_env_kept():
        assert main([*argv, *CADENCE]) == 0
    assert checkpoints(run) == ["step_0000003"]
    assert logged_steps(run, "train/loss") == [2, 3]


def test_train_sft_saves_only_at_the_end_and_logs_every_other_step(tmp_path):
    from megatron_rlhf.data import write_sft_dataset
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture
    from megatron_rlhf.training.sft import main

    save_random_hf_bloom(tmp_path / "hf", tiny_architecture(vocab_size=64), seed=0)
    examples = [([4 + i % 30, 5 + i % 20], [6 + i % 10]) for i in range(32)]
    write_sft_dataset(tmp_path / "train", examples, vocab_size=64, eos_id=2, pad_id=0)
    run = tmp_path / "run"
    argv = [
        f"model.load={tmp_path / 'hf'}", f"data.train={tmp_path / 'train'}",
        f"train.output_dir={run}", "train.global_batch_size=8", "train.micro_batch_size=8",
        "data.eval_fraction=0.25", "train.eval_interval=0",
    ]  # fmt: skip
    with launcher_env_kept():
        assert main([*argv, *CADENCE]) == 0
    assert checkpoints(run) == ["step_0000003"]
    assert logged_steps(run, "train/loss") == [2, 3]
    assert logged_steps(run, "eval/loss") == [3]  # eval_interval=0: at the end only
