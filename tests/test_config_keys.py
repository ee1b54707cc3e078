"""One key for one setting (issue 47 item 4): every command spells a setting the same way.

``model`` (``models`` in train-ppo) says where the weights come from, ``parallel`` how they are
laid out, and ``train`` (training/config.py ``RunConfig``) how the run builds, batches and
executes its models. The keys these settings had before still load, at the new key, with one
warning each; an old key and its new key with different values are refused naming both.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import typing

import pytest
import yaml

from megatron_rlhf import config as loader
from megatron_rlhf.config import load_config, moved_keys, to_dict
from megatron_rlhf.utils import InputError

CANONICAL = (
    "train.bf16",
    "train.recompute_activations",
    "train.attention_backend",
    "train.micro_batch_size",
    "train.packing",
    "train.max_tokens_per_micro_batch",
    "train.seed",
    "parallel.tp",
    "parallel.pp",
    "parallel.sequence_parallel",
)
"""The settings that once had two spellings, at their one key (the same in every command)."""

MOVED = {
    "train-sft": {
        "model.bf16": "train.bf16",
        "model.recompute_activations": "train.recompute_activations",
        "model.attention_backend": "train.attention_backend",
        "model.seed": "train.seed",
        "model.tp": "parallel.tp",
        "model.pp": "parallel.pp",
        "model.sequence_parallel": "parallel.sequence_parallel",
    },
    "train-ppo": {
        "models.attention_backend": "train.attention_backend",
        "ppo.micro_batch_size": "train.micro_batch_size",
        "ppo.packing": "train.packing",
        "ppo.max_tokens_per_micro_batch": "train.max_tokens_per_micro_batch",
    },
}
MOVED["train-reward"] = MOVED["train-sft"]

VALUES = {
    "train.bf16": True,
    "train.recompute_activations": True,
    "train.attention_backend": "torch",
    "train.micro_batch_size": 2,
    "train.packing": False,
    "train.max_tokens_per_micro_batch": 64,
    "train.seed": 7,
    "parallel.tp": 2,
    "parallel.pp": 2,
    "parallel.sequence_parallel": True,
}
"""A value other than the default for each moved setting."""

SAME_NAME_ALLOWED = {
    ("gamma", ("ppo", "rehearsal")): "ppo.gamma is GAE's discount, rehearsal.gamma the weight "
    "of Eq. 9's NLL term",
    ("micro_batch_size", ("rehearsal", "train")): "rehearsal.micro_batch_size counts the "
    "rehearsal rows added to each actor micro-batch of train.micro_batch_size sequences",
}
"""(leaf name, the sections that have it): two settings under one name, and why."""


def _schema(command: str):
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.reward.config import RewardTrainConfig
    from megatron_rlhf.training.sft import SFTConfig

    return {"train-sft": SFTConfig, "train-reward": RewardTrainConfig, "train-ppo": TrainPPOConfig}[
        command
    ]


def _required(command: str) -> dict:
    if command == "train-ppo":
        return {"models": {"actor": "a", "critic": "c"}, "data": {"prompts": "p"}}
    return {"model": {"load": "m"}, "data": {"train": "d"}, "train": {"output_dir": "o"}}


def _overrides(tree: dict, prefix: str = "") -> list[str]:
    items = []
    for key, value in tree.items():
        if isinstance(value, dict):
            items += _overrides(value, f"{prefix}{key}.")
        else:
            items.append(f"{prefix}{key}={json.dumps(value)}")
    return items


def _with(tree: dict, dotted: str, value) -> dict:
    tree = json.loads(json.dumps(tree))
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return tree


def _main(command: str):
    from megatron_rlhf.ppo.train_cli import main as ppo_main
    from megatron_rlhf.reward.train_cli import main as reward_main
    from megatron_rlhf.training.sft_cli import main as sft_main

    return {"train-sft": sft_main, "train-reward": reward_main, "train-ppo": ppo_main}[command]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the first warning of every old key (one warning per key per process)."""
    monkeypatch.setattr(loader, "_WARNED", set())


@pytest.mark.parametrize("command", ["train-sft", "train-reward", "train-ppo"])
def test_print_config_holds_each_canonical_key_and_no_old_one(command, capsys):
    assert _main(command)(["--print-config"]) == 0
    printed = {line.split(" = ")[0] for line in capsys.readouterr().out.splitlines()}
    assert set(CANONICAL) <= printed
    assert not printed & set(MOVED[command])
    assert moved_keys(_schema(command)) == MOVED[command]


@pytest.mark.parametrize(
    "command, old",
    [
        (command, old)
        for command in ("train-sft", "train-reward", "train-ppo")
        for old in MOVED[command]
    ],
)
def test_an_old_key_loads_at_its_new_key_with_one_warning(
    tmp_path, capsys, fresh_warnings, command, old
):
    """In a YAML file and as an override: the same resolved config as the new key, and the
    moved-key message once on stderr."""
    schema, new = _schema(command), MOVED[command][old]
    value = VALUES[new]
    expected = to_dict(load_config(schema, None, _overrides(_with(_required(command), new, value))))
    assert _get(expected, new) == value

    as_override = load_config(
        schema, None, [*_overrides(_required(command)), f"{old}={json.dumps(value)}"]
    )
    assert to_dict(as_override) == expected
    message = f"config key {old} has moved to {new}; write {new}={json.dumps(value)} instead"
    assert capsys.readouterr().err == f"warning: command line: {message}\n"

    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_with(_required(command), old, value)))
    loader._WARNED.clear()
    assert to_dict(load_config(schema, path)) == expected
    assert capsys.readouterr().err == f"warning: {path}: {message}\n"
    assert to_dict(load_config(schema, path)) == expected  # warned once per process
    assert capsys.readouterr().err == ""


