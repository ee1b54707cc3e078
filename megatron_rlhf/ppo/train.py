"""``train-ppo``: AM-PPO-SR and its baselines (RM-PPO, RM-PPO w/ MA, AM-PPO, rejection sampling).

    torchrun --nproc-per-node N -m megatron_rlhf train-ppo --config FILE [key=value ...]

Each step is the paper's recipe, in order: the rollout (rollouts.py: sample responses of the
actor with their log-probs), then the step (step.py): score, correct, advantages, update (with
rehearsal, L_PPO + gamma*NLL(D_R), Eq. 9). :meth:`PPOTrainer.fit` reads exactly that; every
mode below is an object built once (roles.py), so neither ``fit`` nor the step asks for one.
With ``async.max_staleness`` = N >= 1 the rollout trained at step t was generated N steps
earlier (staleness.py: a FIFO of rollouts in flight; colocated, so no overlap on one machine):
the score stage recomputes pi_old with the current actor (the proximal policy), the policy term
is clipped around it and weighted by min(pi_old/mu, async.is_cap) toward the behaviour policy
mu (the decoupled objective, losses.behaviour_correction), and ``async.value_targets`` (gae |
vtrace | suffix_is, correction.py) chooses the critic's targets only, the actor's advantages
staying GAE on mu's samples. N = 0 is the synchronous step. With
``placement.mode=disaggregated`` (placement.py) rollout ranks generate while the training ranks
score and update: every rank runs this loop, each side skipping the other's stages.
Checkpoints (actor, critic, optimizers, schedules, KL controller, reward normaliser, RNG, data
positions) are saved every ``train.save_interval`` steps and at the end, and resumed exactly. The run's
lifecycle (run directory, resume, log, non-finite guard, save on a signal, summary) is
training/run.py's, shared with ``train-sft`` and ``train-reward``.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_rlhf.config import load_config, to_dict
from megatron_rlhf.distributed import destroy
from megatron_rlhf.distributed.parallel import world_size_from_env
from megatron_rlhf.ppo.config import TrainPPOConfig
from megatron_rlhf.ppo.control import KLController, RewardNormalizer
from megatron_rlhf.ppo.metrics import StepMetrics
from megatron_rlhf.ppo.roles import build_modes, build_roles
from megatron_rlhf.ppo.run_io import RunData, dump_samples
from megatron_rlhf.ppo.setup import PPOPlan, import_reward_fn, validate_config
from megatron_rlhf.training import config as shared
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
    plan = validate_config(config, world_size_from_env())
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
        self.roles = build_roles(plan, initialize_layouts(plan.layouts), seed=config.train.seed)
        self.world = self.roles.world
        reward_fn = import_reward_fn(config.models.reward_fn) if config.models.reward_fn else None
        kl = config.ppo.kl
        self.kl = KLController(kl.coef, kl.adaptive, kl.target, kl.horizon)
        self.normalizer = RewardNormalizer(
            config.ppo.reward_normalization, config.ppo.reward_ma_momentum
        )
        self.run = Run(
            "train-ppo", config, overwrite=overwrite, force_config_change=force_config_change,
            allowed=RESUMABLE_CHANGES, lr_key="actor_optim.lr, critic_optim.lr",
        )  # fmt: skip
        state = {"step": 0, "consumed_prompts": 0, "consumed_rehearsal": 0}
        if self.run.resume_from is not None:
            with self.world.training():
                state = self.run.restore(self.roles.engines())
        self.data = RunData(config, state["consumed_prompts"], state["consumed_rehearsal"])
        self.consumed = state["consumed_prompts"], state["consumed_rehearsal"]
        controls = (self.kl, self.normalizer)
        report = StepMetrics(config, self.roles, self.data, self.kl)
        self.rollouts, self.algorithm = build_modes(
            config, self.roles, self.data, controls, reward_fn, report
        )
        if self.run.resume_from is not None:
            with self.world.training():
                self.load_state(state)
        self.output_dir = self.run.output_dir
        self.first_reward = first_logged(self.output_dir, "reward/mean")  # before a resume
        self.last_reward, self.started = None, time.time()
        self.logger = self.run.start(config.train.steps)

    def fit(self, exit_signals: ExitSignals) -> int:
        """next rollout → (on a rank that trains) score → correct → advantages → update →
        end of step (guard, log, checkpoint, signals)."""
        for step in range(self.run.step, self.config.train.steps):
            rollout = self.rollouts.next(step)
            controls = self.kl.state_dict(), self.normalizer.state_dict()
            metrics = {}  # a rank that trains nothing: its batches are sent, its step done
            if rollout.experience is not None:
                with self.world.training():  # what only the ranks that train take part in
                    metrics = self.algorithm.step(rollout, step)
            self.consumed = self.data.consumed_prompts, self.data.consumed_rehearsal
            if not self.run.check(step + 1, metrics):  # skipped: undo the step's controls
                self.kl.load_state_dict(controls[0])
                self.normalizer.load_state_dict(controls[1])
            if metrics:
                self.log(step + 1, metrics, rollout.experience)
            if self.run.end_step(step + 1, self.save, exit_signals):
                break
        return self.finish()

    def finish(self) -> int:
        """Close the run, the rollout source and the process groups; the summary line."""
        self.run.close()
        self.rollouts.close()
        destroy()
        stopped_by = self.run.stopped_by
        return finish(
            "train-ppo",
            dict(
                steps=self.run.step if stopped_by is not None else self.config.train.steps,
                first_reward=self.first_reward,
                last_reward=self.last_reward,
                seconds=round(time.time() - self.started, 1),
                output_dir=self.config.train.output_dir,
            ),
            stopped_by.name if stopped_by is not None else None,
        )

    def log(self, step: int, metrics: dict, experience) -> None:
        """The step's progress (the bar shows the reward, the KL and on GPUs the MFU), its
        metrics and its samples when the run's cadence says so (``train.log_interval``,
        ``train.sample_interval``: training/run.py ``Run.due``)."""
        self.last_reward = metrics["reward/mean"]
        self.first_reward = self.last_reward if self.first_reward is None else self.first_reward
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

    def save(self, step: int) -> Path | None:
        """Checkpoint ``step``: both engines, and the trainer state (:meth:`load_state`'s);
        written by the ranks that train (a rank that holds no engine returns None)."""
        from megatron_rlhf.checkpoint.dist import model_metadata
        from megatron_rlhf.training.checkpointing import save_training_checkpoint

        engines = self.roles.engines()
        if not engines:
            return None
        with self.world.training():
            state = {
                "step": step,
                "consumed_prompts": self.consumed[0],
                "consumed_rehearsal": self.consumed[1],
                "kl": self.kl.state_dict(),
                "normalizer": self.normalizer.state_dict(),
                "nonfinite": self.run.guard.state_dict(),
            }
            in_flight, tensors = self.rollouts.state()
            roles = {
                "actor": {"head": "lm", "num_scalar_outputs": 0, "prefix": "actor."},
                "critic": {"head": "scalar", "num_scalar_outputs": 1, "prefix": "critic."},
            }
            # save_training_checkpoint keeps the (global) trainer state and the schedules in
            # the metadata too, so that a run resumes at another world size or layout
            config = to_dict(self.config)
            metadata = model_metadata(self.roles.actor.model, roles=roles, config=config)
            return save_training_checkpoint(
                self.output_dir, step, engines, metadata, state | in_flight,
                tokenizer_dir=self.config.models.tokenizer or self.config.models.actor,
                trainer_tensors=tensors,
            )  # fmt: skip

    def load_state(self, state: dict) -> None:
        """The trainer state :meth:`save` wrote, past what ``Run.restore`` restores (the step,
        the guard) and what the data streams were opened at: the rollouts in flight (their
        tensors from the checkpoint's safetensors), the KL controller, the reward normaliser."""
        self.rollouts.load(state, self.run.resume_from)
        self.kl.load_state_dict(state["kl"])
        self.normalizer.load_state_dict(state["normalizer"])
