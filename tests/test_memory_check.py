"""Refuse what cannot fit; say when a run is finished (issue 24, item 5).

An impossible batch is refused before any model is built, with the planner's figure, its largest
part and the key to change, on every trainer; ``--skip-memory-check`` overrides; resuming a
finished run says there is nothing left to do instead of printing ``train_loss=nan``.
"""

from __future__ import annotations

import re

import pytest
from ppo_fixtures import make_ppo_setup
from test_checkpoint_safety import reward_argv, reward_setup  # noqa: F401  (fixture)

HUGE = "100000000"


def one_error_line(err: str, command: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith(f"{command}: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_train_reward_refuses_an_impossible_batch_before_building_the_model(
    reward_setup,  # noqa: F811
    tmp_path,
    capsys,
    backend,
):
    from megatron_rlhf.reward.train import main

    argv = reward_argv(reward_setup, tmp_path / "run", steps=1)
    assert main([*argv, f"backend={backend}", f"train.global_batch_size={HUGE}"]) == 2
    line = one_error_line(capsys.readouterr().err, "train-reward")
    need = float(re.search(r"the planner predicts ([\d.e+]+) GB per rank", line).group(1))
    assert need > 1000  # 1e8 pairs x 2 sequences x 64 tokens x 32 B of inputs alone: 410 GB
    assert "GB of host RAM available" in line
    assert "largest part is inputs: lower it with train.global_batch_size" in line
    assert "--skip-memory-check" in line
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


def test_train_sft_refuses_an_impossible_micro_batch(tmp_path, capsys):
    from megatron_rlhf.data import write_sft_dataset
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture
    from megatron_rlhf.training.sft import main

    save_random_hf_bloom(tmp_path / "hf", tiny_architecture(vocab_size=64), seed=0)
    write_sft_dataset(tmp_path / "train", [([5, 6], [6, 5])] * 8, vocab_size=64, eos_id=2, pad_id=0)
    argv = [
        f"model.load={tmp_path / 'hf'}",
        f"data.train={tmp_path / 'train'}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.steps=1",
        f"train.global_batch_size={HUGE}",
        f"train.micro_batch_size={HUGE}",
    ]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err, "train-sft")
    assert "largest part is activations: lower it with train.micro_batch_size" in line
    assert not (tmp_path / "run").exists()


def test_train_ppo_refuses_an_impossible_rollout(tmp_path, capsys):
    from megatron_rlhf.ppo.train_cli import main

    setup = make_ppo_setup(tmp_path / "setup")
    argv = ["--config", str(setup["config"]), f"train.output_dir={tmp_path / 'run'}"]
    assert main([*argv, f"rollout.prompts_per_step={HUGE}", "ppo.num_minibatches=1"]) == 2
    line = one_error_line(capsys.readouterr().err, "train-ppo")
    assert "the planner predicts" in line and "rollout.prompts_per_step" in line
    assert not (tmp_path / "run").exists()


def test_check_fits_names_the_largest_part_and_can_be_skipped(monkeypatch):
    from megatron_rlhf.planning.memory import GB, Memory
    from megatron_rlhf.training import memory_check
    from megatron_rlhf.utils import InputError

    monkeypatch.setattr(memory_check, "available_bytes", lambda: (10 * GB, "10 GB here"))
    keys = {name: f"key.{name}" for name in ("weights", "activations", "inputs")}
    memory_check.check_fits(Memory(weights=6 * GB, activations=6 * GB), 0.0, keys)  # 1.2x
    with pytest.raises(InputError, match=r"predicts 13 GB per rank \(weights 6, activations 7 GB"):
        memory_check.check_fits(Memory(weights=6 * GB, activations=7 * GB), 0.0, keys)
    with pytest.raises(InputError, match=r"than 10 GB here; the largest part is inputs: .*key\.in"):
        memory_check.check_fits(Memory(weights=1 * GB), 20 * GB, keys)
    memory_check.check_fits(Memory(weights=1 * GB), 20 * GB, keys, skip=True)


def test_skip_memory_check_is_a_flag_of_every_trainer():
    from megatron_rlhf.config import config_parser

    args = config_parser("p", "d", "e").parse_args(["--skip-memory-check", "a=1"])
    assert args.skip_memory_check and args.overrides == ["a=1"]


def test_resuming_a_finished_run_says_there_is_nothing_left(reward_setup, tmp_path, capsys):  # noqa: F811
    from megatron_rlhf.reward.train import main

    argv = reward_argv(reward_setup, tmp_path / "run", steps=1)
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "nothing left to do: " in captured.err
    assert "step_0000001 is at step 1 of 1; raise train.steps" in captured.err
    summary = [x for x in (captured.out + captured.err).splitlines() if "] done:" in x]
    assert summary and "train_loss=-" in summary[0] and "nan" not in summary[0], summary


def test_train_ppo_disaggregated_checks_each_side_with_its_own_roles(monkeypatch, tmp_path):
    """Disaggregated, a training rank holds the four roles without the rollout copy and a
    rollout rank the copy alone: the check takes the fuller side, not their sum (which a
    colocated rank holds)."""
    from megatron_rlhf.config import load_config
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.ppo.setup import validate_config
    from megatron_rlhf.training import memory_check

    setup = make_ppo_setup(tmp_path / "setup")
    checked = {}
    monkeypatch.setattr(
        memory_check, "check_fits", lambda memory, *_a, **_k: checked.setdefault("m", memory)
    )
    totals = {}
    for mode, world in (("colocated", 2), ("disaggregated", 4)):  # the same layouts
        overrides = [f"placement.mode={mode}", "parallel.rollout.tp=2"]
        if mode == "disaggregated":
            overrides.append("placement.rollout_ranks=2")
        config = load_config(TrainPPOConfig, setup["config"], overrides)
        plan = validate_config(config, world)
        memory_check.check_ppo(plan.config, plan.archs, plan.layouts)
        totals[mode] = checked.pop("m")
    colocated, disaggregated = totals["colocated"], totals["disaggregated"]
    assert disaggregated.weights < colocated.weights  # the copy is not on the training side
    assert disaggregated.optimizer == colocated.optimizer  # the actor's and critic's Adam
