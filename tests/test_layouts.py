"""Layouts: the one validator's messages, per-role inheritance, the emitted section, the flag
dialect (pure, no launch)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megatron_rlhf.config import load_config
from megatron_rlhf.distributed.layouts import (
    Layout,
    ParallelSection,
    check_global_batch,
    layouts_to_dict,
    resolve_layouts,
    validate_layouts,
)
from megatron_rlhf.utils import InputError

ISSUE_SECTION = [
    "actor.tp=2", "actor.pp=2", "critic.tp=2", "critic.pp=1", "reward.tp=1", "rollout.tp=2",
    "rollout.pp=1",
]  # fmt: skip


def _section(*overrides: str) -> ParallelSection:
    return load_config(ParallelSection, None, list(overrides))


HEADS6_LAYERS4 = SimpleNamespace(num_heads=6, num_layers=4)


@pytest.mark.parametrize(
    "role, tp, pp, world, expected",
    [
        ("", 4, 1, 4, ["parallel: num_heads 6 is not divisible by tp=4",
                       "pick parallel.tp among [1, 2, 3, 6]"]),
        ("", 1, 3, 3, ["parallel: num_layers 4 is not divisible by pp=3",
                       "pick parallel.pp among [1, 2, 4]"]),
        ("", 2, 2, 6, ["parallel: world size 6 is not divisible by tp*pp = 2*2 = 4",
                       "launch a multiple of 4 processes or change parallel.tp/pp"]),
        ("", 0, 1, 1, ["parallel: tp=0 and pp=1 must be >= 1"]),
        ("critic", 1, 0, 1, ["parallel.critic: tp=1 and pp=0 must be >= 1"]),
        ("judge", 4, 3, 6, ["parallel.judge: world size 6 is not divisible by tp*pp = 4*3 = 12",
                            "pick parallel.judge.tp among [1, 2, 3, 6]",
                            "pick parallel.judge.pp among [1, 2, 4]"]),
    ],
)  # fmt: skip
def test_the_validator_refuses_each_bad_layout_naming_its_key(role, tp, pp, world, expected):
    """Every command's layout (train-sft/-reward, train-ppo's roles, the flag commands,
    ``initialize``, the converters, the planner) goes through ``validate_layouts``: each
    problem is named with its config key and the fix, all of them in one error."""
    with pytest.raises(InputError) as err:
        validate_layouts({role: (tp, pp)}, world, {role: HEADS6_LAYERS4})
    message = str(err.value)
    assert message.startswith("invalid parallel layout:\n  - ")
    for part in expected:
        assert part in message


def test_the_validator_returns_one_layout_per_role():
    """A valid layout comes back with its data-parallel size; a role without a model is
    checked against the world size only; sequence parallelism is carried (it takes effect
    where tp > 1, so tp = 1 is not refused)."""
    layouts = validate_layouts(
        {"": (2, 2), "reward": (3, 1)}, 12, {"": HEADS6_LAYERS4}, sequence_parallel=True
    )
    assert layouts == {
        "": Layout(tp=2, pp=2, dp=3, sequence_parallel=True),
        "reward": Layout(tp=3, pp=1, dp=4, sequence_parallel=True),
    }
    assert validate_layouts({"": (1, 1)}, 3, sequence_parallel=True)[""].dp == 3


def test_old_config_gives_every_role_the_shared_layout():
    layouts = resolve_layouts(_section("tp=2", "pp=2"), world_size=8)
    assert {role: (lay.tp, lay.pp, lay.dp) for role, lay in layouts.items()} == {
        role: (2, 2, 2) for role in ("actor", "reference", "critic", "reward", "rollout")
    }


def test_issue_layout_and_inheritance():
    layouts = resolve_layouts(_section(*ISSUE_SECTION), world_size=4)
    assert layouts["actor"].as_dict() == {"tp": 2, "pp": 2, "dp": 1}
    assert layouts["reference"].as_dict() == {"tp": 2, "pp": 2, "dp": 1}  # the actor's
    assert layouts["critic"].as_dict() == {"tp": 2, "pp": 1, "dp": 2}
    assert layouts["reward"].as_dict() == {"tp": 1, "pp": 1, "dp": 4}
    assert layouts["rollout"].as_dict() == {"tp": 2, "pp": 1, "dp": 2}
    # rollout.pp unset -> the actor's pp, not parallel.pp
    rollout = resolve_layouts(_section("actor.pp=2", "rollout.tp=1"), 4, roles=("rollout",))
    assert rollout["rollout"].pp == 2


def test_emitted_section_round_trips(tmp_path):
    layouts = resolve_layouts(_section(*ISSUE_SECTION), world_size=4)
    path = tmp_path / "parallel.yaml"
    path.write_text(yaml.safe_dump(layouts_to_dict(layouts)))
    again = load_config(ParallelSection, path)
    assert resolve_layouts(again, world_size=4) == layouts


def test_every_bad_role_is_named_with_the_fix():
    arch = SimpleNamespace(num_heads=4, num_layers=4)
    small = SimpleNamespace(num_heads=6, num_layers=3)
    with pytest.raises(InputError) as err:
        resolve_layouts(
            _section("actor.tp=2", "critic.tp=3", "reward.pp=2"),
            world_size=4,
            archs={"actor": arch, "critic": arch, "reward": small},
        )
    message = str(err.value)
    assert "parallel.critic: world size 4 is not divisible by tp*pp = 3*1" in message
    assert "parallel.critic: num_heads 4 is not divisible by tp=3" in message
    assert "parallel.reward: num_layers 3 is not divisible by pp=2" in message
    assert "parallel.actor" not in message and "parallel.rollout" not in message


def test_global_batch_must_split_over_every_role():
    layouts = resolve_layouts(_section(*ISSUE_SECTION), world_size=4)
    check_global_batch(8, "rollout.prompts_per_step", layouts)
    with pytest.raises(InputError, match="reward dp=4.*multiple of 4"):
        check_global_batch(6, "rollout.prompts_per_step", layouts)


def test_the_176b_example_is_a_valid_per_role_layout():
    """examples/ppo/bloomz_176b_am_ppo_sr.yaml at its 160 GPUs: every role divides the world,
    its model's heads and layers (176B actor/reference/rollout, 7B1 critic/AM), and the global
    batch splits over every DP size into whole micro-batches."""
    from megatron_rlhf.planning.shapes import model_shape
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.ppo.setup import layout_roles

    path = Path(__file__).resolve().parents[1] / "examples/ppo/bloomz_176b_am_ppo_sr.yaml"
    config = load_config(TrainPPOConfig, str(path), [])
    big, small = model_shape("bloomz-176b"), model_shape("bloomz-7b1")
    archs = {"actor": big, "reference": big, "critic": small, "reward": small}
    layouts = resolve_layouts(config.parallel, 160, archs, roles=layout_roles(config))
    assert {role: (lay.tp, lay.pp, lay.dp) for role, lay in layouts.items()} == {
        "actor": (8, 10, 2), "reference": (8, 10, 2), "critic": (8, 5, 4),
        "reward": (8, 5, 4), "rollout": (8, 5, 4),
    }  # fmt: skip
    check_global_batch(config.rollout.prompts_per_step, "rollout.prompts_per_step", layouts)
    minibatch = config.rollout.prompts_per_step // config.ppo.num_minibatches
    for role in ("actor", "critic"):
        assert (minibatch // layouts[role].dp) % config.train.micro_batch_size == 0


# ---------------------------------------------------------------- the flag dialect


def _flags(*argv: str, roles=("policy", "judge")):
    import argparse

    from megatron_rlhf.distributed.layouts import add_parallel_arguments, parallel_from_args

    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser, roles)
    args = parser.parse_args(list(argv))
    return parallel_from_args(args, roles), (args.tp, args.pp)


def test_parallel_flags_set_defaults_then_roles():
    assert _flags() == ({"policy": (1, 1), "judge": (1, 1)}, (1, 1))
    assert _flags("--parallel", "tp=2", "judge.tp=1", "judge.pp=2") == (
        {"policy": (2, 1), "judge": (1, 2)},
        (2, 1),
    )
    # --tp/--pp are shorthand for --parallel tp=/pp= (the default of every role)
    assert _flags("--tp", "2", "--pp", "2", "--parallel", "policy.pp=1") == (
        {"policy": (2, 1), "judge": (2, 2)},
        (2, 2),
    )
    assert _flags("--parallel", "tp=4", "pp=2", roles=()) == ({"": (4, 2)}, (4, 2))


@pytest.mark.parametrize(
    "argv, roles, message",
    [
        (["--parallel", "critic.tp=2"], ("policy", "judge"), "unknown role 'critic'; roles: "),
        (["--parallel", "policy.tp=2"], (), "it loads one model: use tp=N/pp=N"),
        (["--parallel", "tp:2"], (), "expected [ROLE.]tp=N or [ROLE.]pp=N"),
        (["--parallel", "policy.dp=2"], ("policy",), "expected [ROLE.]tp=N"),
        (["--parallel", "tp=two"], (), "'two' is not an integer"),
        (["--parallel", "pp=0"], (), "must be >= 1"),
        (["--parallel", "tp=2", "tp=4"], (), "sets tp twice"),
        (["--tp", "2", "--parallel", "tp=2"], (), "--tp 2 and --parallel tp=...: give one"),
        (["--pp", "0"], (), "--pp 0: must be >= 1"),
    ],
)
def test_bad_parallel_flags_name_the_flag(argv, roles, message):
    with pytest.raises(InputError) as err:
        _flags(*argv, roles=roles)
    assert message in str(err.value)


# ---------------------------------------------------------------- no global parallel state


def test_global_state_is_sealed_while_layouts_own_their_groups_and_freed_after():
    """Single process: a stray read of Megatron-Core's globals (ours or Megatron-Core's own)
    raises an error naming the role API; a model needs explicit groups; ``destroy`` gives the
    one-layout commands their global state back. (4 ranks: ``dist_layouts_worker``.)"""
    import torch
    from megatron.core import parallel_state

    from megatron_rlhf.distributed import destroy, initialize, initialize_layouts
    from megatron_rlhf.distributed.groups import GlobalParallelStateError
    from megatron_rlhf.distributed.layouts import Layout
    from megatron_rlhf.distributed.parallel import current_groups
    from megatron_rlhf.models.bloom import BloomModel
    from megatron_rlhf.models.bloom.config import BloomArchitecture

    arch = BloomArchitecture(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2)
    groups = initialize_layouts({"actor": Layout(tp=1, pp=1, dp=1)})
    try:
        for read in (
            parallel_state.get_tensor_model_parallel_world_size,
            parallel_state.is_pipeline_last_stage,
            lambda: parallel_state.get_data_parallel_group().size(),
            lambda: parallel_state.get_pipeline_model_parallel_first_rank(),
            current_groups,
            lambda: BloomModel(arch),
        ):
            with pytest.raises(GlobalParallelStateError, match=r"model_groups\(model\)"):
                read()
        model = BloomModel(arch, pg_collection=groups["actor"].pg_collection)
        logits = model(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long))
        assert logits.shape[:2] == (1, 3)
        assert model.sharded_state_dict()  # replica ids from the model's own DP group
    finally:
        destroy()
    initialize()
    try:
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        assert BloomModel(arch).pg_collection.tp.size() == 1
    finally:
        destroy()
