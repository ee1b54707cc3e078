"""Validate a PPO config and resolve it into a plan (checkpoints, tokenizers, layouts) without
touching model memory; ppo/roles.py builds the run from the plan."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_rlhf.checkpoint import CheckpointInfo, describe_checkpoint
from megatron_rlhf.checkpoint.hf_io import hf_reward_outputs
from megatron_rlhf.data.tokenizer import check_same_tokenizer
from megatron_rlhf.distributed.layouts import Layout, check_global_batch, resolve_layouts
from megatron_rlhf.ppo.checks import async_problems, placement_problems
from megatron_rlhf.ppo.config import TrainPPOConfig
from megatron_rlhf.ppo.losses import ROLLOUT_CORRECTIONS
from megatron_rlhf.utils import InputError

ROLE_KEYS = ("actor", "reference", "critic", "reward")


def role_paths(config: TrainPPOConfig) -> dict[str, str]:
    models = config.models
    paths = {"actor": models.actor, "reference": models.reference or models.actor}
    paths["critic"] = models.critic
    if models.reward is not None:
        paths["reward"] = models.reward
    return paths


@dataclass(frozen=True)
class PPOPlan:
    """A train-ppo config resolved once, before any model memory: each role's checkpoint (a run
    directory replaced by its latest checkpoint) read once, and each role's layout."""

    config: TrainPPOConfig
    """The config with ``models.*`` resolved to checkpoint directories (what is saved)."""
    checkpoints: dict[str, CheckpointInfo]
    """actor, reference, critic and (with a reward model) reward."""
    layouts: dict[str, Layout]
    """Every role of :func:`layout_roles`, the rollout included."""

    @property
    def archs(self) -> dict:
        return {role: info.arch for role, info in self.checkpoints.items()}


def validate_config(config: TrainPPOConfig, world_size: int) -> PPOPlan:
    """Every check that needs no model memory; returns the resolved plan (``config`` itself is
    not changed)."""
    from megatron_rlhf.training.checkpointing import checkpoint_in
    from megatron_rlhf.training.config import optim_problems

    models = replace(
        config.models,
        **{
            role: checkpoint_in(getattr(config.models, role))
            for role in ROLE_KEYS
            if getattr(config.models, role) is not None
        },
    )
    config = replace(config, models=models)
    problems = config.train.problems()
    problems += optim_problems(config.actor_optim, "actor_optim")
    problems += optim_problems(config.critic_optim, "critic_optim")
    budget = config.train.max_tokens_per_micro_batch
    if budget is not None and budget < 1:
        problems.append(f"train.max_tokens_per_micro_batch={budget} must be >= 1 (or null)")
    if config.ppo.old_logprobs == "rollout" and config.rollout.top_p < 1.0:
        problems.append(
            f"ppo.old_logprobs=rollout needs rollout.top_p=1 (it is {config.rollout.top_p}): "
            "the rollout's log-probs are of the top-p nucleus renormalised, which the PPO "
            "ratio's pi_old is not; use ppo.old_logprobs=recompute or auto"
        )
    correction = config.ppo.rollout_correction
    if correction not in ROLLOUT_CORRECTIONS:
        problems.append(
            f"ppo.rollout_correction={correction!r} must be one of {', '.join(ROLLOUT_CORRECTIONS)}"
        )
    elif correction != "none" and config.ppo.algorithm == "rejection_sampling":
        problems.append(
            f"ppo.rollout_correction={correction} weights the PPO policy term, which "
            "ppo.algorithm=rejection_sampling does not have; set ppo.rollout_correction=none"
        )
    decode_batch = config.rollout.decode_batch
    if decode_batch is not None and decode_batch < 0:
        problems.append(
            f"rollout.decode_batch={decode_batch} must be >= 1 (decode slots per rollout DP "
            "rank), or 0/null to decode every prompt at once"
        )
    elif decode_batch and config.rollout.engine != "megatron":
        problems.append(
            f"rollout.decode_batch={decode_batch} applies to rollout.engine=megatron only "
            f"(rollout.engine={config.rollout.engine} schedules its own batch); unset it"
        )
    bucket = config.rollout.sync_bucket_mb  # a float: the config loader checks the type
    if not (math.isfinite(bucket) and bucket > 0):
        problems.append(f"rollout.sync_bucket_mb={bucket:g} must be a number of MiB > 0")
    cap = config.ppo.rollout_correction_cap
    if not (math.isfinite(cap) and cap >= 1):
        problems.append(f"ppo.rollout_correction_cap={cap} must be a finite number >= 1")
    problems += async_problems(config)
    problems += placement_problems(config, world_size)
    if problems:
        raise InputError("; ".join(problems))
    if (models.reward is None) == (models.reward_fn is None):
        raise InputError(
            "set exactly one of models.reward (a reward/advantage model) and models.reward_fn"
        )
    checkpoints = {}
    for role, path in role_paths(config).items():
        if not Path(path).is_dir():
            raise InputError(f"models.{role}: checkpoint directory {path} does not exist")
        checkpoints[role] = describe_checkpoint(path)
    archs = {role: info.arch for role, info in checkpoints.items()}
    layouts = placed_layouts(config, world_size, archs)
    vocabs = {role: arch.vocab_size for role, arch in archs.items()}
    if len(set(vocabs.values())) > 1:
        raise InputError(
            f"the roles' vocabularies differ: {vocabs}; all four must share a tokenizer"
        )
    if models.reward is not None:
        expected = 2 if models.reward_kind == "am" else 1
        reward = checkpoints["reward"]
        if reward.is_hf:
            labels = hf_reward_outputs(models.reward, "models.reward")
            meta = {"head": "scalar", "num_scalar_outputs": labels}
        else:
            meta = reward.meta
        if meta["head"] != "scalar" or meta["num_scalar_outputs"] != expected:
            raise InputError(
                f"models.reward: {models.reward} has a {meta['head']!r} head with "
                f"{meta['num_scalar_outputs']} outputs; models.reward_kind={models.reward_kind} "
                f"needs a scalar head with {expected}"
            )
    vocab = vocabs["actor"]
    actor_tokenizer = _same_tokenizer_for_every_role(config, checkpoints)
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
    if config.rollout.engine == "vllm" and layouts["rollout"].pp != 1:
        raise InputError(
            f"rollout.engine=vllm needs a rollout layout without pipeline stages (it resolves "
            f"to pp={layouts['rollout'].pp}); set parallel.rollout.pp=1"
        )
    check_decode_slots(config, layouts)
    check_batches(config, layouts)
    return PPOPlan(config=config, checkpoints=checkpoints, layouts=layouts)


