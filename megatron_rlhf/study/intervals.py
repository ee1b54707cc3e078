"""Per-seed intervals shared by the study's statistics (``stats``) and its claims (``claims``),
which ``stats`` evaluates: kept apart so that neither imports the other back."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def t_interval(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """Mean and the 95 % Student-t interval of per-seed values (None, None with one value)."""
    from scipy import stats

    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, None, None
    half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    return mean, float(mean - half), float(mean + half)
