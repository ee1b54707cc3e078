"""train-ppo refuses bad input before it builds any model, with a message naming the key."""

from __future__ import annotations

import pytest
from ppo_fixtures import make_ppo_setup

from megatron_rlhf.ppo.train_cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_ppo_setup(tmp_path_factory.mktemp("ppo_validation"))


def _fails(setup, capsys, *overrides) -> str:
    assert main(["--config", str(setup["config"]), *overrides]) == 2
    return capsys.readouterr().err


def test_missing_role_checkpoint(setup, capsys):
    err = _fails(setup, capsys, "models.critic=/nonexistent/critic")
    assert "models.critic: checkpoint directory /nonexistent/critic does not exist" in err


def test_roles_with_different_vocabularies(setup, capsys, tmp_path):
    from megatron_rlhf.models.bloom.tiny import save_random_hf_bloom, tiny_architecture

    other = tmp_path / "other_vocab"
    save_random_hf_bloom(other, tiny_architecture(vocab_size=128, hidden_size=32, num_heads=4))
    err = _fails(setup, capsys, f"models.critic={other}")
    assert "vocabularies differ" in err and "'critic': 128" in err


def test_rehearsal_set_from_another_tokenizer(setup, capsys, tmp_path):
    from megatron_rlhf.data import write_sft_dataset

    write_sft_dataset(tmp_path / "dr", [([5, 6], [7])], vocab_size=64, eos_id=9, pad_id=9)
    err = _fails(setup, capsys, "rehearsal.enabled=true", f"rehearsal.dataset={tmp_path / 'dr'}")
    assert "rehearsal.dataset was built with tokenizer" in err


def test_layout_that_does_not_divide(setup, capsys):
    err = _fails(setup, capsys, "parallel.tp=3")
    assert "num_heads 4 is not divisible by" in err and "world size 1" in err


def test_untrained_reward_model(setup, capsys):
    err = _fails(setup, capsys, f"models.reward={setup['root'] / 'actor'}", "models.reward_fn=null")
    assert "not a reward model (BloomForSequenceClassification)" in err


def test_unknown_config_key(setup, capsys):
    err = _fails(setup, capsys, "ppo.clip=0.3")
    assert "unknown config key ppo.clip" in err


def test_rollout_logprobs_as_pi_old_need_the_whole_vocabulary(setup, capsys):
    """The rollout's log-probs are of the distribution sampled: at top_p < 1 the nucleus
    renormalised, which the PPO ratio's pi_old is not (refused); at another temperature with
    top_p = 1 they are pi_old's own (accepted)."""
    from megatron_rlhf.config import load_config
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.ppo.setup import validate_config

    err = _fails(setup, capsys, "ppo.old_logprobs=rollout", "rollout.top_p=0.9")
    assert "ppo.old_logprobs=rollout needs rollout.top_p=1 (it is 0.9)" in err
    assert "use ppo.old_logprobs=recompute or auto" in err
    overrides = ["ppo.old_logprobs=rollout", "rollout.temperature=0.7"]
    validate_config(load_config(TrainPPOConfig, setup["config"], overrides), 1)


def test_old_logprobs_auto_reuses_the_rollouts_only_where_they_agree():
    from megatron_rlhf.ppo import config as ppo
    from megatron_rlhf.ppo.roles import reuses_rollout_logprobs

    def config(choice, temperature=1.0, bf16=False, top_p=1.0):
        return ppo.TrainPPOConfig(
            models=ppo.ModelsConfig(actor="a", critic="c"),
            data=ppo.PromptDataConfig(prompts="p"),
            rollout=ppo.RolloutConfig(temperature=temperature, top_p=top_p),
            ppo=ppo.PPOConfig(old_logprobs=choice),
            train=ppo.TrainSection(bf16=bf16),
        )

    assert reuses_rollout_logprobs(config("auto"))  # fp32, the whole vocabulary
    assert reuses_rollout_logprobs(config("auto", temperature=0.7))  # mu is at T too
    assert not reuses_rollout_logprobs(config("auto", top_p=0.9))  # mu is the nucleus's
    assert not reuses_rollout_logprobs(config("recompute"))
    assert reuses_rollout_logprobs(config("rollout"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.rollout_correction=both"], "ppo.rollout_correction"),
        (
            ["ppo.rollout_correction_cap=0.5"],
            "ppo.rollout_correction_cap=0.5 must be a finite number >= 1",
        ),
        (
            ["ppo.rollout_correction=token_tis", "ppo.algorithm=rejection_sampling"],
            "ppo.rollout_correction=token_tis weights the PPO policy term",
        ),
        (["rollout.sync_bucket_mb=0"], "rollout.sync_bucket_mb=0 must be a number of MiB > 0"),
    ],
)
def test_rollout_correction_settings(setup, capsys, overrides, message):
    assert message in _fails(setup, capsys, *overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.decode_batch=-1"], "rollout.decode_batch=-1 must be >= 1"),
        (
            ["rollout.decode_batch=4", "rollout.engine=vllm"],
            "rollout.decode_batch=4 applies to rollout.engine=megatron only",
        ),
    ],
)
def test_decode_batch_settings(setup, capsys, overrides, message):
    assert message in _fails(setup, capsys, *overrides)