def placed_layouts(config: TrainPPOConfig, world_size: int, archs: dict) -> dict[str, Layout]:
    """Every role's layout: over the whole world (colocated), or the training roles over the
    first ``world - placement.rollout_ranks`` ranks and the rollout over the rest."""
    roles = layout_roles(config)
    if config.placement.mode == "colocated":
        return resolve_layouts(config.parallel, world_size, archs, roles=roles)
    rollout_ranks = config.placement.rollout_ranks
    training = world_size - rollout_ranks
    sets = [  # (roles, ranks, which ranks an error's "world size" means)
        (
            tuple(role for role in roles if role != "rollout"),
            training,
            f"the training ranks: world {world_size} - placement.rollout_ranks "
            f"{rollout_ranks} = {training}",
        ),
        (
            ("rollout",),
            rollout_ranks,
            f"the rollout ranks: placement.rollout_ranks={rollout_ranks}",
        ),
    ]
    layouts = {}
    for set_roles, size, described in sets:
        try:
            layouts |= resolve_layouts(config.parallel, size, archs, roles=set_roles)
        except InputError as err:
            raise InputError(f"{err}\n  (world size here: {described})") from None
    return layouts | {"rollout": replace(layouts["rollout"], first_rank=training)}


def layout_roles(config: TrainPPOConfig) -> tuple[str, ...]:
    """The roles that hold a model in this run (``rollout`` is the actor's generation copy)."""
    roles = ("actor", "reference", "critic", "rollout")
    return roles + ("reward",) if config.models.reward is not None else roles


def check_decode_slots(config: TrainPPOConfig, layouts: dict) -> None:
    """``rollout.decode_batch`` refills slots in the single-stage decode loop only: the
    pipelined loop (``generation/pipelined.py``) keeps its micro-batches' rows to the end."""
    if config.rollout.decode_batch and layouts["rollout"].pp != 1:
        raise InputError(
            f"rollout.decode_batch={config.rollout.decode_batch} refills decode slots without "
            f"pipeline stages only; the rollout layout resolves to pp={layouts['rollout'].pp}: "
            "set parallel.rollout.pp=1 or unset rollout.decode_batch"
        )


def check_batches(config: TrainPPOConfig, layouts: dict) -> None:
    """The global batch splits over every role's DP ranks, then into the PPO minibatches."""
    global_batch, minibatches = config.rollout.prompts_per_step, config.ppo.num_minibatches
    micro_batch_size = config.train.micro_batch_size
    check_global_batch(global_batch, "rollout.prompts_per_step", layouts)
    for role in ("actor", "critic"):
        rows = global_batch // layouts[role].dp
        if rows % (minibatches * micro_batch_size):
            raise InputError(
                f"rollout.prompts_per_step={global_batch} gives {rows} rows per {role} "
                f"data-parallel rank (dp={layouts[role].dp}), not divisible by "
                f"ppo.num_minibatches * train.micro_batch_size = "
                f"{minibatches} * {micro_batch_size}"
            )


def _same_tokenizer_for_every_role(config: TrainPPOConfig, checkpoints: dict) -> dict | None:
    """The actor's tokenizer identity; every role whose tokenizer is known must share it."""
    from megatron_rlhf.checkpoint.dist import tokenizer_of

    known = {role: tokenizer_of(info.path, info.meta) for role, info in checkpoints.items()}
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
