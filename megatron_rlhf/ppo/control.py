"""The KL coefficient and the reward normaliser: the two pieces of PPO state besides models.

Both are tiny, checkpointed through ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

import math


class KLController:
    """beta of Eq. 2: fixed, or adaptive towards a target KL (Ziegler et al., 2019).

    Adaptive: ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon`` after each batch
    of n rollouts: the global batch, summed over data-parallel ranks (``train.observed_kl``),
    so the coefficient moves as fast at any DP size.
    """

    def __init__(self, init_coef: float, adaptive: bool = False, target: float = 6.0,
                 horizon: int = 10000):  # fmt: skip
        self.coef = init_coef
        self.adaptive = adaptive
        self.target = target
        self.horizon = horizon

    def update(self, observed_kl: float, num_rollouts: int) -> None:
        if not self.adaptive:
            return
        error = min(max(observed_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * num_rollouts / self.horizon

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["coef"]


class RewardNormalizer:
    """RM-PPO w/ MA (paper §4): scores normalised by a moving average of their mean and std.

    ``mode="none"`` passes scores through. With ``moving_average`` the statistics are updated
    with each batch (momentum ``momentum`` on the running values) before normalising it.
    """

    def __init__(self, mode: str = "none", momentum: float = 0.9):
        if mode not in ("none", "moving_average"):
            raise ValueError(f"reward normalisation must be none|moving_average, got {mode!r}")
        self.mode = mode
        self.momentum = momentum
        self.mean = 0.0
        self.var = 1.0
        self.count = 0

    def __call__(self, batch_mean: float, batch_var: float) -> tuple[float, float]:
        """Update with a batch's (global) mean and variance; return (shift, scale) to apply."""
        if self.mode == "none":
            return 0.0, 1.0
        if self.count == 0:
            self.mean, self.var = batch_mean, batch_var
        else:
            m = self.momentum
            self.mean = m * self.mean + (1 - m) * batch_mean
            self.var = m * self.var + (1 - m) * batch_var
        self.count += 1
        return self.mean, math.sqrt(self.var + 1e-8)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