def test_decode_batch_is_refused_with_rollout_pipeline_stages():
    from types import SimpleNamespace

    from megatron_rlhf.ppo.config import RolloutConfig
    from megatron_rlhf.ppo.setup import check_decode_slots
    from megatron_rlhf.utils import InputError

    config = SimpleNamespace(rollout=RolloutConfig(decode_batch=4))
    check_decode_slots(config, {"rollout": SimpleNamespace(pp=1)})
    with pytest.raises(
        InputError, match=r"rollout.decode_batch=4 .* pp=2: set parallel.rollout.pp=1"
    ):
        check_decode_slots(config, {"rollout": SimpleNamespace(pp=2)})
    check_decode_slots(
        SimpleNamespace(rollout=RolloutConfig(decode_batch=0)), {"rollout": SimpleNamespace(pp=2)}
    )


def test_old_logprobs_auto_with_a_rollout_correction_takes_any_engines_logprobs():
    """With a stated correction the update is consistent for mu != pi_old, so auto no longer
    forces vLLM (or bf16) to recompute pi_old; at any temperature (the engines' log-probs are
    at it: the weights at T = 0.7 are 1 at staleness 0, tests/test_ppo_units.py), but top_p 1
    is still required (at top_p < 1 mu is the nucleus renormalised, not the ratio's pi_old)."""
    from megatron_rlhf.ppo import config as ppo
    from megatron_rlhf.ppo.roles import reuses_rollout_logprobs

    def config(correction, engine="vllm", temperature=1.0, choice="auto", top_p=1.0):
        return ppo.TrainPPOConfig(
            models=ppo.ModelsConfig(actor="a", critic="c"),
            data=ppo.PromptDataConfig(prompts="p"),
            rollout=ppo.RolloutConfig(temperature=temperature, engine=engine, top_p=top_p),
            ppo=ppo.PPOConfig(old_logprobs=choice, rollout_correction=correction),
            train=ppo.TrainSection(bf16=False),
        )

    assert not reuses_rollout_logprobs(config("none"))
    assert reuses_rollout_logprobs(config("token_tis"))
    assert reuses_rollout_logprobs(config("seq_tis", engine="megatron"))
    assert reuses_rollout_logprobs(config("token_tis", temperature=0.7))
    assert not reuses_rollout_logprobs(config("token_tis", temperature=0.7, top_p=0.9))
    assert not reuses_rollout_logprobs(config("token_tis", choice="recompute"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["async.max_staleness=-1"], "async.max_staleness=-1 must be >= 0"),
        (["async.is_cap=0.5"], "async.is_cap=0.5 must be a finite number >= 1, or 0 for no"),
        (["async.value_targets=retrace"], "async.value_targets='retrace'; choose one of"),
        (
            ["async.is_cap=0", "async.value_targets=vtrace"],
            "async.value_targets=vtrace truncates its ratios at async.is_cap, which is 0",
        ),
        (
            ["async.max_staleness=1", "ppo.algorithm=rejection_sampling"],
            "async.max_staleness=1 applies to ppo.algorithm=ppo",
        ),
        (
            ["async.max_staleness=2", "ppo.old_logprobs=rollout"],
            "async.max_staleness=2 recomputes pi_old with the current actor",
        ),
        (
            ["async.max_staleness=1", "ppo.rollout_correction=token_tis", "async.is_cap=0"],
            "ppo.rollout_correction=token_tis asks for the importance weight that "
            "async.is_cap=0 turns off",
        ),
        (
            [
                "async.max_staleness=1",
                "ppo.rollout_correction=seq_tis",
                "ppo.rollout_correction_cap=3",
            ],
            "capped by async.is_cap=2.0, not ppo.rollout_correction_cap=3.0; set both",
        ),  # fmt: skip
        (["async.staleness=1"], "unknown config key async.staleness; did you mean"),
    ],
)
def test_async_settings(setup, capsys, overrides, message):
    assert message in _fails(setup, capsys, *overrides)


