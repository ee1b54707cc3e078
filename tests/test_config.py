"""The config loader: files + key=value overrides into nested dataclasses, clear errors."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from megatron_rlhf.config import load_config, to_dict
from megatron_rlhf.utils import InputError


@dataclass(kw_only=True)
class Optim:
    lr: float = 1e-5
    steps: int = 3


@dataclass(kw_only=True)
class Run:
    loss: Literal["am", "rm"] = "am"
    load: str
    optim: Optim = field(default_factory=Optim)
    tag: str | None = None


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("load: ckpt\noptim:\n  lr: 1.0e-4\n  steps: 7\n")
    config = load_config(Run, path, ["optim.lr=2e-3", "loss=rm", "tag=7"])
    assert config == Run(loss="rm", load="ckpt", optim=Optim(lr=2e-3, steps=7), tag="7")
    assert to_dict(config)["optim"] == {"lr": 2e-3, "steps": 7}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["load=x", "optim.lrr=1"], "unknown config key optim.lrr; did you mean optim.lr?"),
        (["load=x", "loss=zz"], "loss='zz'; choose one of ['am', 'rm']"),
        ([], "missing required config key load"),
        (["load=x", "optim.steps=1.5"], "optim.steps=1.5 must be of type int"),
        (["load=x", "optim=3"], "optim must be a section"),
        (["loadx"], "expected key=value"),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(InputError) as err:
        load_config(Run, None, overrides)
    assert message in str(err.value)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("load: x\nlearning_rate: 3\n")
    with pytest.raises(InputError, match=r"bad.yaml: unknown config key learning_rate"):
        load_config(Run, path)


@pytest.mark.parametrize("command", ["train-sft", "train-reward"])
@pytest.mark.parametrize(
    "old, new, value",
    [
        ("model.tp", "parallel.tp", "2"),
        ("model.pp", "parallel.pp", "2"),
        ("model.sequence_parallel", "parallel.sequence_parallel", "true"),
    ],
)
def test_moved_layout_keys_load_in_the_parallel_section(
    tmp_path, capsys, monkeypatch, command, old, new, value
):
    """train-sft and train-reward take their layout in ``parallel`` like train-ppo; the old
    ``model.tp``-style keys still load there, in a file or as an override, with a warning
    naming the new key (tests/test_config_keys.py: the other moved keys)."""
    from megatron_rlhf import config as loader
    from megatron_rlhf.reward.train import RewardTrainConfig
    from megatron_rlhf.training.sft import SFTConfig

    cls = {"train-sft": SFTConfig, "train-reward": RewardTrainConfig}[command]
    required = ["model.load=m", "data.train=d", "train.output_dir=o"]
    expected = load_config(cls, None, [*required, f"{new}={value}"])
    _, key = new.split(".")
    assert getattr(expected.parallel, key) == (True if value == "true" else int(value))
    monkeypatch.setattr(loader, "_WARNED", set())
    assert load_config(cls, None, [*required, f"{old}={value}"]) == expected
    warning = f"command line: config key {old} has moved to {new}; write {new}={value} instead"
    assert warning in capsys.readouterr().err
    path = tmp_path / "old.yaml"
    path.write_text(f"model:\n  load: m\n  {key}: {value}\n")
    monkeypatch.setattr(loader, "_WARNED", set())
    assert load_config(cls, path, required[1:]) == expected
    assert f"{path}: config key {old} has moved to {new};" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train-sft", "train-reward", "train-ppo"])
def test_attention_backend_is_a_run_setting_with_its_choices(command):
    """``train.attention_backend`` (every model of the run, every role of train-ppo) reaches the
    model builders; a name that is not a backend is refused naming the choices."""
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.reward.train import RewardTrainConfig
    from megatron_rlhf.training.sft import SFTConfig

    schema, required = {
        "train-sft": (SFTConfig, ["model.load=m", "data.train=d", "train.output_dir=o"]),
        "train-reward": (RewardTrainConfig, ["model.load=m", "data.train=d", "train.output_dir=o"]),
        "train-ppo": (TrainPPOConfig, ["models.actor=a", "models.critic=c", "data.prompts=p"]),
    }[command]
    config = load_config(schema, None, [*required, "train.attention_backend=triton"])
    assert config.train.attention_backend == "triton"
    with pytest.raises(InputError, match=r"attention_backend='flash'; choose one of"):
        load_config(schema, None, [*required, "train.attention_backend=flash"])
