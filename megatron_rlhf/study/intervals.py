"""Intervals shared by the study's statistics (``stats``) and its claims (``claims``), which
``stats`` evaluates: kept apart so that neither imports the other back.

Two kinds:

- ``t_interval``: the Student-t interval of per-seed values (the seeds are the only noise it
  counts);
- the *held-out-aware* interval (``crossed_bootstrap``, ``crossed_interval``): the variance of
  the estimate as the sum of two components, the seeds' and the held-out items' (judged
  prompts, scored pairs). Every seed of one world is evaluated on the same held-out items, so
  their draw is noise shared by the seeds that a per-seed t-interval cannot see (audit III, 3.6
  and 3.8):

    se² = sd(per-seed values)² / seeds  +  Var_B(the estimate with the items resampled)

  The first term is the seeds-only t-test's, over every seed of every world (so it also holds
  how the worlds' per-seed values differ). The second resamples each world's items with
  replacement, the seeds held fixed, ``RESAMPLES`` times; a world is a stratum (its own SFT
  data, preference data and held-out sets), so items of two worlds are never mixed and each
  world keeps its item count. The two terms share the seeds' response-sampling noise at
  1/seeds of its size (a seed-averaged item mean still carries it), so the sum errs wide by
  that much; it is never below the seeds-only se. (A bootstrap that resampled seeds *within*
  worlds as well was tried first: with the worlds as fixed strata it drops the worlds'
  differences and keeps (n - 1) / n of the seeds' variance, and on the development run it
  came out *narrower* than the seeds-only t-test in 19 of 30 claims.)

A statistic enters ``crossed_bootstrap`` as per world ``(world, items, per_seed)``:
``per_seed(W)`` maps item weights ``W`` (k x items, one row per resample: how often each item
was drawn) to the k weighted per-seed values (seeds x k). The estimate is the mean over every
seed of its value at unit weights (so a net win's estimate is the mean of the per-seed net
wins, the t-test's estimate). The resample counts are fixed numbers of (``BOOTSTRAP_SEED``,
world, item count), so results recompute byte for byte, and two claims of one world draw the
same resamples (common random numbers).

``bootstrap_decision`` turns the se into the claims' test: two-sided t with seeds - 1 df on
(estimate - null) / se, the 95 % interval estimate ± t_0.975 · se.
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
ITEMS = 1
"""The stratum of the item resample counts (part of their numpy seed)."""


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


def crossed_bootstrap(blocks: list[Block]) -> tuple[float, np.ndarray, np.ndarray]:
    """``(estimate, draws, per_seed)``: the statistic at unit weights, its ``RESAMPLES`` values
    with each world's items resampled (seeds fixed), and every seed's value at unit weights
    (the seeds-only term's input), world after world."""
    values, draws = [], np.zeros(RESAMPLES)
    for world, items, per_seed in blocks:
        values.append(np.asarray(per_seed(np.ones((1, items))))[:, 0])
        draws += np.asarray(per_seed(resample_counts(items, world, ITEMS))).sum(axis=0)
    full = np.concatenate(values)
    return float(full.mean()), draws / len(full), full


def crossed_linear_many(cells: dict) -> dict:
    """``crossed_bootstrap`` of ``[linear_block(world, values), ...]`` for many statistics at
    once: ``{key: [(world, values), ...]}`` to ``{key: (estimate, draws, per_seed)}``. The
    values of one world and item count are stacked into one product with the item counts (one
    large matrix product is ~20x faster than many small ones on a 2-core machine); each key's
    numbers are those of ``crossed_bootstrap`` up to the product's rounding."""
    groups: dict = {}
    for key, blocks in cells.items():
        for world, values in blocks:
            values = np.asarray(values, dtype=np.float64)
            groups.setdefault((world, values.shape[1]), []).append((key, values))
    totals = {key: [[], np.zeros(RESAMPLES)] for key in cells}
    for (world, items), members in groups.items():
        stacked = np.vstack([values for _, values in members])
        weighted = resample_counts(items, world, ITEMS) @ stacked.T / items  # B x all seeds
        start = 0
        for key, values in members:
            seeds = len(values)
            totals[key][0].append(values.mean(axis=1))
            totals[key][1] += weighted[:, start : start + seeds].sum(axis=1)
            start += seeds
    out = {}
    for key, (values, draws) in totals.items():
        full = np.concatenate(values)
        out[key] = (float(full.mean()), draws / len(full), full)
    return out


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
    """``crossed_bootstrap`` (or ``bootstrap``, its ``(estimate, draws, per_seed)`` computed
    already) and ``bootstrap_decision``: estimate, se (module docstring) with its two terms
    ``se_seeds`` and ``se_items``, seeds, p, ci_low, ci_high."""
    estimate, draws, per_seed = bootstrap or crossed_bootstrap(blocks)
    seeds = len(per_seed)
    out = {"estimate": estimate, "se": None, "se_seeds": None, "se_items": None, "seeds": seeds}
    if seeds > 1:
        se_seeds = float(np.std(per_seed, ddof=1)) / math.sqrt(seeds)
        se_items = float(np.std(draws, ddof=1))
        out.update(se=math.hypot(se_seeds, se_items), se_seeds=se_seeds, se_items=se_items)
    out.update(bootstrap_decision(estimate, out["se"] or 0.0, seeds, null))
    return out
