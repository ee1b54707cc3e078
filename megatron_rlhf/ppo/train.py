"""``train-ppo``: AM-PPO-SR and its baselines (RM-PPO, RM-PPO w/ MA, AM-PPO, rejection sampling).

    torchrun --nproc-per-node N -m megatron_rlhf train-ppo --config FILE [key=value ...]

Each step is the four stages of the paper's recipe, in order:
  rollout     (rollout.py)     sample responses of the actor (KV-cached generation), with
                               their log-probs (log pi_old: ppo.old_logprobs)
  score       (scoring.py)     reference log-probs (and old ones if recomputed), values,
                               AM/RM scores
  advantages  (advantages.py)  -beta*KL shaped rewards (Eq. 2), GAE, DP-wide whitening
  update      (update.py)      PPO epochs; with rehearsal, L_PPO + gamma*NLL(D_R) (Eq. 9)
With ``async.max_staleness`` = N >= 1 the rollout trained at step t was generated N steps
earlier (staleness.py: a FIFO of rollouts in flight; colocated, so no overlap on one machine):
the score stage recomputes pi_old with the current actor (the proximal policy), the policy term
is clipped around it and weighted by min(pi_old/mu, async.is_cap) toward the behaviour policy
mu (the decoupled objective, losses.behaviour_correction), and ``async.value_targets=vtrace``
gives the critic V-trace targets (advantages.vtrace). N = 0 is the synchronous step. With
``placement.mode=disaggregated`` (placement.py) rollout ranks generate while the training ranks
score and update: every rank runs this loop, each side skipping the other's stages.
Checkpoints (actor, critic, optimizers, schedules, KL controller, reward normaliser, RNG, data
positions) are saved every ``train.save_interval`` steps and at the end, and resumed exactly. The run's
lifecycle (run directory, resume, log, non-finite guard, save on a signal, summary) is
training/run.py's, shared with ``train-sft`` and ``train-reward``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rlhf.config import load_config, to_dict
from megatron_rlhf.distributed import destroy
from megatron_rlhf.distributed.handoff import dp_shard
from megatron_rlhf.generation import SamplingConfig
from megatron_rlhf.ppo.advantages import (
    compute_advantages,
    global_mean_var,
    global_moments,
    importance_weighted_kl,
)
from megatron_rlhf.ppo.config import TrainPPOConfig
from megatron_rlhf.ppo.control import KLController, RewardNormalizer
from megatron_rlhf.ppo.losses import behaviour_correction, explained_variance
from megatron_rlhf.ppo.placement import DisaggregatedRollout
from megatron_rlhf.ppo.rejection import rejection_update, repeat_prompts, select_best
from megatron_rlhf.ppo.rollout import rollout_global, step_row_seeds
from megatron_rlhf.ppo.run_io import RunData, dump_samples
from megatron_rlhf.ppo.scoring import score_in_layouts
from megatron_rlhf.ppo.setup import (
    PPOPlan,
    build_roles,
    import_reward_fn,
    validate_config,
    world_size,
)
from megatron_rlhf.ppo.staleness import RolloutQueue, staleness_metrics
from megatron_rlhf.ppo.update import ppo_update
from megatron_rlhf.training import config as shared
from megatron_rlhf.training.command import use_bf16
from megatron_rlhf.training.run import Run, finish
from megatron_rlhf.training.run_dir import first_logged
from megatron_rlhf.training.signals import ExitSignals
from megatron_rlhf.utils import is_rank0

RESUMABLE_CHANGES = (*shared.RESUMABLE_CHANGES, "train.sample_interval", "parallel.")
"""Config keys that may differ when a run resumes (training/run_dir.py): the shared ones, and
the layouts too, since the checkpoint and the trainer state are layout-independent."""


def train(args) -> int:
    """Run ``train-ppo`` with parsed arguments (``train_cli.main`` parses them)."""
    from megatron_rlhf.training.memory_check import check_ppo

    config = load_config(TrainPPOConfig, args.config, args.overrides)
    plan = validate_config(config, world_size())
    check_ppo(plan.config, plan.archs, plan.layouts, args.skip_memory_check)  # before any model
    exit_signals = ExitSignals(config.train.exit_signals, "train-ppo")
    try:
        return PPOTrainer(plan, args.overwrite, args.force_config_change).fit(exit_signals)
    finally:
        exit_signals.restore()


class PPOTrainer:
    """Holds the run's state; ``fit()`` reads like the algorithm."""

    def __init__(self, plan: PPOPlan, overwrite: bool = False, force_config_change: bool = False):
        """``plan``: :func:`~megatron_rlhf.ppo.setup.validate_config`'s resolution of the
        config (every role's checkpoint and layout)."""
        from megatron_rlhf.distributed import initialize_layouts

        self.config = config = plan.config
        train = config.train
        self.roles = build_roles(plan, initialize_layouts(plan.layouts), seed=train.seed)
        self.actor, self.critic = self.roles.actor, self.roles.critic
        self.old_logprobs = OldLogprobs(reuses_rollout_logprobs(config))
        self.reward_fn = (
            import_reward_fn(config.models.reward_fn) if config.models.reward_fn else None
        )
        self.kl = KLController(
            config.ppo.kl.coef, config.ppo.kl.adaptive, config.ppo.kl.target, config.ppo.kl.horizon
        )
        self.normalizer = RewardNormalizer(
            config.ppo.reward_normalization, config.ppo.reward_ma_momentum
        )
        self.run = Run(
            "train-ppo", config, overwrite=overwrite, force_config_change=force_config_change,
            allowed=RESUMABLE_CHANGES, lr_key="actor_optim.lr, critic_optim.lr",
        )  # fmt: skip
        self.consumed_prompts, self.consumed_rehearsal = 0, 0
        self.queue = RolloutQueue(config.async_.max_staleness)
        self.link = (
            self.roles.rollout if isinstance(self.roles.rollout, DisaggregatedRollout) else None
        )
        self.trains = self.link is None or not self.link.is_rollout_rank
        """Whether this rank scores and updates (False: a rollout rank of the disaggregated
        placement, which only generates)."""
        if self.run.resume_from is not None:
            with self.training_world():
                self.load_state(self.run.restore(self.engines()))
        self.step, self.output_dir = self.run.step, self.run.output_dir
        self.data = RunData(config, self.consumed_prompts, self.consumed_rehearsal)
        self.logger = self.run.start(train.steps)

    def fit(self, exit_signals: ExitSignals) -> int:
        config, start = self.config, time.time()
        first_reward = first_logged(self.output_dir, "reward/mean")  # steps before a resume
        last_reward, done = None, self.step
        for step in range(self.step, config.train.steps):
            self.step = step
            timings, t0 = {}, time.time()
            controls = self.kl.state_dict(), self.normalizer.state_dict()
            experience, sync_s = self.roll_out(timings, t0)
            metrics = {}  # a rollout rank's: its batches are sent, nothing more to do
            if self.trains:
                with self.training_world():  # what only the training ranks take part in
                    metrics = self.train_on(experience, timings, sync_s)
            self.consumed_prompts = self.data.consumed_prompts
            self.consumed_rehearsal = self.data.consumed_rehearsal
            done = self.step + 1
            if not self.run.check(done, metrics):  # skipped: undo the step's controls
                self.kl.load_state_dict(controls[0])
                self.normalizer.load_state_dict(controls[1])
            if self.trains:
                last_reward = metrics["reward/mean"]
                first_reward = last_reward if first_reward is None else first_reward
                self.log(done, metrics, experience)
            if self.run.end_step(done, self.save, exit_signals):
                break
        self.run.close()
        self.roles.rollout.close()
        destroy()
        stopped_by = self.run.stopped_by
        return finish(
            "train-ppo",
            dict(
                steps=done if stopped_by is not None else config.train.steps,
                first_reward=first_reward,
                last_reward=last_reward,
                seconds=round(time.time() - start, 1),
                output_dir=config.train.output_dir,
            ),
            stopped_by.name if stopped_by is not None else None,
        )

    def train_on(self, experience, timings: dict, sync_s: float | None) -> dict:
        """Score, advantages and update on the step's rollout; the step's metrics."""
        config = self.config
        t0 = time.time()
        experience = score_in_layouts(
            experience,
            self.scoring_roles(),
            config.models.reward_kind,
            config.rollout.temperature,
            config.ppo.micro_batch_size,
            self.reward_fn,
            max_tokens=self.token_budget(experience),
            top_p=config.rollout.top_p,
        )
        timings["score"], t0 = time.time() - t0, time.time()
        experience.is_weights, correction = self.behaviour_correction(experience)
        if config.ppo.algorithm == "rejection_sampling":
            metrics = self.rejection_step(experience)
            timings["update"] = time.time() - t0
        else:
            experience = compute_advantages(
                experience, self.kl, self.normalizer, config.ppo.kl.estimator,
                config.ppo.gamma, config.ppo.lam, config.ppo.whiten_advantages,
                vtrace_cap=self.vtrace_cap(),
            )  # fmt: skip
            timings["advantages"], t0 = time.time() - t0, time.time()
            metrics = ppo_update(
                experience,
                self.actor,
                self.critic,
                config.ppo,
                config.rollout.temperature,
                torch.Generator().manual_seed(config.train.seed * 100003 + self.step),
                self.rehearsal_minibatches(),
                config.rehearsal.gamma,
                self.data.pad_id,
                config.rehearsal.nll_reduction,
                max_tokens=self.token_budget(experience),
            )
            timings["update"] = time.time() - t0
            self.kl.update(*observed_kl(experience, self.is_stale(experience)))
        metrics |= self.rollout_metrics(experience, timings)
        metrics |= self.sync_metrics(sync_s)
        metrics |= correction
        return metrics

    def roll_out(self, timings: dict, t0: float):
        """(the step's rollout, the weight sync's seconds or None): the rollouts due
        (:meth:`RolloutQueue.due`: this step's with N = 0, else batch step + N, and at step 0
        batches 0..N) generated by the current actor, then the oldest in flight taken."""
        config = self.config
        due = self.queue.due(self.step)
        sync_s = self.roles.rollout.refresh() if due else None
        if sync_s is not None:
            timings["weight_sync"], t0 = sync_s, time.time()
        for batch in due:
            prompts = self.data.next_prompts()
            if config.ppo.algorithm == "rejection_sampling":
                prompts = repeat_prompts(prompts, config.ppo.rejection_samples_per_prompt)
            self.queue.push(self.generate(prompts, batch), self.step)
        experience = self.queue.pop(self.step)
        if experience is not None:  # None: a rollout rank of the disaggregated placement
            self.old_logprobs.take_from_rollout(experience)
        timings["rollout"] = time.time() - t0
        return experience, sync_s

    def generate(self, prompts: dict, batch: int):
        """Batch ``batch``'s rollout of ``prompts``: generated here, or in the disaggregated
        placement sent by a rollout rank (None) and pending on a training rank."""
        if self.link is not None and self.trains:
            return self.link.receive(prompts)
        rows, start = prompts["input_ids"].shape[0], time.time()
        seeds = step_row_seeds(self.config.train.seed, batch, rows)
        experience = rollout_global(self.roles.rollout, prompts, self.sampling(), seeds)
        if self.link is not None:
            self.link.send(experience, time.time() - start)
            return None
        return experience

    def behaviour_correction(self, experience) -> tuple:
        """(the policy term's weights or None, their metrics). Synchronous:
        ``ppo.rollout_correction`` (logged as rollout/*). With max_staleness >= 1:
        min(pi_old/mu, async.is_cap) per token (per sequence with
        ppo.rollout_correction=seq_tis), pi_old the current actor and mu the generating one;
        async.is_cap=0 applies none, and the metrics then describe the raw ratios (async/*,
        with the staleness). Both sides of pi_old/mu are under the sampler's transform
        (temperature, top-p renormalised: ``Experience.sampled_old_logprobs``), so the weights
        are 1 at staleness 0 whatever rollout.temperature and rollout.top_p."""
        ppo, section = self.config.ppo, self.config.async_
        old, mu = experience.sampled_old_logprobs(), experience.rollout_logprobs
        mask = experience.response_mask
        if section.max_staleness == 0:
            weights, metrics = behaviour_correction(
                old, mu, mask, ppo.rollout_correction, ppo.rollout_correction_cap
            )
            return weights, {f"rollout/{key}": value for key, value in metrics.items()}
        mode = "token_tis" if ppo.rollout_correction == "none" else ppo.rollout_correction
        weights, metrics = behaviour_correction(old, mu, mask, mode, section.is_cap or math.inf)
        metrics["kl_behaviour_current"] = metrics.pop("kl_behaviour_old")
        metrics = {f"async/{key}": value for key, value in metrics.items()}
        metrics |= staleness_metrics(experience, self.step)
        return (weights if section.is_cap else None), metrics

    def is_stale(self, experience) -> bool:
        """Whether an actor older than this step's generated some row of ``experience`` (its
        tokens were sampled by mu, not by pi_old)."""
        if self.config.async_.max_staleness == 0 or experience.policy_version is None:
            return False
        return bool((experience.policy_version < self.step).any())

    def vtrace_cap(self) -> float | None:
        """V-trace's rho_bar (``async.value_targets=vtrace``; its c_bar is 1), or None for
        GAE."""
        section = self.config.async_
        return section.is_cap if section.value_targets == "vtrace" else None

    def log(self, step: int, metrics: dict, experience) -> None:
        """The step's progress (the bar shows the reward, the KL and on GPUs the MFU), its
        metrics and its samples when the run's cadence says so (``train.log_interval``,
        ``train.sample_interval``: training/run.py ``Run.due``)."""
        shown = {
            "reward": f"{metrics['reward/mean']:.3f}",
            "kl": f"{metrics.get('kl/mean', 0):.3f}",
        }
        if "throughput/mfu" in metrics:  # GPUs only
            shown["mfu"] = f"{metrics['throughput/mfu']:.1%}"
        self.logger.advance(**shown)
        self.run.write(step, metrics)
        if self.run.due("sample", step) and is_rank0():
            dump_samples(self.output_dir / "samples.jsonl", step, experience, self.data.tokenizer)

    def sampling(self) -> SamplingConfig:
        """The step's sampling settings; each row's seed comes from ``step_row_seeds``."""
        rollout_config = self.config.rollout
        return SamplingConfig(
            max_new_tokens=rollout_config.max_new_tokens,
            temperature=rollout_config.temperature,
            top_p=rollout_config.top_p,
            decode_batch=rollout_config.decode_batch or None,
            eos_id=self.data.eos_id,
            pad_id=self.data.pad_id,
        )

    def rehearsal_minibatches(self):
        """The rehearsal microbatches of each global PPO minibatch (one per actor microbatch)."""
        if not self.config.rehearsal.enabled:
            return None
        ppo, batch = self.config.ppo, self.config.rollout.prompts_per_step
        return self.data.rehearsal_minibatches(batch // ppo.num_minibatches // ppo.micro_batch_size)

    def token_budget(self, experience) -> int | None:
        """Tokens per packed scoring and update micro-batch (None: padded micro-batches)."""
        ppo = self.config.ppo
        if not ppo.packing:
            return None
        width = experience.sequences.shape[1]
        return ppo.max_tokens_per_micro_batch or ppo.micro_batch_size * width

    def scoring_roles(self) -> dict:
        """{Experience field: the Role that fills it} in the score stage."""
        roles, scored = self.roles, {}
        if self.config.ppo.algorithm != "rejection_sampling":
            scored = self.old_logprobs.scorers(roles.actor)
            scored |= {"ref_logprobs": roles.reference, "values": roles.critic}
        return scored | ({"scores": roles.reward} if roles.reward is not None else {})

    def rejection_step(self, experience) -> dict:
        ppo, dp = self.config.ppo, self.actor.pg.dp
        kept = select_best(
            experience.scores, ppo.rejection_samples_per_prompt, ppo.rejection_threshold
        )
        usable = len(kept) - len(kept) % (ppo.micro_batch_size * dp.size())
        mine = dp_shard(kept[:usable], dp)
        return rejection_update(experience.select(mine), self.actor, ppo.micro_batch_size)

    def rollout_metrics(self, experience, timings: dict) -> dict:
        """Statistics of the step's global batch (every rank holds it)."""
        mean, var = global_mean_var(experience.scores, None)
        mask = experience.response_mask
        lengths = mask.sum(dim=1).float()
        metrics = {
            "reward/mean": mean,
            "reward/std": var**0.5,
            "response/length": global_mean_var(lengths, None)[0],
            "kl/coef": self.kl.coef,
        }
        if experience.kl is not None:
            stale = self.is_stale(experience)
            metrics["kl/mean"] = observed_kl(experience, stale)[0]
            if stale:
                metrics["kl/k1_behaviour"] = behaviour_k1(experience)
            metrics["critic/explained_variance"] = explained_variance(
                experience.values, experience.returns, mask
            )
        if self.config.async_.max_staleness == 0:  # else async/kl_behaviour_current
            metrics |= self.old_logprobs.gap(experience)
        metrics |= {f"time/{stage}_s": seconds for stage, seconds in timings.items()}
        if experience.generate_s is not None:  # disaggregated: generated beside the update
            metrics["rollout/generate_s"] = experience.generate_s
        metrics |= self.throughput(experience, sum(timings.values()))
        metrics |= self.data.per_cluster_rewards(experience)
        if self.data.rehearsal is not None:  # rows of D_R cut to rehearsal.max_length so far
            metrics["rehearsal/rows_prompt_cut"] = float(self.data.rehearsal_rows_cut)
        return metrics

    def sync_metrics(self, sync_s: float | None) -> dict:
        """The step's weight sync into the rollout engine: seconds and this rank's bytes (the
        logged figures are rank 0's; 0 when the actor generates itself)."""
        engine = self.roles.rollout
        metrics = {
            "rollout/sync_s": float(sync_s or 0.0),
            "rollout/sync_bytes_per_rank": float(getattr(engine, "sync_bytes_per_rank", 0) or 0),
        }
        remote = getattr(engine, "sync_remote_bytes_per_rank", None)
        if remote is not None:
            metrics["rollout/sync_remote_bytes_per_rank"] = float(remote)
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

    def engines(self) -> dict:
        """The trained roles' engines (none on a rollout rank)."""
        if not self.trains:
            return {}
        return {"actor": self.actor.engine, "critic": self.critic.engine}

    def training_world(self):
        """A block that only the training ranks run (``distributed.parallel.default_group``):
        in the disaggregated placement the rollout ranks hold nothing to save or load."""
        from megatron_rlhf.distributed.parallel import default_group

        training = self.link is not None and self.trains  # a rollout rank keeps the world
        return default_group(self.link.training_group if training else None)

    def save(self, step: int) -> Path | None:
        """Checkpoint ``step``: both engines, and the trainer state (:meth:`load_state`'s);
        written by the training ranks alone (a rollout rank returns None)."""
        if not self.trains:
            return None
        with self.training_world():
            return self._save(step)

    def _save(self, step: int) -> Path:
        from megatron_rlhf.checkpoint.dist import model_metadata
        from megatron_rlhf.training.checkpointing import save_training_checkpoint

        state = {
            "step": step,
            "consumed_prompts": self.consumed_prompts,
            "consumed_rehearsal": self.consumed_rehearsal,
            "kl": self.kl.state_dict(),
            "normalizer": self.normalizer.state_dict(),
            "nonfinite": self.run.guard.state_dict(),
        }
        tensors = None
        if self.config.async_.max_staleness > 0:
            state["rollouts_in_flight"], tensors = self.queue.state()
        roles = {
            "actor": {"head": "lm", "num_scalar_outputs": 0, "prefix": "actor."},
            "critic": {"head": "scalar", "num_scalar_outputs": 1, "prefix": "critic."},
        }
        # save_training_checkpoint keeps the (global) trainer state and the schedules in the
        # metadata too, so that a run resumes at another world size or layout
        metadata = model_metadata(self.actor.model, roles=roles, config=to_dict(self.config))
        return save_training_checkpoint(
            self.output_dir,
            step,
            self.engines(),
            metadata,
            state,
            tokenizer_dir=self.config.models.tokenizer or self.config.models.actor,
            trainer_tensors=tensors,
        )

    def load_state(self, state: dict) -> None:
        """The trainer state :meth:`save` wrote, past what ``Run.restore`` restores (the step,
        the guard): data positions, the KL controller, the reward normaliser and the rollouts
        in flight (``async.max_staleness`` >= 1; their tensors from the checkpoint's
        safetensors)."""
        from megatron_rlhf.checkpoint.dist import load_global_tensors
        from megatron_rlhf.distributed.parallel import compute_device

        in_flight = state.get("rollouts_in_flight")
        if in_flight is None:  # none in flight: the next batch is the resumed step's
            self.queue.next_batch = state["step"]
        else:  # a rollout rank keeps their count only
            tensors = load_global_tensors(self.run.resume_from) if self.trains else None
            self.queue.load(in_flight, tensors, compute_device())
        self.consumed_prompts = state["consumed_prompts"]
        self.consumed_rehearsal = state["consumed_rehearsal"]
        self.kl.load_state_dict(state["kl"])
        self.normalizer.load_state_dict(state["normalizer"])


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
        fp32 = not use_bf16(config.train.bf16, "train.bf16")
        ours = config.rollout.engine == "megatron"
        return ours and fp32 and untruncated
    return choice == "rollout"


@dataclass(frozen=True)
class OldLogprobs:
    """Where log pi_old comes from, decided once (:func:`reuses_rollout_logprobs`): the
    rollout's own log-probs, or an actor forward in the score stage. The step, the choice of
    scoring roles and the rollout/actor gap diagnostic all ask this object."""

    from_rollout: bool

    def take_from_rollout(self, experience) -> None:
        if self.from_rollout:
            experience.logprobs = experience.rollout_logprobs

    def scorers(self, actor) -> dict:
        """{field: Role} that the score stage needs for log pi_old: the actor, or none."""
        return {} if self.from_rollout else {"logprobs": actor}

    def gap(self, experience) -> dict:
        """How far the rollout's log-probs are from the actor's own forward over the same
        tokens (recomputed; both under the sampler's transform: temperature, top-p
        renormalised): rounding (~1e-6 with our engine in fp32, ~1e-3 with vLLM on a sharp
        model); far more means the generating weights, or the sampler, are not the actor's."""
        if self.from_rollout or experience.logprobs is None:
            return {}
        mask = experience.response_mask
        gap = experience.behaviour_log_ratio().abs() * mask
        return {
            "rollout/logprob_diff_max": gap.max().item(),
            "rollout/logprob_diff_mean": (gap.sum() / mask.sum().clamp(min=1)).item(),
        }


def observed_kl(experience, stale: bool = False) -> tuple[float, int]:
    """What the adaptive KL controller observes in one step (and ``kl/mean`` logs): the mean
    per-sequence KL (summed over tokens) over the global batch (every rank holds it) and the
    number of rollouts.

    A batch sampled by the actor being trained (``stale`` False: synchronous, or staleness 0)
    gives the mean of the reward's own per-token estimate (``ppo.kl.estimator``), unbiased for
    KL(pi_old || pi_ref) on pi_old's samples. A stale batch was sampled by an older actor mu,
    on whose samples that mean estimates KL(mu || ref) - KL(mu || pi_old) and goes negative;
    it gives the importance-weighted, self-normalised k3 instead
    (:func:`~megatron_rlhf.ppo.advantages.importance_weighted_kl`, never negative). Only stale
    batches switch, so a synchronous run's controller and metrics are what they were; at
    staleness 0 the two estimate the same KL."""
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
