"""Configuration of ``train-ppo``: one small dataclass per concern (see examples/ppo/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rlhf.distributed.layouts import ParallelSection
from megatron_rlhf.training.engine import OptimConfig


@dataclass(kw_only=True)
class ModelsConfig:
    """Where each of the four roles comes from (HF BLOOM dirs or megatron-rlhf checkpoints)."""

    actor: str
    """The SFT policy to optimise (LM head)."""
    reference: str | None = None
    """The frozen reference policy of the KL term; default: the actor's checkpoint."""
    critic: str
    """Initialisation of the critic: the AM/RM checkpoint or the SFT trunk (a new 1-output
    scalar head is created on its trunk)."""
    reward: str | None = None
    """The frozen reward model (1 output) or Advantage Model (2 outputs: r and e_tau)."""
    reward_fn: str | None = None
    """Instead of a reward model: ``package.module:function`` mapping (prompt_ids, response_ids)
    lists of token ids to a float score (rule-based rewards, tests with a known reward)."""
    reward_kind: Literal["am", "rm"] = "am"
    """am: score = a = r - e_tau(x) (AM-PPO); rm: score = r (RM-PPO)."""
    tokenizer: str | None = None
    """Tokenizer directory (for sample dumps); default: the actor's checkpoint directory."""


@dataclass(kw_only=True)
class DataConfig:
    prompts: str
    """Indexed prompt dataset prefix (tools/preprocess_data.py --kind prompt)."""
    max_prompt_length: int = 256
    """Longer prompts keep their last max_prompt_length tokens."""
    prompt_clusters: str | None = None
    """Output prefix of tools/build_rehearsal_clusters.py run on the same prompts in the same
    order: reward statistics are then also logged per prompt cluster."""


@dataclass(kw_only=True)
class RolloutConfig:
    prompts_per_step: int = 8
    """Prompts rolled out per PPO step over the whole world: the global batch (paper: 256),
    split evenly over the data-parallel ranks of the rollout and of every role."""
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(kw_only=True)
class KLConfig:
    coef: float = 0.05
    """beta of Eq. 2 (initial value when adaptive)."""
    estimator: Literal["k1", "k2", "k3", "abs"] = "k1"
    adaptive: bool = False
    target: float = 6.0
    horizon: int = 10000


@dataclass(kw_only=True)
class PPOConfig:
    algorithm: Literal["ppo", "rejection_sampling"] = "ppo"
    epochs: int = 1
    """PPO epochs over each rollout batch."""
    num_minibatches: int = 1
    """Optimizer steps per epoch (each over 1/num_minibatches of the rollout batch)."""
    micro_batch_size: int = 4
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    reward_normalization: Literal["none", "moving_average"] = "none"
    """moving_average: the RM-PPO w/ MA baseline."""
    reward_ma_momentum: float = 0.9
    kl: KLConfig = field(default_factory=KLConfig)
    rejection_samples_per_prompt: int = 4
    """Rejection sampling (Eqs. 3-4): responses drawn per prompt."""
    rejection_threshold: float | None = None
    """Keep the best response of each prompt if its score >= this (None: always keep it)."""


@dataclass(kw_only=True)
class RehearsalSection:
    enabled: bool = False
    """Selective Rehearsal: add gamma * NLL(D_R batch) to the actor loss (Eq. 9)."""
    dataset: str | None = None
    """Indexed SFT dataset D_R (tools/build_rehearsal_clusters.py output prefix)."""
    gamma: float = 0.01
    micro_batch_size: int = 2
    """Rehearsal rows added to each actor microbatch."""
    max_length: int = 512


@dataclass(kw_only=True)
class TrainSection:
    steps: int = 100
    """PPO steps (the paper: 100 actor steps)."""
    seed: int = 1234
    output_dir: str = "runs/ppo"
    save_interval: int = 50
    log_interval: int = 1
    sample_interval: int = 10
    """Dump (prompt, response, score) samples to samples.jsonl every N steps."""
    resume: bool = True
    """Continue from output_dir's latest checkpoint when there is one."""
    bf16: bool = False
    """bf16 parameters (GPU); CPU runs stay fp32."""


@dataclass(kw_only=True)
class TrainPPOConfig:
    models: ModelsConfig
    parallel: ParallelSection = field(default_factory=ParallelSection)
    data: DataConfig
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    rehearsal: RehearsalSection = field(default_factory=RehearsalSection)
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-7))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-6))
    train: TrainSection = field(default_factory=TrainSection)