def test_async_section_is_the_config_key_async():
    """The section's Python field is ``async_`` (a keyword); files, overrides, the saved config
    and --print-config all call it ``async``."""
    from megatron_rlhf.config import describe_config, load_config, to_dict
    from megatron_rlhf.ppo.config import TrainPPOConfig

    config = load_config(
        TrainPPOConfig,
        None,
        ["models.actor=a", "models.critic=c", "data.prompts=p", "async.max_staleness=1"],
    )
    assert config.async_.max_staleness == 1 and config.async_.value_targets == "gae"
    saved = to_dict(config)
    assert saved["async"] == {
        "max_staleness": 1, "value_targets": "gae", "is_cap": 2.0, "is_mode": "clip",
        "suffix_cap": 5.0, "min_ess": 0.1,
    }  # fmt: skip
    assert "async_" not in saved and saved["ppo"]["kl"]["estimator"] == "k1"
    assert "async.is_cap = 2.0" in describe_config(TrainPPOConfig)


def test_a_checkpoint_from_before_the_async_section_resumes(tmp_path):
    """A saved config without a section added since (``async``) is no change while the run
    keeps its defaults; a non-default value of it still is."""
    from megatron_rlhf.config import config_defaults, load_config, to_dict
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.training.run_dir import _check_changes
    from megatron_rlhf.utils import InputError

    required = ["models.actor=a", "models.critic=c", "data.prompts=p"]
    saved = to_dict(load_config(TrainPPOConfig, None, required))
    del saved["async"]
    defaults = config_defaults(TrainPPOConfig)
    assert defaults["async.is_cap"] == 2.0 and "models.actor" not in defaults
    checkpoint = tmp_path / "step_0000002"
    for overrides, refused in (([], None), (["async.max_staleness=1"], "async.max_staleness")):
        config = to_dict(load_config(TrainPPOConfig, None, required + overrides))
        if refused is None:
            _check_changes(tmp_path, checkpoint, saved, config, ("train.",), False, defaults)
            continue
        with pytest.raises(InputError, match=rf"resuming with a changed config \({refused}\)"):
            _check_changes(tmp_path, checkpoint, saved, config, ("train.",), False, defaults)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["placement.rollout_ranks=1"],
            "placement.rollout_ranks=1 applies to placement.mode=disaggregated",
        ),
        (
            ["placement.mode=disaggregated", "placement.rollout_ranks=1"],
            "placement.rollout_ranks=1 must be between 1 and the world size minus one (0)",
        ),
        (
            ["placement.mode=disaggregated", "rollout.engine=vllm"],
            "rollout.engine=vllm runs vLLM over the whole world",
        ),
        (
            ["placement.mode=disaggregated", "ppo.algorithm=rejection_sampling"],
            "ppo.algorithm=rejection_sampling: use placement.mode=colocated",
        ),
        (["placement.mode=split"], "placement.mode='split'; choose one of"),
    ],
)
def test_placement_settings(setup, capsys, overrides, message):
    assert message in _fails(setup, capsys, *overrides)


def test_disaggregated_layouts_split_the_world(setup):
    """The training roles' layouts over the first world - R ranks, the rollout's over the last
    R (``Layout.first_rank``); a layout that does not divide its own set names the set."""
    from megatron_rlhf.config import load_config
    from megatron_rlhf.ppo.config import TrainPPOConfig
    from megatron_rlhf.ppo.setup import placed_layouts
    from megatron_rlhf.utils import InputError

    archs = {"actor": setup["arch"], "critic": setup["arch"]}
    split = ["placement.mode=disaggregated", "placement.rollout_ranks=2", "parallel.critic.tp=2"]
    config = load_config(TrainPPOConfig, setup["config"], split)
    layouts = placed_layouts(config, 6, archs)
    assert layouts["rollout"].as_dict() == {"tp": 1, "pp": 1, "dp": 2}
    assert layouts["rollout"].first_rank == 4 and layouts["rollout"].holds(5)
    assert not layouts["rollout"].holds(3)
    assert layouts["actor"].as_dict() == {"tp": 1, "pp": 1, "dp": 4}
    assert layouts["critic"].as_dict() == {"tp": 2, "pp": 1, "dp": 2}
    assert all(layouts[role].first_rank == 0 for role in ("actor", "reference", "critic"))
    odd = load_config(TrainPPOConfig, setup["config"], [*split, "parallel.rollout.tp=4"])
    with pytest.raises(InputError, match="parallel.rollout: world size 2 is not divisible") as err:
        placed_layouts(odd, 6, archs)
    assert "(world size here: the rollout ranks: placement.rollout_ranks=2)" in str(err.value)
