"""Build a PPO run from its plan (ppo/setup.py): every model on its layout, and every mode
chosen once, as an object the trainer holds and never asks about.

- the placement (``placement.mode``): :func:`build_roles` builds the roles this rank holds and
  its side (ppo/placement.py ``Colocated``, ``TrainingRanks`` or ``RolloutRanks``);
- the rollout engine (``rollout.engine``: ours or vLLM, generation/rollout_engines.py) behind the
  rollout source that side makes (ppo/rollouts.py), over the rollouts in flight
  (``async.max_staleness``, ppo/staleness.py);
- the step (``ppo.algorithm``: :class:`~megatron_rlhf.ppo.step.PPOStep` or
  :class:`~megatron_rlhf.ppo.step.RejectionStep`), with log pi_old's source, the
  correction toward the behaviour policy and the critic's targets (``async.value_targets``,
  :func:`critic_targets`; all three ppo/correction.py): :func:`build_modes`.

A new mode is a new object and a line here; the trainer (ppo/train.py) and the step do not
change.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from megatron_rlhf.checkpoint import load_bloom
from megatron_rlhf.models.precision import mark_cpu_bf16, params_dtype
from megatron_rlhf.ppo.setup import PPOPlan
from megatron_rlhf.training.command import use_bf16


@dataclass(eq=False)
class Role:
    """One model of the run with the process groups it was built on (and, for a trained role,
    its TrainEngine): what rollout, scoring, the update and evaluation take."""

    name: str
    model: torch.nn.Module
    pg: object  # its ProcessGroupCollection (model.pg_collection): .tp, .pp, .dp
    engine: object = None  # training.TrainEngine of the actor and the critic

    @property
    def arch(self):
        return self.model.arch


@dataclass(eq=False)
class Roles:
    actor: Role
    reference: Role
    critic: Role
    reward: Role | None
    rollout: object  # generation.rollout_engines.RolloutEngine, or the disaggregated link
    world: object  # ppo/placement.py: Colocated, TrainingRanks or RolloutRanks

    def engines(self) -> dict:
        """The trained roles' engines (none on a rank that holds no role to train)."""
        if self.actor is None:
            return {}
        return {"actor": self.actor.engine, "critic": self.critic.engine}


def build_roles(plan: PPOPlan, role_groups: dict, seed: int) -> Roles:
    """Load every model on its own layout's groups (``role_groups``: each role's LayoutGroups
    from ``initialize_layouts``; the model-parallel RNG seeded per layout), wrap the actor and
    the critic in their TrainEngines, and set up the rollout engine. In the disaggregated
    placement a rollout rank builds only the rollout copy (its Roles hold no other role) and a
    training rank all but it (``ppo/placement.py``)."""
    from megatron_rlhf.distributed.groups import seed_layout
    from megatron_rlhf.distributed.parallel import default_group
    from megatron_rlhf.generation.rollout_engines import build_rollout_engine
    from megatron_rlhf.ppo.placement import (
        Colocated,
        DisaggregatedRollout,
        RolloutRanks,
        TrainingRanks,
    )

    config, checkpoints, layouts = plan.config, plan.checkpoints, plan.layouts
    bf16 = use_bf16(config.train.bf16)
    common = dict(  # a CPU's bf16: fp32 weights, bf16 products (models/precision.py)
        params_dtype=params_dtype(bf16),
        sequence_parallel=config.parallel.sequence_parallel,
        attention_backend=config.train.attention_backend,
    )

    def build_copy(rollout_groups):
        from megatron_rlhf.models.bloom import BloomModel

        seed_layout(rollout_groups, seed)
        return mark_cpu_bf16(
            BloomModel(
                checkpoints["actor"].arch,
                head="lm",
                init_weights=False,
                pg_collection=rollout_groups.pg_collection,
                **common,
            ),
            bf16,
        )

    if config.placement.mode == "disaggregated":
        bucket_mb, training = config.rollout.sync_bucket_mb, layouts["rollout"].first_rank
        training_group = torch.distributed.new_group(list(range(training)))  # every rank
        if layouts["rollout"].holds(torch.distributed.get_rank()):
            copy = build_copy(role_groups["rollout"])
            link = DisaggregatedRollout(None, copy, layouts, training_group, bucket_mb)
            return Roles(None, None, None, None, rollout=link, world=RolloutRanks(link))
        with default_group(training_group):  # the optimizers' set-up, the checkpoint reads
            actor, reference, critic, reward = _training_roles(plan, role_groups, seed, common)
        link = DisaggregatedRollout(actor.model, None, layouts, training_group, bucket_mb)
        return Roles(actor, reference, critic, reward, rollout=link, world=TrainingRanks(link))
    actor, reference, critic, reward = _training_roles(plan, role_groups, seed, common)
    rollout_rows = config.rollout.prompts_per_step // layouts["rollout"].dp
    if config.ppo.algorithm == "rejection_sampling":
        rollout_rows *= config.ppo.rejection_samples_per_prompt
    vllm_settings = dict(
        max_model_len=config.data.max_prompt_length + config.rollout.max_new_tokens,
        max_rows=rollout_rows,
        seed=seed,
        sync_bucket_mb=config.rollout.sync_bucket_mb,
    )
    rollout = build_rollout_engine(
        actor.model,
        role_groups["actor"],
        role_groups["rollout"],
        build_copy,
        engine=config.rollout.engine,
        vllm_settings=vllm_settings,
    )
    return Roles(actor, reference, critic, reward, rollout=rollout, world=Colocated())


def _training_roles(plan: PPOPlan, role_groups: dict, seed: int, common: dict) -> tuple:
    """(actor, reference, critic, reward or None), each on its layout's groups."""
    from megatron_rlhf.distributed.groups import seed_layout
    from megatron_rlhf.training import TrainEngine

    config, checkpoints = plan.config, plan.checkpoints
    bf16 = use_bf16(config.train.bf16)
    trained = dict(common, recompute_activations=config.train.recompute_activations)

    def load(role: str, **kwargs):
        seed_layout(role_groups[role], seed)
        pg = role_groups[role].pg_collection
        model = load_bloom(checkpoints[role], pg_collection=pg, **kwargs)
        return mark_cpu_bf16(model, bf16, frozen=role in ("reference", "reward")), pg

    updates = config.train.steps * config.ppo.epochs * config.ppo.num_minibatches
    actor_model, actor_pg = load("actor", head="lm", init_weights=False, **trained)
    actor = Role(
        "actor",
        actor_model,
        actor_pg,
        TrainEngine(actor_model, config.actor_optim, updates, "actor."),
    )
    reference_model, reference_pg = load("reference", head="lm", init_weights=False, **common)
    reference = Role("reference", reference_model.eval(), reference_pg)
    critic_info = checkpoints["critic"]
    critic_is_value_model = (
        not critic_info.is_hf and critic_info.meta.get("num_scalar_outputs") == 1
    )
    critic_model, critic_pg = load(
        "critic",
        head="scalar",
        num_scalar_outputs=1,
        trunk_only=not critic_is_value_model,
        init_weights=False,  # every tensor is loaded; a fresh head has its own seeded init
        **trained,
    )
    critic = Role(
        "critic",
        critic_model,
        critic_pg,
        TrainEngine(critic_model, config.critic_optim, updates, "critic."),
    )
    reward = None
    if "reward" in checkpoints:
        outputs = 2 if config.models.reward_kind == "am" else 1
        reward_model, reward_pg = load(
            "reward", head="scalar", num_scalar_outputs=outputs, init_weights=False, **common
        )
        reward = Role("reward", reward_model.eval(), reward_pg)
    for frozen in (reference, reward):
        if frozen is not None:
            frozen.model.requires_grad_(False)
    return actor, reference, critic, reward


def build_modes(config, roles: Roles, data, controls: tuple, reward_fn, report) -> tuple:
    """(the rollout source, the step) of this rank: ``controls`` the KL controller and the
    reward normaliser, ``report`` the step's metrics (ppo/metrics.py ``StepMetrics``)."""
    from megatron_rlhf.ppo.correction import OldLogprobs, RolloutCorrection, StaleCorrection
    from megatron_rlhf.ppo.rejection import repeat_prompts
    from megatron_rlhf.ppo.staleness import RolloutQueue
    from megatron_rlhf.ppo.step import PPOStep, RejectionStep

    ppo, queue = config.ppo, RolloutQueue(config.async_.max_staleness)
    old_logprobs = OldLogprobs(reuses_rollout_logprobs(config))
    if ppo.algorithm == "rejection_sampling":
        expand = partial(repeat_prompts, times=ppo.rejection_samples_per_prompt)
        step = RejectionStep(config, roles, data, old_logprobs, reward_fn, report)
    else:
        expand = _same
        if config.async_.max_staleness > 0:
            correction = StaleCorrection(ppo, config.async_)
        else:
            correction = RolloutCorrection(ppo, old_logprobs)
        corrections = (correction, critic_targets(config))
        step = PPOStep(config, roles, data, controls, old_logprobs, corrections, reward_fn, report)
    return roles.world.rollouts(roles.rollout, queue, data, config, expand), step


def critic_targets(config):
    """What the critic regresses on (``async.value_targets``), with its lambda
    (``ppo.lam_critic``, None: ``ppo.lam``): ppo/correction.py's GAETargets, VTraceTargets or
    SuffixISTargets (falling back to the V-trace targets below ``async.min_ess``)."""
    from megatron_rlhf.ppo.correction import GAETargets, SuffixISTargets, VTraceTargets

    ppo, section = config.ppo, config.async_
    lam = ppo.lam if ppo.lam_critic is None else ppo.lam_critic
    vtrace = VTraceTargets(ppo.gamma, lam, rho_bar=section.is_cap)
    if section.value_targets == "vtrace":
        return vtrace
    if section.value_targets == "suffix_is":
        return SuffixISTargets(ppo.gamma, section.suffix_cap, section.min_ess, fallback=vtrace)
    return GAETargets(ppo.gamma, lam)


def _same(prompts: dict) -> dict:
    return prompts


def reuses_rollout_logprobs(config) -> bool:
    """Whether log pi_old is the rollout's own (``ppo.old_logprobs``; auto: our engine with fp32
    weights and ``rollout.top_p`` = 1, where a recomputing forward agrees to rounding; vLLM's
    kernels round differently, by up to ~1e-3 in a log-prob on a trained model, so auto
    recomputes, unless ``ppo.rollout_correction`` is on: then any engine's at top_p = 1).
    The rollout's log-probs are of the distribution it sampled: at the temperature (so any
    temperature will do) but, at top_p < 1, cut to the nucleus and renormalised, which the PPO
    ratio's pi_old must not be (``scoring.reading``): then pi_old is recomputed. Never with
    ``async.max_staleness`` >= 1: the rollout's are the older actor's, the behaviour policy."""
    choice = config.ppo.old_logprobs
    if config.async_.max_staleness > 0:
        return False
    untruncated = config.rollout.top_p >= 1.0
    if choice == "auto" and config.ppo.rollout_correction != "none":
        # the update corrects for mu != pi_old: no recompute is needed to be consistent
        return untruncated
    if choice == "auto":
        fp32 = not use_bf16(config.train.bf16)
        ours = config.rollout.engine == "megatron"
        return ours and fp32 and untruncated
    return choice == "rollout"
