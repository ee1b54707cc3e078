"""``train-reward``'s config: its sections, their defaults and the checks of their values.

The ``model``, ``parallel`` and ``train`` sections are the single-model trainers' (training/
config.py); ``data``, ``am`` and the loss are the reward model's. :func:`config_problems`
checks a config before anything is opened, :func:`check_policy_column` the ``am`` keys against
the preference data once it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rlhf.distributed.layouts import LayoutConfig
from megatron_rlhf.training import config as shared
from megatron_rlhf.training.config import (
    DeepSpeedConfig,
    ModelConfig,
    OptimConfig,
    optim_problems,
)
from megatron_rlhf.utils import InputError

DEFAULT_MARGIN = 2.5
"""m(x) of Eq. 6; the paper uses the constant 2.5 throughout."""


@dataclass(kw_only=True)
class RewardDataConfig(shared.TrainEvalDataConfig):
    """Preference data: prefixes written by ``tools/preprocess_data.py --kind preference``."""

    max_length: int | None = None
    """Longest prompt + response allowed (None: the model's max_sequence_length)."""


@dataclass(kw_only=True)
class AMConfig:
    """Advantage Model settings (ignored for ``loss: rm``)."""

    margin: float = DEFAULT_MARGIN
    """m(x) of Eq. 6 (the paper: 2.5)."""
    policy_column: int | None = None
    """Behaviour log-prob column holding π_φ(y|x) (see reward/train.py); None: K = 0."""
    num_policies: float | None = None
    """N of Eq. 8 (default K + 1)."""
    max_importance_weight: float = 1.0
    """Clip of each importance weight w_k of Eq. 8; K × this must stay below N, so that
    Σ_k w_k / N < 1 and a rises with r (see reward/losses.py)."""


@dataclass(kw_only=True)
class TrainConfig(shared.TrainConfig):
    """Batching, evaluation, checkpointing and logging (an example is a preference pair)."""

    global_batch_size: int = 180
    """Pairs per optimizer step (paper: 180 English, 480 Chinese)."""


@dataclass(kw_only=True)
class RewardTrainConfig:
    """``train-reward``: one Reward Model or Advantage Model run."""

    loss: Literal["am", "rm"] = "am"
    """am: Advantage Model (Eq. 6); rm: Reward Model (Eq. 1)."""
    backend: Literal["megatron", "deepspeed"] = "megatron"
    """megatron: Megatron-Core BLOOM, any TP/PP/DP; deepspeed: transformers' BLOOM under
    DeepSpeed ZeRO, data parallel only (reward/train_deepspeed.py)."""
    model: ModelConfig
    parallel: LayoutConfig = field(default_factory=LayoutConfig)
    """The model's TP/PP layout (data parallel over the rest of the launch)."""
    data: RewardDataConfig
    am: AMConfig = field(default_factory=AMConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO settings (``backend: deepspeed`` only)."""


def config_problems(config: RewardTrainConfig) -> list[str]:
    """What is wrong with ``config`` (every problem, in one list)."""
    problems = shared.config_problems(config.train, config.data)
    if config.am.margin <= 0:
        problems.append(f"am.margin={config.am.margin} must be > 0")
    problems += optim_problems(config.optim, "optim")
    if config.backend == "deepspeed":
        from megatron_rlhf.reward.train_deepspeed import config_problems as deepspeed_problems

        problems += deepspeed_problems(config)
    return problems


def check_policy_column(config: RewardTrainConfig, dataset) -> None:
    """``am.policy_column`` and the Eq. 8 clip against the behaviour log-probs of ``dataset``."""
    from megatron_rlhf.training.run import log

    column, count = config.am.policy_column, dataset.num_behaviour_policies
    if config.loss != "am" or column is None:
        if count and config.loss == "am":
            log(
                "train-reward",
                f"note: {dataset.prefix} has {count} behaviour log-probs per "
                "response, unused without am.policy_column (a = r - e_τ)",
            )
        return
    if not 0 <= column < count:
        raise InputError(
            f"am.policy_column={column}: {dataset.prefix} has {count} behaviour log-prob "
            f"columns; choose one in [0, {count}) or leave am.policy_column unset"
        )
    num_policies = config.am.num_policies or count + 1
    if not 0 < config.am.max_importance_weight < num_policies / count:
        raise InputError(
            f"am.max_importance_weight={config.am.max_importance_weight} with K={count} "
            f"behaviour policies and N={num_policies}: need 0 < K × max_importance_weight < N, "
            "or Σ_k w_k / N can reach 1 and Eq. 8 ranks against r; lower it or raise "
            "am.num_policies"
        )