def test_the_warning_is_rank_0s(capsys, fresh_warnings, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    config = load_config(
        _schema("train-sft"), None, [*_overrides(_required("train-sft")), "model.bf16=true"]
    )
    assert config.train.bf16 is True
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("where", ["file", "overrides"])
def test_an_old_key_and_its_new_key_with_different_values_are_refused(
    tmp_path, fresh_warnings, where
):
    schema, required = _schema("train-ppo"), _required("train-ppo")
    both = _with(_with(required, "ppo.micro_batch_size", 2), "train.micro_batch_size", 8)
    if where == "file":
        path, overrides = tmp_path / "both.yaml", []
        path.write_text(yaml.safe_dump(both))
    else:
        path, overrides = None, _overrides(both)
    with pytest.raises(InputError, match=r"ppo\.micro_batch_size=2 and train\.micro_batch_size=8"):
        load_config(schema, path, overrides)
    same = _with(both, "train.micro_batch_size", 2)  # one value twice: no conflict
    assert load_config(schema, None, _overrides(same)).train.micro_batch_size == 2


def test_an_override_with_the_new_key_replaces_a_files_old_key(tmp_path, fresh_warnings):
    """An override overrides, whichever spelling the file used."""
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_with(_required("train-sft"), "model.bf16", True)))
    assert load_config(_schema("train-sft"), path, ["train.bf16=false"]).train.bf16 is False


@pytest.mark.parametrize("command", ["train-sft", "train-reward", "train-ppo"])
def test_a_run_saved_with_old_keys_resumes(tmp_path, monkeypatch, fresh_warnings, capsys, command):
    """A checkpoint's saved config written before the move (old keys) is no change on resume;
    a real change of a moved setting is still refused, under its new key."""
    from megatron_rlhf.checkpoint import dist as checkpoint_dist
    from megatron_rlhf.config import config_defaults
    from megatron_rlhf.runtime import locks
    from megatron_rlhf.training import checkpointing
    from megatron_rlhf.training.run_dir import open_run

    schema = _schema(command)
    config = to_dict(load_config(schema, None, _overrides(_required(command))))
    saved = json.loads(json.dumps(config))
    for old, new in MOVED[command].items():  # as the run before the move wrote it
        section, key = new.split(".")
        old_section, old_key = old.split(".")
        saved[old_section][old_key] = saved[section].pop(key)
    checkpoint = tmp_path / "step_0000004"
    monkeypatch.setattr(checkpointing, "latest_checkpoint", lambda _: checkpoint)
    monkeypatch.setattr(checkpointing, "resume_checkpoint", lambda _: checkpoint)
    monkeypatch.setattr(
        checkpoint_dist, "read_metadata", lambda _: {"config": json.loads(json.dumps(saved))}
    )

    def resume(resolved):
        return open_run(
            tmp_path, resolved, resume=True, overwrite=False, force_config_change=False,
            allowed=("train.steps",), defaults=config_defaults(schema), moved=moved_keys(schema),
        )  # fmt: skip

    try:
        assert resume(config) == checkpoint
        assert "config changed" not in capsys.readouterr().err
        overrides = [*_overrides(_required(command)), "train.seed=9"]
        with pytest.raises(InputError, match=r"resuming with a changed config \(train\.seed\)"):
            resume(to_dict(load_config(schema, None, overrides)))
    finally:
        locks.release()


@pytest.mark.parametrize("command", ["train-sft", "train-reward", "train-ppo"])
def test_no_setting_is_a_field_of_two_sections(command):
    """A leaf name under two top-level sections of one command is one setting spelled twice
    (e.g. bf16 in ``model`` and ``train``), unless the sections are one schema repeated per
    role (``actor_optim``, ``critic_optim``) or the name is two settings listed, with why, in
    SAME_NAME_ALLOWED."""
    assert _spelled_twice(_schema(command)) == {}


@dataclasses.dataclass
class _Model:
    load: str = "m"
    bf16: bool = False


@dataclasses.dataclass
class _Train:
    bf16: bool = False


@dataclasses.dataclass
class _TwoSpellings:
    model: _Model = dataclasses.field(default_factory=_Model)
    train: _Train = dataclasses.field(default_factory=_Train)


def test_the_check_finds_a_setting_spelled_twice():
    assert _spelled_twice(_TwoSpellings) == {"bf16": ["model", "train"]}


def _spelled_twice(cls) -> dict[str, list[str]]:
    """{leaf name: the top-level sections holding it} for each name under two or more sections
    of different schemas that SAME_NAME_ALLOWED does not explain."""
    sections: dict[str, dict[str, type]] = collections.defaultdict(dict)
    for section, schema, name in _leaf_owners(cls):
        sections[name][section] = schema
    return {
        name: sorted(owners)
        for name, owners in sections.items()
        if len(set(owners.values())) > 1 and (name, tuple(sorted(owners))) not in SAME_NAME_ALLOWED
    }


def _leaf_owners(cls):
    """(top-level section, its schema, leaf name) of every leaf of the tree ``cls``."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            for name in _leaf_names(hint):
                yield loader.key_of(field), hint, name
        else:
            yield "", cls, field.name


def _leaf_names(cls):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from _leaf_names(hints[field.name])
        else:
            yield field.name


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree
