"""The checks of the modes' settings that combine sections (``async``, ``placement``): what
``validate_config`` (ppo/setup.py) adds to each section's own, before any model is read. They
refuse a combination; the modes are chosen in ppo/roles.py."""

from __future__ import annotations

import math

from megatron_rlhf.ppo.config import TrainPPOConfig


def async_problems(config: TrainPPOConfig) -> list[str]:
    """What is wrong with the ``async`` section, alone and with the ``ppo`` keys it meets."""
    section, ppo, problems = config.async_, config.ppo, []
    staleness, cap = section.max_staleness, section.is_cap
    if staleness < 0:
        problems.append(
            f"async.max_staleness={staleness} must be >= 0 (0: the synchronous step, "
            "1: one-step-off)"
        )
    if not (math.isfinite(cap) and (cap == 0 or cap >= 1)):
        problems.append(f"async.is_cap={cap} must be a finite number >= 1, or 0 for no weight")
    elif cap == 0 and section.value_targets == "vtrace":
        problems.append(
            "async.value_targets=vtrace truncates its ratios at async.is_cap, which is 0 (the "
            "correction off); set async.is_cap >= 1 or async.value_targets=gae"
        )
    elif cap == 0 and section.value_targets == "suffix_is" and section.min_ess > 0:
        problems.append(
            f"async.value_targets=suffix_is falls back to V-trace targets below "
            f"async.min_ess={section.min_ess}, whose ratios async.is_cap truncates, which is 0 "
            "(the correction off); set async.is_cap >= 1 or async.min_ess=0"
        )
    elif cap == 0 and section.is_mode == "mask":
        problems.append(
            "async.is_mode=mask drops the tokens whose weight is above async.is_cap, which is 0 "
            "(the weight off); set async.is_cap >= 1 or async.is_mode=clip"
        )
    problems += _critic_target_problems(config)
    if staleness <= 0:
        if section.is_mode == "mask":
            problems.append(
                "async.is_mode=mask applies to the weights of stale rollouts "
                "(async.max_staleness >= 1); set async.is_mode=clip or async.max_staleness >= 1"
            )
        return problems
    if ppo.algorithm == "rejection_sampling":
        problems.append(
            f"async.max_staleness={staleness} applies to ppo.algorithm=ppo; "
            "ppo.algorithm=rejection_sampling trains on its own rollouts: set async.max_staleness=0"
        )
    if ppo.old_logprobs == "rollout":
        problems.append(
            f"async.max_staleness={staleness} recomputes pi_old with the current actor (the "
            "rollout's log-probs are the behaviour policy's); set ppo.old_logprobs=auto or "
            "recompute"
        )
    if ppo.rollout_correction != "none" and cap == 0:
        problems.append(
            f"ppo.rollout_correction={ppo.rollout_correction} asks for the importance weight "
            "that async.is_cap=0 turns off; set async.is_cap >= 1 or ppo.rollout_correction=none"
        )
    elif ppo.rollout_correction != "none" and ppo.rollout_correction_cap != cap:
        problems.append(
            f"with async.max_staleness={staleness} the weight min(pi_old/mu, cap) is capped by "
            f"async.is_cap={cap}, not ppo.rollout_correction_cap={ppo.rollout_correction_cap}; "
            "set both to the same value"
        )
    return problems


def _critic_target_problems(config: TrainPPOConfig) -> list[str]:
    """What is wrong with the keys of the critic's targets (``async.value_targets``)."""
    section, lam, problems = config.async_, config.ppo.lam_critic, []
    if lam is not None and not 0 <= lam <= 1:
        problems.append(
            f"ppo.lam_critic={lam} must lie in [0, 1] (VC-PPO's choice: 1), or null for ppo.lam"
        )
    if not (math.isfinite(section.suffix_cap) and section.suffix_cap > 0):
        problems.append(
            f"async.suffix_cap={section.suffix_cap} must be a finite number > 0 (the truncation "
            "of value_targets=suffix_is's weights; e.g. 5)"
        )
    if not 0 <= section.min_ess <= 1:
        problems.append(
            f"async.min_ess={section.min_ess} must lie in [0, 1] (an effective sample size per "
            "token; 0: never fall back to V-trace targets)"
        )
    return problems


def placement_problems(config: TrainPPOConfig, world_size: int) -> list[str]:
    """What is wrong with the ``placement`` section for this world (the config loader has
    checked ``placement.mode``'s value)."""
    placement, problems = config.placement, []
    ranks = placement.rollout_ranks
    if placement.mode == "colocated":
        if ranks:
            problems.append(
                f"placement.rollout_ranks={ranks} applies to placement.mode=disaggregated; "
                "set placement.rollout_ranks=0 or placement.mode=disaggregated"
            )
        return problems
    if not 1 <= ranks < world_size:
        problems.append(
            f"placement.rollout_ranks={ranks} must be between 1 and the world size minus one "
            f"({world_size - 1}): the rollout engine and the training roles each need ranks"
        )
    if config.rollout.engine != "megatron":
        problems.append(
            f"placement.mode=disaggregated generates with our engine on the rollout ranks; "
            f"rollout.engine={config.rollout.engine} runs vLLM over the whole world (its "
            "launcher takes every rank): set rollout.engine=megatron or placement.mode=colocated"
        )
    if config.ppo.algorithm == "rejection_sampling":
        problems.append(
            "placement.mode=disaggregated overlaps PPO's update with generation; "
            "ppo.algorithm=rejection_sampling: use placement.mode=colocated"
        )
    return problems
