"""Build everything a PPO run needs, after validating it without touching model memory."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rlhf.checkpoint import checkpoint_architecture, is_hf_checkpoint, load_bloom
from megatron_rlhf.checkpoint.dist import read_metadata
from megatron_rlhf.checkpoint.hf_io import hf_reward_outputs
from megatron_rlhf.data.tokenizer import check_same_tokenizer
from megatron_rlhf.distributed.layouts import check_global_batch, resolve_layouts
from megatron_rlhf.ppo.config import TrainPPOConfig
from megatron_rlhf.training.command import use_bf16
from megatron_rlhf.utils import InputError

ROLE_KEYS = ("actor", "reference", "critic", "reward")


def role_paths(config: TrainPPOConfig) -> dict[str, str]:
    models = config.models
    paths = {"actor": models.actor, "reference": models.reference or models.actor}
    paths["critic"] = models.critic
    if models.reward is not None:
        paths["reward"] = models.reward
    return paths


def validate_config(config: TrainPPOConfig, world_size: int) -> dict:
    """Every check that needs no model memory; returns the architectures by role.

    A role given as a training run directory is replaced by its latest checkpoint."""
    from megatron_rlhf.training.checkpointing import checkpoint_in
    from megatron_rlhf.training.engine import optim_problems

    models = config.models
    for role in ROLE_KEYS:
        if getattr(models, role) is not None:
            setattr(models, role, checkpoint_in(getattr(models, role)))
    problems = optim_problems(config.actor_optim, "actor_optim")
    problems += optim_problems(config.critic_optim, "critic_optim")
    if problems:
        raise InputError("; ".join(problems))
    if (models.reward is None) == (models.reward_fn is None):
        raise InputError(
            "set exactly one of models.reward (a reward/advantage model) and models.reward_fn"
        )
    archs = {}
    for role, path in role_paths(config).items():
        if not Path(path).is_dir():
            raise InputError(f"models.{role}: checkpoint directory {path} does not exist")
        archs[role] = checkpoint_architecture(path)
    layouts = resolve_layouts(config.parallel, world_size, archs, roles=layout_roles(config))
    vocabs = {role: arch.vocab_size for role, arch in archs.items()}
    if len(set(vocabs.values())) > 1:
        raise InputError(
            f"the roles' vocabularies differ: {vocabs}; all four must share a tokenizer"
        )
    if models.reward is not None:
        expected = 2 if models.reward_kind == "am" else 1
        if is_hf_checkpoint(models.reward):
            labels = hf_reward_outputs(models.reward, "models.reward")
            meta = {"head": "scalar", "num_scalar_outputs": labels}
        else:
            meta = read_metadata(models.reward)
        if meta["head"] != "scalar" or meta["num_scalar_outputs"] != expected:
            raise InputError(
                f"models.reward: {models.reward} has a {meta['head']!r} head with "
                f"{meta['num_scalar_outputs']} outputs; models.reward_kind={models.reward_kind} "
                f"needs a scalar head with {expected}"
            )
    vocab = vocabs["actor"]
    actor_tokenizer = _same_tokenizer_for_every_role(config)
    prompts_tokenizer = _dataset_tokenizer(config.data.prompts, "data.prompts", vocab)
    check_same_tokenizer(
        prompts_tokenizer, f"data.prompts ({config.data.prompts})",
        actor_tokenizer, f"models.actor ({models.actor})",
    )  # fmt: skip
    if config.rehearsal.enabled:
        if config.rehearsal.dataset is None:
            raise InputError("rehearsal.enabled=true needs rehearsal.dataset (an SFT prefix)")
        if config.rehearsal.max_length < 2:
            raise InputError(
                f"rehearsal.max_length={config.rehearsal.max_length} leaves no response token "
                "to train; use at least 2 (one prompt token and one response token)"
            )
        rehearsal_tokenizer = _dataset_tokenizer(
            config.rehearsal.dataset, "rehearsal.dataset", vocab
        )
        check_same_tokenizer(
            rehearsal_tokenizer, f"rehearsal.dataset ({config.rehearsal.dataset})",
            actor_tokenizer, f"models.actor ({models.actor})",
        )  # fmt: skip
        if _tokenizer_identity(rehearsal_tokenizer) != _tokenizer_identity(prompts_tokenizer):
            raise InputError(
                f"rehearsal.dataset was built with tokenizer {_tokenizer_identity(rehearsal_tokenizer)}"
                f" but data.prompts with {_tokenizer_identity(prompts_tokenizer)}; rebuild D_R with "
                "the policy's tokenizer"
            )
    check_batches(config, layouts)
    return archs


def layout_roles(config: TrainPPOConfig) -> tuple[str, ...]:
    """The roles that hold a model in this run (``rollout`` is the actor's generation copy)."""
    roles = ("actor", "reference", "critic", "rollout")
    return roles + ("reward",) if config.models.reward is not None else roles


def check_batches(config: TrainPPOConfig, layouts: dict) -> None:
    """The global batch splits over every role's DP ranks, then into the PPO minibatches."""
    global_batch, ppo = config.rollout.prompts_per_step, config.ppo
    check_global_batch(global_batch, "rollout.prompts_per_step", layouts)
    for role in ("actor", "critic"):
        rows = global_batch // layouts[role].dp
        if rows % (ppo.num_minibatches * ppo.micro_batch_size):
            raise InputError(
                f"rollout.prompts_per_step={global_batch} gives {rows} rows per {role} "
                f"data-parallel rank (dp={layouts[role].dp}), not divisible by "
                f"ppo.num_minibatches * ppo.micro_batch_size = "
                f"{ppo.num_minibatches} * {ppo.micro_batch_size}"
            )


def _same_tokenizer_for_every_role(config: TrainPPOConfig) -> dict | None:
    """The actor's tokenizer identity; every role whose tokenizer is known must share it."""
    from megatron_rlhf.checkpoint.dist import tokenizer_of

    known = {role: tokenizer_of(path) for role, path in role_paths(config).items()}
    known = {role: t for role, t in known.items() if t and t.get("fingerprint")}
    if len({t["fingerprint"] for t in known.values()}) > 1:
        described = "; ".join(
            f"models.{role}: {t.get('name')} ({t['fingerprint']})" for role, t in known.items()
        )
        raise InputError(f"the roles were trained with different tokenizers: {described}")
    return known.get("actor") or next(iter(known.values()), None)


def _dataset_tokenizer(prefix: str, key: str, vocab: int) -> dict:
    from megatron_rlhf.data import read_sidecar

    try:
        sidecar = read_sidecar(prefix)
    except (FileNotFoundError, InputError) as err:
        raise InputError(f"{key}: {err}") from None
    tokenizer = sidecar["tokenizer"]
    if tokenizer["vocab_size"] > vocab:
        raise InputError(
            f"{key}: {prefix} was tokenized with a {tokenizer['vocab_size']}-token vocabulary, "
            f"larger than the models' {vocab}; preprocess it with the policy's tokenizer"
        )
    return tokenizer


def _tokenizer_identity(tokenizer: dict) -> tuple:
    """What the data sidecars record about a tokenizer that must agree between data sets."""
    return (tokenizer["vocab_size"], tokenizer["eos_id"], tokenizer["pad_id"])


@dataclass
class Roles:
    actor: torch.nn.Module
    reference: torch.nn.Module
    critic: torch.nn.Module
    reward: torch.nn.Module | None


def build_roles(config: TrainPPOConfig, groups: dict) -> Roles:
    """Load the four models, each on its own layout's groups (``role_groups.active``)."""
    from megatron_rlhf.distributed.role_groups import active

    dtype = torch.bfloat16 if use_bf16(config.train.bf16, "train.bf16") else torch.float32
    paths = role_paths(config)
    common = dict(params_dtype=dtype, sequence_parallel=config.parallel.sequence_parallel)
    trained = dict(common, recompute_activations=config.train.recompute_activations)
    with active(groups["actor"]):
        actor = load_bloom(paths["actor"], head="lm", init_weights=False, **trained)
    with active(groups["reference"]):
        reference = load_bloom(paths["reference"], head="lm", init_weights=False, **common).eval()
    critic_is_value_model = (
        not is_hf_checkpoint(paths["critic"])
        and read_metadata(paths["critic"]).get("num_scalar_outputs") == 1
    )
    with active(groups["critic"]):
        critic = load_bloom(
            paths["critic"],
            head="scalar",
            num_scalar_outputs=1,
            trunk_only=not critic_is_value_model,
            **trained,
        )
    reward = None
    if "reward" in paths:
        outputs = 2 if config.models.reward_kind == "am" else 1
        with active(groups["reward"]):
            reward = load_bloom(
                paths["reward"],
                head="scalar",
                num_scalar_outputs=outputs,
                init_weights=False,
                **common,
            ).eval()
    for frozen in (reference, reward):
        if frozen is not None:
            frozen.requires_grad_(False)
    return Roles(actor=actor, reference=reference, critic=critic, reward=reward)


def build_actor_copy(config: TrainPPOConfig):
    """An unloaded actor (the rollout layout's copy, filled by resharding before each use)."""
    from megatron_rlhf.models.bloom import BloomModel

    dtype = torch.bfloat16 if use_bf16(config.train.bf16, "train.bf16") else torch.float32
    return BloomModel(
        checkpoint_architecture(config.models.actor),
        head="lm",
        params_dtype=dtype,
        sequence_parallel=config.parallel.sequence_parallel,
        init_weights=False,
    )


def import_reward_fn(spec: str, key: str = "models.reward_fn"):
    """``package.module:function`` -> the function; errors name ``key`` (config key or flag)."""
    module_name, _, function_name = spec.partition(":")
    if not function_name:
        raise InputError(f"{key}={spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise InputError(f"{key}: cannot import {module_name} ({err})") from None
    if not hasattr(module, function_name):
        raise InputError(f"{key}: {module_name} has no {function_name}")
    return getattr(module, function_name)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
