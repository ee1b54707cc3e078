"""The non-finite guard every trainer shares: a NaN/inf never becomes an update or a checkpoint.

Two lines of defence:

- ``step_is_finite(loss, grad_norm)`` is what an engine asks after the backward pass and before
  the optimizer update; every rank gets the same answer (one scalar all-reduce), so all ranks
  apply or skip the update together. A skipped update leaves weights and optimizer state as
  they were.
- ``NonFiniteGuard.check(step, metrics)`` is what a trainer asks once per step: a step with a
  non-finite loss (any ``loss`` / ``*_loss`` metric), gradient norm or ``update_skipped`` flag
  is counted; past
  ``max_skips`` (config ``train.max_nonfinite_skips``, default 0) the run stops with a one-line
  :class:`NonFiniteError` (an InputError: exit code 2) naming the step, before any checkpoint
  of that step is written.

The checkpoint writer has its own check, ``checkpoint.dist.require_finite_state``: it refuses to
save any non-finite tensor.
"""

from __future__ import annotations

import math

import torch

# the checkpoint writer's own check lived here: its name stays importable from here
from megatron_rlhf.checkpoint.dist import require_finite_state  # noqa: F401
from megatron_rlhf.distributed.parallel import world_max
from megatron_rlhf.utils import InputError, NonFiniteError

UPDATE_SKIPPED = "update_skipped"
"""Metric an engine sets to 1.0 when it skipped the optimizer update of a non-finite step."""


def _any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any rank (collective when distributed)."""
    return world_max(int(flag)) > 0


def _finite(value) -> bool:
    if value is None:
        return True
    if torch.is_tensor(value):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


def step_is_finite(loss=None, grad_norm=None) -> bool:
    """Whether every rank's ``loss`` and ``grad_norm`` (None: not known here) are finite.

    Collective over the world: call it on every rank of the step."""
    return not _any_rank(not (_finite(loss) and _finite(grad_norm)))


class NonFiniteGuard:
    """Counts non-finite steps of one run and stops it past ``max_skips``."""

    def __init__(
        self,
        max_skips: int = 0,
        config_key: str = "train.max_nonfinite_skips",
        lr_key: str = "optim.lr",
    ):
        if max_skips < 0:
            raise InputError(f"{config_key}={max_skips} must be >= 0")
        self.max_skips = max_skips
        self.config_key = config_key
        self.lr_key = lr_key  # named in the error's fix
        self.skipped = 0

    def check(self, step: int, metrics: dict) -> bool:
        """True if step ``step`` was finite; False if it was skipped (and counted).

        Raises :class:`NonFiniteError` once more than ``max_skips`` steps were skipped.
        Collective over the world (every rank decides the same)."""
        bad = {
            key: value
            for key, value in metrics.items()
            if _watched(key) and isinstance(value, (int, float)) and not math.isfinite(value)
        }
        skipped = any(
            key.endswith(UPDATE_SKIPPED) and value > 0
            for key, value in metrics.items()
            if isinstance(value, (int, float))
        )
        if not _any_rank(bool(bad) or skipped):
            return True
        self.skipped += 1
        if self.skipped > self.max_skips:
            first = sorted(bad.items(), key=_most_telling)
            named = ", ".join(f"{k}={v}" for k, v in first[:3]) or "update skipped"
            raise NonFiniteError(
                f"step {step}: non-finite loss or gradient norm ({named}); stopped after "
                f"{self.skipped} non-finite step(s) ({self.config_key}={self.max_skips}); no "
                f"checkpoint of this step was written; lower the learning rate ({self.lr_key}) or "
                f"raise {self.config_key}"
            )
        return False

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))


def _watched(key: str) -> bool:
    """Losses and gradient norms (``actor/policy_loss``, ``grad_norm``, ...): other metrics may
    be NaN on a healthy step (e.g. the explained variance of constant returns)."""
    name = key.rsplit("/", 1)[-1]
    return name in ("loss", "grad_norm") or name.endswith("_loss")


def _most_telling(item: tuple[str, float]) -> tuple[int, str]:
    """Sort key: the loss and gradient norm first, then the other losses, then the rest."""
    name = item[0].rsplit("/", 1)[-1]
    return (0 if name in ("loss", "grad_norm") else 1 if name.endswith("loss") else 2, item[0])
