"""The step of a PPO run on one rollout, the paper's recipe after the rollout stage:

  score       (scoring.py)     reference log-probs (and old ones if recomputed), values,
                               AM/RM scores
  correct     (correction.py)  log pi_old's source, the weights toward the behaviour policy
  advantages  (advantages.py)  -beta*KL shaped rewards (Eq. 2), GAE, whitening; then the
                               critic's targets (correction.py: GAE, V-trace or suffix IS)
  update      (update.py)      PPO epochs; with rehearsal, L_PPO + gamma*NLL(D_R) (Eq. 9)

:class:`PPOStep` and :class:`RejectionStep` (best-of-K then SFT, rejection.py) share one
protocol, ``step(rollout, step) -> metrics``; ppo/roles.py chooses one at build time, so the
trainer never asks which it holds. Neither knows where the rollout came from: every rank that
runs a step holds the global batch, whichever ranks generated it.
"""

from __future__ import annotations

import time

import torch

from megatron_rlhf.distributed.handoff import dp_shard
from megatron_rlhf.ppo.advantages import compute_advantages
from megatron_rlhf.ppo.metrics import is_stale, observed_kl
from megatron_rlhf.ppo.microbatch import Batching
from megatron_rlhf.ppo.rejection import rejection_update, select_best
from megatron_rlhf.ppo.scoring import score_in_layouts
from megatron_rlhf.ppo.update import ppo_update


class PPOStep:
    """Score → correct → advantages → update on a rollout of the actor's (``correction`` and
    ``critic_targets``: :mod:`~megatron_rlhf.ppo.correction`'s choices for the run)."""

    def __init__(self, config, roles, data, controls, old_logprobs, corrections, reward_fn, report):
        self.config, self.roles, self.data = config, roles, data
        self.kl, self.normalizer = controls
        self.old_logprobs = old_logprobs
        self.correction, self.critic_targets = corrections
        self.reward_fn, self.report = reward_fn, report

    def step(self, rollout, step: int) -> dict:
        """The step's update on ``rollout`` (a :class:`~megatron_rlhf.ppo.rollouts.Rollout`);
        its metrics."""
        config, timings = self.config, rollout.timings
        self.old_logprobs.take_from_rollout(rollout.experience)
        batching = Batching.of(
            config.train, rollout.experience.sequences.shape[1], self.data.pad_id
        )
        t0 = time.time()
        experience = score_in_layouts(
            rollout.experience, self.scorers(), config, batching, self.reward_fn
        )
        timings["score"], t0 = time.time() - t0, time.time()
        experience.is_weights, correction = self.correction(experience, step)
        experience = compute_advantages(experience, self.kl, self.normalizer, config.ppo)
        correction |= self.critic_targets(experience)
        timings["advantages"], t0 = time.time() - t0, time.time()
        order = torch.Generator().manual_seed(config.train.seed * 100003 + step)
        metrics = ppo_update(
            experience, self.roles, config, batching, order, self.rehearsal_minibatches()
        )
        timings["update"] = time.time() - t0
        self.kl.update(*observed_kl(experience, is_stale(experience, step)))
        metrics |= self.report.rollout(experience, timings, step, self.correction.gap(experience))
        return metrics | rollout.sync | correction

    def scorers(self) -> dict:
        """{Experience field: the Role that fills it} in the score stage."""
        roles = self.roles
        scored = self.old_logprobs.scorers(roles.actor)
        scored |= {"ref_logprobs": roles.reference, "values": roles.critic}
        return scored | ({"scores": roles.reward} if roles.reward is not None else {})

    def rehearsal_minibatches(self):
        """The rehearsal microbatches of each global PPO minibatch (one per actor microbatch)."""
        if not self.config.rehearsal.enabled:
            return None
        config = self.config
        minibatch = config.rollout.prompts_per_step // config.ppo.num_minibatches
        return self.data.rehearsal_minibatches(minibatch // config.train.micro_batch_size)


class RejectionStep:
    """Rejection sampling (paper Eqs. 3-4): score the K samples of each prompt, keep the best
    above ``ppo.rejection_threshold``, one NLL step on them."""

    def __init__(self, config, roles, data, old_logprobs, reward_fn, report):
        self.config, self.roles, self.data = config, roles, data
        self.old_logprobs, self.reward_fn, self.report = old_logprobs, reward_fn, report

    def step(self, rollout, step: int) -> dict:
        config, timings, roles = self.config, rollout.timings, self.roles
        batching = Batching.of(
            config.train, rollout.experience.sequences.shape[1], self.data.pad_id
        )
        t0 = time.time()
        scorers = {"scores": roles.reward} if roles.reward is not None else {}
        experience = score_in_layouts(rollout.experience, scorers, config, batching, self.reward_fn)
        timings["score"], t0 = time.time() - t0, time.time()
        ppo, dp, micro_batch_size = config.ppo, roles.actor.pg.dp, config.train.micro_batch_size
        kept = select_best(
            experience.scores, ppo.rejection_samples_per_prompt, ppo.rejection_threshold
        )
        usable = len(kept) - len(kept) % (micro_batch_size * dp.size())
        mine = dp_shard(kept[:usable], dp)
        metrics = rejection_update(experience.select(mine), roles.actor, batching)
        timings["update"] = time.time() - t0
        metrics |= self.report.rollout(experience, timings, step, self.old_logprobs.gap(experience))
        return metrics | rollout.sync
