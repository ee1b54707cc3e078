"""Intervals shared by the study's statistics (``stats``) and its claims (``claims``), which
``stats`` evaluates: kept apart so that neither imports the other back.

Two kinds:

- ``t_interval``: the Student-t interval of per-seed values (the seeds are the only noise it
  counts);
- ``crossed_bootstrap``: the seeds *and* the held-out items (judged prompts, scored pairs) both
  resampled, within each world. Every seed of one world is evaluated on the same held-out items,
  so their draw is shared noise that a per-seed t-interval cannot see (audit III, 3.6 and 3.8);
  a world is a stratum (its own SFT data, preference data and held-out sets), so items of two
  worlds are never mixed and each world keeps its seed and item counts in every resample.

A statistic enters ``crossed_bootstrap`` as per world ``(world, items, per_seed)``:
``per_seed(W)`` maps item weights ``W`` (k x items, one row per resample: how often each item
was drawn) to the k weighted per-seed values (seeds x k). The estimate is the mean over every
seed of its value at unit weights (so a net win's estimate is the mean of the per-seed net
wins, the t-test's estimate); a resample draws seed counts ``c`` and item counts ``W`` per world
and takes ``Σ_worlds Σ_s c_s · per_seed(W)_s / seeds``. The resample counts are fixed numbers of
(``BOOTSTRAP_SEED``, world, seeds or items, their count), so results recompute byte for byte,
and two claims of one world draw the same resamples (common random numbers).

``bootstrap_decision`` turns the draws into the claims' test: se = the draws' std, two-sided t
with seeds - 1 df on (estimate - null) / se, the 95 % interval estimate ± t_0.975 · se.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

RESAMPLES = 2000
"""Bootstrap resamples of every crossed interval."""
BOOTSTRAP_SEED = 50
"""The numpy seed of every crossed resample (with the world and the stratum's size)."""
SEEDS, ITEMS = 0, 1
"""Which stratum a resample-count matrix is of (part of its numpy seed)."""


def t_interval(values: Sequence[float]) -> tuple[float, float | None, float | None]:
    """Mean and the 95 % Student-t interval of per-seed values (None, None with one value)."""
    from scipy import stats

    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, None, None
    half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
    return mean, float(mean - half), float(mean + half)


@lru_cache(maxsize=256)
def resample_counts(rows: int, world: int, stratum: int) -> np.ndarray:
    """``RESAMPLES`` x ``rows`` float counts: how often each of ``rows`` rows is drawn in each
    resample (rows drawn with replacement, so each row of the matrix sums to ``rows``). Cached
    and read-only: the same matrix for the same (rows, world, stratum)."""
    rng = np.random.default_rng([BOOTSTRAP_SEED, world, stratum, rows])
    drawn = rng.integers(0, rows, (RESAMPLES, rows)) + rows * np.arange(RESAMPLES)[:, None]
    counts = np.bincount(drawn.ravel(), minlength=RESAMPLES * rows).reshape(RESAMPLES, rows)
    counts = counts.astype(np.float64)
    counts.flags.writeable = False
    return counts


Block = tuple[int, int, Callable[[np.ndarray], np.ndarray]]
"""``(world, items, per_seed)``: one world's part of a crossed statistic (module docstring)."""


def linear_block(world: int, values: np.ndarray) -> Block:
    """The block of per-seed item means of ``values`` (seeds x items): ``per_seed(W)`` is
    ``values @ W.T / W.sum(1)``, each seed's weighted mean over the items (computed as
    ``(W @ values.T).T``: 3x faster with a tall ``W`` on this machine's BLAS)."""
    values = np.asarray(values, dtype=np.float64)
    return world, values.shape[1], lambda w: (w @ values.T).T / w.sum(axis=1)


def crossed_bootstrap(blocks: list[Block]) -> tuple[float, np.ndarray, int]:
    """``(estimate, draws, seeds)``: the statistic at unit weights, its ``RESAMPLES``
    resampled values (seeds and items resampled within each world) and the number of seeds."""
    total, seeds, draws = 0.0, 0, np.zeros(RESAMPLES)
    for world, items, per_seed in blocks:
        full = np.asarray(per_seed(np.ones((1, items))))[:, 0]
        weighted = np.asarray(per_seed(resample_counts(items, world, ITEMS)))  # seeds x B
        counts = resample_counts(len(full), world, SEEDS)  # B x seeds
        draws += np.einsum("bs,sb->b", counts, weighted)
        total += float(full.sum())
        seeds += len(full)
    return total / seeds, draws / seeds, seeds


def crossed_linear_many(cells: dict) -> dict:
    """``crossed_bootstrap`` of ``[linear_block(world, values), ...]`` for many statistics at
    once: ``{key: [(world, values), ...]}`` to ``{key: (estimate, draws, seeds)}``. The values
    of one world and item count are stacked into one product with the item counts (one large
    matrix product is ~20x faster than many small ones on a 2-core machine); each key's
    numbers are those of ``crossed_bootstrap`` up to the product's rounding."""
    groups: dict = {}
    for key, blocks in cells.items():
        for world, values in blocks:
            values = np.asarray(values, dtype=np.float64)
            groups.setdefault((world, values.shape[1]), []).append((key, values))
    totals = {key: [0.0, np.zeros(RESAMPLES), 0] for key in cells}
    for (world, items), members in groups.items():
        stacked = np.vstack([values for _, values in members])
        weighted = resample_counts(items, world, ITEMS) @ stacked.T / items  # B x all seeds
        start = 0
        for key, values in members:
            seeds = len(values)
            counts = resample_counts(seeds, world, SEEDS)
            total = totals[key]
            total[1] += np.einsum("bs,bs->b", counts, weighted[:, start : start + seeds])
            total[0] += float(values.mean(axis=1).sum())
            total[2] += seeds
            start += seeds
    return {key: (t[0] / t[2], t[1] / t[2], t[2]) for key, t in totals.items()}


def bootstrap_decision(estimate: float, se: float, seeds: int, null: float = 0.0) -> dict:
    """Two-sided p of ``estimate`` against ``null`` as a t with ``seeds - 1`` df on
    ``(estimate - null) / se``, and the 95 % interval ``estimate ± t_0.975 · se`` (p and the
    interval None with one seed; se 0: p 0 off the null, 1 on it)."""
    from scipy import stats

    if seeds < 2:
        return {"p": None, "ci_low": None, "ci_high": None}
    if se == 0.0:
        p = 0.0 if estimate != null else 1.0
    else:
        p = float(2 * stats.t.sf(abs(estimate - null) / se, seeds - 1))
    half = float(stats.t.ppf(0.975, seeds - 1)) * se
    return {"p": p, "ci_low": estimate - half, "ci_high": estimate + half}


def crossed_interval(blocks: list[Block], null: float = 0.0, bootstrap=None) -> dict:
    """``crossed_bootstrap`` (or ``bootstrap``, its ``(estimate, draws, seeds)`` computed
    already) and ``bootstrap_decision``: estimate, se, seeds, p, ci_low, ci_high."""
    estimate, draws, seeds = bootstrap or crossed_bootstrap(blocks)
    se = float(np.std(draws, ddof=1)) if seeds > 1 else None
    out = {"estimate": estimate, "se": se, "seeds": seeds}
    out.update(bootstrap_decision(estimate, se or 0.0, seeds, null))
    return out
