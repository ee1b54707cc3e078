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
