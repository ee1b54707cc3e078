"""What a PPO step logs besides its update's metrics: the global batch's statistics, the KL the
adaptive controller observes, throughput. Every rank holds the global batch, so each figure is
the same on every rank."""

from __future__ import annotations

from megatron_rlhf.ppo.advantages import global_mean_var, global_moments, importance_weighted_kl
from megatron_rlhf.ppo.losses import explained_variance


class StepMetrics:
    """The statistics of a step's batch (``rollout``), logged after its update's."""

    def __init__(self, config, roles, data, kl):
        self.config, self.roles, self.data, self.kl = config, roles, data, kl

    def rollout(self, experience, timings: dict, step: int, gap: dict) -> dict:
        """Statistics of the step's global batch; ``gap``: the correction's rollout/actor
        log-prob gap (:class:`~megatron_rlhf.ppo.correction.RolloutCorrection`)."""
        mean, var = global_mean_var(experience.scores, None)
        mask = experience.response_mask
        lengths = mask.sum(dim=1).float()
        metrics = {
            "reward/mean": mean,
            "reward/std": var**0.5,
            "response/length": global_mean_var(lengths, None)[0],
            "kl/coef": self.kl.coef,
        }
        if experience.kl is not None:  # a PPO step's batch (rejection sampling has none)
            stale = is_stale(experience, step)
            metrics["kl/mean"] = observed_kl(experience, stale)[0]
            if stale:
                metrics["kl/k1_behaviour"] = behaviour_k1(experience)
            metrics["critic/explained_variance"] = explained_variance(
                experience.values, experience.returns, mask
            )
        metrics |= gap
        metrics |= {f"time/{stage}_s": seconds for stage, seconds in timings.items()}
        if experience.generate_s is not None:  # generated on other ranks, beside the update
            metrics["rollout/generate_s"] = experience.generate_s
        metrics |= self.throughput(experience, sum(timings.values()))
        metrics |= self.data.per_cluster_rewards(experience)
        if self.data.rehearsal is not None:  # rows of D_R cut to rehearsal.max_length so far
            metrics["rehearsal/rows_prompt_cut"] = float(self.data.rehearsal_rows_cut)
        return metrics

    def throughput(self, experience, seconds: float) -> dict:
        """Step time, end-to-end (prompt + response) tokens/s and, on GPUs, MFU."""
        from megatron_rlhf.training.throughput import (
            global_token_count,
            ppo_step_flops,
            step_throughput,
        )

        tokens = global_token_count(experience.attention_mask, None)
        responses = global_token_count(experience.response_mask, None)
        width, epochs = experience.sequences.shape[1], self.config.ppo.epochs
        metrics = step_throughput(
            seconds, tokens, ppo_step_flops(self.roles, tokens, width, epochs)
        )
        return metrics | {"throughput/response_tokens_per_s": responses / max(seconds, 1e-9)}


def is_stale(experience, step: int) -> bool:
    """Whether an actor older than step ``step``'s generated some row of ``experience`` (its
    tokens were sampled by mu, not by pi_old)."""
    if experience.policy_version is None:
        return False
    return bool((experience.policy_version < step).any())


def observed_kl(experience, stale: bool = False) -> tuple[float, int]:
    """What the adaptive KL controller observes in one step (and ``kl/mean`` logs): the mean
    per-sequence KL (summed over tokens) over the global batch (every rank holds it) and the
    number of rollouts.

    A batch sampled by the actor being trained (``stale`` False) gives the mean of the reward's
    own per-token estimate (``ppo.kl.estimator``), unbiased for KL(pi_old || pi_ref) on
    pi_old's samples. A stale batch was sampled by an older actor mu, on whose samples that
    mean estimates KL(mu || ref) - KL(mu || pi_old) and goes negative; it gives the
    importance-weighted, self-normalised k3 instead
    (:func:`~megatron_rlhf.ppo.advantages.importance_weighted_kl`, never negative). Only stale
    batches switch, so a synchronous run's controller and metrics are what they were; on a
    batch of the current actor the two estimate the same KL."""
    if stale:
        kl = importance_weighted_kl(
            experience.logprobs, experience.ref_logprobs, experience.behaviour_log_ratio(),
            experience.response_mask,
        )  # fmt: skip
        return kl, experience.response_mask.shape[0]
    mean, _, count = global_moments(experience.kl.sum(dim=1), None)
    return mean, count


def behaviour_k1(experience) -> float:
    """The mean per-sequence sum of k1 = log pi_old - log pi_ref over the batch's tokens as
    sampled (``kl/k1_behaviour``): on a stale batch, the raw value :func:`observed_kl`
    replaces, logged so that the two can be compared."""
    k1 = (experience.logprobs - experience.ref_logprobs).double() * experience.response_mask
    return global_moments(k1.sum(dim=1), None)[0]
