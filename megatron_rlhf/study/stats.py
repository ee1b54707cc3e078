"""The study's numbers as pure functions of its raw records (no I/O, no models).

``results_from_records`` turns the per-seed pair records (``reward/<model>/seed<S>/pairs.jsonl``),
judgment records (``ppo/<arm>/seed<S>/judgments.jsonl``) and PPO training metrics into
``results.json``; a test recomputes it from the files.

Intervals are 95 %:

- across seeds, a Student-t interval on the per-seed values (``ci_low``/``ci_high`` of every
  summary and Table 2 cell; absent with one seed). It counts the seeds' noise only;
- held-out-aware (``intervals.crossed_interval``: the seeds' variance plus that of the
  held-out items, resampled within each world): Table 2's ``ci_low_crossed``/``ci_high_crossed``
  (and ``se_crossed``) of the net win, and every claim's verdict (``claims.py``). Every seed of
  a world is judged on the same prompts and scores the same pairs, so the held-out draw is
  noise the seed interval cannot see;
- within a seed a percentile bootstrap over pairs or prompts (``bootstrap``).

Worlds: ``worlds`` maps each seed to its world (None: every seed in world 0). Seeds are nested in
worlds; a world has its own SFT data, preference data and held-out sets, so item ``i`` (pair or
prompt) is the same item only within a world.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from megatron_rlhf.reward.calibration import (
    expected_calibration_error,
    per_task_stats,
    ranking_accuracy,
)
from megatron_rlhf.study.intervals import (
    BOOTSTRAP_SEED,
    RESAMPLES,
    crossed_interval,
    crossed_linear_many,
    linear_block,
    t_interval,
)

BOOTSTRAP_SAMPLES = 1000
OUTCOMES = ("win", "tie", "lose")
VERDICT_SIGN = {"win": 1, "tie": 0, "lose": -1}


def bootstrap_interval(
    per_row: np.ndarray, statistic: Callable[[np.ndarray], float], seed: int = 0
) -> tuple[float, float]:
    """95 % percentile bootstrap: ``statistic`` of row indices resampled with replacement.

    ``statistic`` maps an index array into ``per_row``'s rows (numpy, so 1000 draws are cheap).
    """
    draws = [statistic(idx) for idx in bootstrap_indices(len(per_row), seed)]
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(low), float(high)


def bootstrap_indices(rows: int, seed: int) -> np.ndarray:
    """The ``BOOTSTRAP_SAMPLES`` x ``rows`` resampled row indices of ``seed``: one draw, the same
    numbers as one ``rng.integers(0, rows, rows)`` per resample (numpy's int64 draws are not
    buffered across calls), in ~1/50 of the time."""
    return np.random.default_rng(seed).integers(0, rows, (BOOTSTRAP_SAMPLES, rows))


def bootstrap_mean_percent_interval(values: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """``bootstrap_interval(values, partial(_mean_percent, values), seed)``, all resamples at
    once: each row's mean of integer values is the same float (exact sums)."""
    if not np.issubdtype(values.dtype, np.integer):
        return bootstrap_interval(values, partial(_mean_percent, values), seed)
    draws = 100.0 * values[bootstrap_indices(len(values), seed)].mean(axis=1)
    low, high = np.percentile(draws, [2.5, 97.5])
    return float(low), float(high)


def summary(per_seed: list[float]) -> dict:
    mean, low, high = t_interval(per_seed)
    return {"mean": mean, "ci_low": low, "ci_high": high, "per_seed": per_seed}


# ---------------------------------------------------------------- Table 1 (pairs)


def brier(pairs: list[dict]) -> float:
    """Mean squared gap between the scorer's probability σ(s_c - s_r) and the true p_true."""
    total = 0.0
    for pair in pairs:
        predicted = 1.0 / (1.0 + math.exp(-(pair["chosen_score"] - pair["rejected_score"])))
        total += (predicted - pair["p_true"]) ** 2
    return total / len(pairs)


def confidence_cap(margin: float) -> float:
    """The most confident an Advantage Model trained with margin m can be on any pair.

    Eq. 6 per pair is ``-log σ(a_c - a_r) - log σ(m - a_c) - log σ(m + a_r)``. Even for a pair
    whose label never varies, its optimum is at ``a_c = -a_r = m/3`` (the derivative of
    ``-log σ(2a) - 2 log σ(m - a)`` vanishes where ``σ(-2a) = σ(a - m)``), so the score gap is
    at most ``2m/3`` and the confidence ``σ(|gap|)`` at most ``σ(2m/3)``: 0.731 at m = 1.5,
    0.841 at m = 2.5, 0.935 at m = 4, 0.995 at m = 8. Noisy labels pull it lower still."""
    return 1.0 / (1.0 + math.exp(-2.0 * margin / 3.0))


def overconfidence(pairs: list[dict]) -> float:
    """Signed calibration ×100: mean(confidence - correct) over the pairs, confidence
    σ(|s_c - s_r|) and correct as in the ECE (a tie counts 1/2). It equals
    ``Σ_b n_b/n (conf_b - acc_b)`` for any binning (the signed gaps do not cancel differently
    per bin), so it is the ECE's terms without the absolute value: > 0 over-confident,
    < 0 under-confident."""
    from megatron_rlhf.reward.calibration import pair_correctness

    chosen = np.array([p["chosen_score"] for p in pairs])
    rejected = np.array([p["rejected_score"] for p in pairs])
    confidence = 1.0 / (1.0 + np.exp(-np.abs(chosen - rejected)))
    return 100.0 * float(np.mean(confidence - pair_correctness(chosen, rejected).numpy()))


def calibrated_ece(pairs: list[dict], draws: int = 1000, seed: int = 0) -> dict:
    """The ECE noise floor of these pairs: the ECE of a perfectly calibrated scorer, whose
    score gap on every pair is ``logit(p_true)`` (its confidence is the truth), when the labels
    are redrawn from ``p_true`` (``draws`` times). ``{"mean", "low", "high"}`` (2.5 / 97.5 %
    percentiles): an ECE inside this range cannot be told from perfect calibration on this
    test set."""
    from megatron_rlhf.reward.calibration import expected_calibration_error

    p = np.clip(np.array([pair["p_true"] for pair in pairs]), 1e-12, 1 - 1e-12)
    gap = np.log(p) - np.log1p(-p)  # chosen - rejected
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(draws):
        chosen_preferred = rng.random(len(p)) < p
        signed = np.where(chosen_preferred, gap, -gap)  # the gap as the new label orients it
        values.append(expected_calibration_error(signed, np.zeros_like(signed)))
    low, high = np.percentile(values, [2.5, 97.5])
    return {"mean": float(np.mean(values)), "low": float(low), "high": float(high)}


def share_above_cap(pairs: list[dict], margin: float) -> float:
    """Percent of the pairs whose true confidence max(p, 1 - p) exceeds the AM's cap at m."""
    cap = confidence_cap(margin)
    return 100.0 * float(np.mean([max(p["p_true"], 1.0 - p["p_true"]) > cap for p in pairs]))


PAIR_METRICS: dict[str, Callable[[list[dict]], float]] = {
    "accuracy": lambda pairs: (
        100.0
        * ranking_accuracy([p["chosen_score"] for p in pairs], [p["rejected_score"] for p in pairs])
    ),
    "ece": lambda pairs: expected_calibration_error(
        [p["chosen_score"] for p in pairs], [p["rejected_score"] for p in pairs]
    ),
    "brier": brier,
    "overconfidence": overconfidence,
}


def table1_row(pairs_by_seed: dict[int, list[dict]]) -> dict:
    """``{metric: {mean, ci_low, ci_high, per_seed}}`` over the seeds of one scorer."""
    seeds = sorted(pairs_by_seed)
    return {
        name: summary([metric(pairs_by_seed[s]) for s in seeds])
        for name, metric in PAIR_METRICS.items()
    }


def pair_metric_statistics(pairs: list[dict]) -> dict[str, Callable[[np.ndarray], float]]:
    """The three Table 1 metrics as functions of a row-index array (for the bootstrap); on
    ``arange(len(pairs))`` they equal ``PAIR_METRICS`` (ECE: Σ_b |Σ_(i in b) (correct_i -
    conf_i)| / n, the same sum as Σ_b n_b/n |acc_b - conf_b|)."""
    from megatron_rlhf.reward.calibration import calibration_bins, pair_correctness

    chosen = np.array([p["chosen_score"] for p in pairs])
    rejected = np.array([p["rejected_score"] for p in pairs])
    diff = chosen - rejected
    confidence = 1.0 / (1.0 + np.exp(-np.abs(diff)))
    correct = pair_correctness(chosen, rejected).numpy()
    edges = [row["conf_lo"] for row in calibration_bins(chosen, rejected)][1:]
    bins = np.searchsorted(edges, confidence, side="right")
    gap = correct - confidence
    squared = (1.0 / (1.0 + np.exp(-diff)) - np.array([p["p_true"] for p in pairs])) ** 2
    return {
        "accuracy": lambda idx: 100.0 * float(np.mean(diff[idx] > 0)),
        "ece": lambda idx: (
            100.0
            * float(
                np.abs(np.bincount(bins[idx], weights=gap[idx], minlength=len(edges) + 1)).sum()
            )
            / len(idx)
        ),
        "brier": lambda idx: float(np.mean(squared[idx])),
        "overconfidence": lambda idx: -100.0 * float(np.mean(gap[idx])),
    }


PAIR_COLUMNS = ("right", "squared", "gap")
"""``pair_columns``' first columns; the ECE's per-bin gap columns follow."""


def pair_columns(pairs: list[dict]) -> np.ndarray:
    """pairs x (3 + bins): per pair ``right`` (1 where the chosen scores higher), ``squared``
    (Brier term), ``gap`` (correct - confidence, a tie counting 1/2) and the gap again in the
    column of its confidence bin (bins fixed from these pairs, unweighted): every Table 1 metric
    under pair weights ``W`` is a function of ``W @ columns`` (``pair_metrics_of``)."""
    from megatron_rlhf.reward.calibration import calibration_bins, pair_correctness

    chosen = np.array([p["chosen_score"] for p in pairs], dtype=np.float64)
    rejected = np.array([p["rejected_score"] for p in pairs], dtype=np.float64)
    diff = chosen - rejected
    confidence = 1.0 / (1.0 + np.exp(-np.abs(diff)))
    gap = pair_correctness(chosen, rejected).numpy() - confidence
    edges = [row["conf_lo"] for row in calibration_bins(chosen, rejected)][1:]
    bins = np.searchsorted(edges, confidence, side="right")
    columns = np.zeros((len(pairs), len(PAIR_COLUMNS) + len(edges) + 1))
    columns[:, 0] = diff > 0
    columns[:, 1] = (1.0 / (1.0 + np.exp(-diff)) - np.array([p["p_true"] for p in pairs])) ** 2
    columns[:, 2] = gap
    columns[np.arange(len(pairs)), len(PAIR_COLUMNS) + bins] = gap
    return columns


def pair_metrics_of(products: np.ndarray, total: np.ndarray) -> dict[str, np.ndarray]:
    """The Table 1 metrics from ``W @ pair_columns`` (k x columns) and ``W.sum(1)``:
    accuracy = 100 Σ w·right / Σ w, Brier = Σ w·sq / Σ w, over-confidence = -100 Σ w·gap / Σ w,
    ECE = 100 Σ_b |Σ_(i in b) w_i gap_i| / Σ w."""
    n = len(PAIR_COLUMNS)
    return {
        "accuracy": 100.0 * products[:, 0] / total,
        "ece": 100.0 * np.abs(products[:, n:]).sum(axis=1) / total,
        "brier": products[:, 1] / total,
        "overconfidence": -100.0 * products[:, 2] / total,
    }


def pair_metric_weighted(pairs: list[dict]) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """The Table 1 metrics as functions of pair weights ``W`` (k x pairs: how often each pair
    is drawn, one row per resample) to the k weighted values, for the pairs x seeds bootstrap
    (``pair_metrics_of``; ECE bins fixed from the unweighted pairs). At unit weights they are
    ``pair_metric_statistics`` on every row; at integer weights, on the rows repeated that
    often."""
    columns = pair_columns(pairs)
    return {
        name: (lambda w, name=name: pair_metrics_of(w @ columns, w.sum(axis=1))[name])
        for name in PAIR_METRICS
    }


def table1_bootstrap(pairs_by_seed: dict[int, list[dict]]) -> dict:
    """Within-seed bootstrap intervals: ``{metric: [[low, high] per seed]}``: the percentile
    interval of ``bootstrap_interval`` over ``pair_metric_statistics``, all resamples at once
    (the same draws as pair-count weights, ``pair_metrics_of``; equal up to rounding)."""
    out = {name: [] for name in PAIR_METRICS}
    for seed in sorted(pairs_by_seed):
        pairs = pairs_by_seed[seed]
        n = len(pairs)
        drawn = bootstrap_indices(n, seed)
        drawn = drawn + n * np.arange(len(drawn))[:, None]
        counts = np.bincount(drawn.ravel(), minlength=drawn.size).reshape(-1, n).astype(float)
        values = pair_metrics_of(counts @ pair_columns(pairs), counts.sum(axis=1))
        for name in PAIR_METRICS:
            low, high = np.percentile(values[name], [2.5, 97.5])
            out[name].append([float(low), float(high)])
    return out


def per_task_table(pairs_by_seed: dict[int, list[dict]]) -> dict:
    """Fig. 4: ``{task: {"mean": summary, "std": summary, "std_scaled": summary}}`` of the
    scores per task. ``std_scaled`` divides the std by the scorer's own scale, its mean score
    gap |s_c - s_r| over all pairs of the seed, so scorers with compressed scores (the AM's
    margin caps its gaps) compare by spread relative to how far apart they place a pair."""
    seeds = sorted(pairs_by_seed)
    per_seed = []
    for s in seeds:
        pairs = pairs_by_seed[s]
        stats = per_task_stats([p["chosen_score"] for p in pairs],
                               [p["rejected_score"] for p in pairs],
                               [p["task"] for p in pairs])  # fmt: skip
        scale = float(np.mean([abs(p["chosen_score"] - p["rejected_score"]) for p in pairs]))
        for row in stats.values():
            row["std_scaled"] = row["std"] / max(scale, 1e-12)
        per_seed.append(stats)
    tasks = sorted(per_seed[0])
    return {
        task: {
            key: summary([stats[task][key] for stats in per_seed])
            for key in ("mean", "std", "std_scaled")
        }
        for task in tasks
    }


def oracle_accuracy(pairs: list[dict]) -> float:
    """Percent: the expected accuracy of ranking by the gold reward, mean of max(p, 1 - p)."""
    return 100.0 * sum(max(p["p_true"], 1.0 - p["p_true"]) for p in pairs) / len(pairs)


# ---------------------------------------------------------------- Table 2 (judgments)


def outcome_rates(judgments: list[dict]) -> dict:
    """Percent win / tie / lose and net win (win - lose) of one set of one seed."""
    counts = {name: 0 for name in OUTCOMES}
    for judgment in judgments:
        counts[judgment["outcome"]] += 1
    rates = {name: 100.0 * counts[name] / len(judgments) for name in OUTCOMES}
    return {**rates, "net_win": rates["win"] - rates["lose"]}


def table2_cell(judgments_by_seed: dict[int, list[dict]], set_name: str,
                evidence: Evidence | None = None, arm: str = "arm") -> dict:  # fmt: skip
    """``{win, tie, lose, net_win, ci_low, ci_high, per_seed}``: rates are seed means; the
    interval (over seeds) and ``per_seed`` are of the net win. ``evidence`` (holding these
    judgments as ``arm``) reuses its tables."""
    if evidence is None:
        evidence = Evidence({}, {arm: judgments_by_seed})
    seeds = sorted(judgments_by_seed)
    rates = []
    for s in seeds:
        signs = evidence.signs(arm, s, set_name)
        counts = {"win": int((signs == 1).sum()), "tie": int((signs == 0).sum()),
                  "lose": int((signs == -1).sum())}  # fmt: skip
        row = {name: 100.0 * counts[name] / len(signs) for name in OUTCOMES}
        rates.append({**row, "net_win": row["win"] - row["lose"]})
    mean, low, high = t_interval([r["net_win"] for r in rates])
    cell = {name: float(np.mean([r[name] for r in rates])) for name in OUTCOMES}
    return {**cell, "net_win": mean, "ci_low": low, "ci_high": high,
            "per_seed": [r["net_win"] for r in rates]}  # fmt: skip


def gains(judgments: list[dict]) -> dict:
    """Mean gold and training-reward gains of the policy over SFT, and the reward-hacking
    index: per task, the training-reward gain minus the gold gain, each in units of the SFT
    responses' std of that reward on the task's prompts (so the two scales compare, and no
    task's offset inflates another's std), then the mean over tasks (``hacking_index``; each
    task's as ``hacking_<task>``). Records that carry them also give, in percent, the
    policy's minus SFT's rate of the planted feature per task (``because_<task>``) and the
    share of responses cut by the generation budget (``truncated_policy``, ``truncated_sft``).
    """
    gold = np.array([[j["gold_policy"], j["gold_sft"]] for j in judgments])
    train = np.array([[j["train_policy"], j["train_sft"]] for j in judgments])
    task_of = np.array([j.get("task", "all") for j in judgments])
    out = hacking_block(gold, train, task_of)
    if "because_policy" in judgments[0]:
        because = np.array([[j["because_policy"], j["because_sft"]] for j in judgments])
        truncated = np.array([[j["truncated_policy"], j["truncated_sft"]] for j in judgments])
        out.update(feature_block(because, truncated, task_of))
    return out


def hacking_block(gold: np.ndarray, train: np.ndarray, task: np.ndarray) -> dict:
    """``gains``' gains and hacking index from arrays: ``gold`` and ``train`` (rows x [policy,
    SFT]) and each row's ``task``. ``gold_gain``, ``train_gain``; per task the z-gains
    (``_z_gain``) and their difference, the hacking; their means over tasks
    (``gold_gain_z``, ``train_gain_z``, ``hacking_index``) and, with several tasks, each
    task's hacking (``hacking_<task>``). ``gains`` and ``table_values`` both call it."""
    out = {"gold_gain": float(gold[:, 0].mean() - gold[:, 1].mean()),
           "train_gain": float(train[:, 0].mean() - train[:, 1].mean())}  # fmt: skip
    tasks = sorted(set(task.tolist()))
    per_task = {}
    for name in tasks:
        rows = task == name
        gold_z, train_z = _z_gain(gold[rows]), _z_gain(train[rows])
        per_task[name] = {"gold_gain_z": gold_z, "train_gain_z": train_z,
                          "hacking": train_z - gold_z}  # fmt: skip
    for key in ("gold_gain_z", "train_gain_z"):
        out[key] = float(np.mean([row[key] for row in per_task.values()]))
    out["hacking_index"] = float(np.mean([row["hacking"] for row in per_task.values()]))
    if len(tasks) > 1:
        out.update({f"hacking_{name}": row["hacking"] for name, row in per_task.items()})
    return out


def feature_block(because: np.ndarray, truncated: np.ndarray, task: np.ndarray) -> dict:
    """``gains``' planted-feature and truncation rates from arrays, in percent: ``because`` and
    ``truncated`` (rows x [policy, SFT]) and each row's ``task``. Per task the policy's minus
    SFT's rate of the planted feature (``because_<task>``), then the share of each side's
    responses cut by the generation budget (``truncated_policy``, ``truncated_sft``).
    ``gains`` and ``table_values`` both call it."""
    out = {}
    for name in sorted(set(task.tolist())):
        rows = because[task == name]
        out[f"because_{name}"] = 100.0 * float(np.mean(rows[:, 0]) - np.mean(rows[:, 1]))
    for index, who in enumerate(("policy", "sft")):
        out[f"truncated_{who}"] = 100.0 * float(np.mean(truncated[:, index]))
    return out


GOLD_PARTS = ("form_topic", "band", "because")
"""The gold utility's terms that every judgment record gives (``response_parts``); records
that carry ``form_*`` and ``topic_*`` split ``form_topic`` into ``form`` and ``topic`` too."""


def response_parts(judgment: dict, who: str) -> dict:
    """The gold reward's terms of the ``who`` ("policy" or "sft") response of a judgment, in
    units of its task's scale: ``form_topic`` (form + topic, each 0 or 1), ``band`` (0.5 x
    in band), ``because`` (w_t x the planted feature), and ``form``, ``topic`` where the record
    has them. A record without form/topic/band (the 15-seed published run's) gives form + topic
    and band from its gold reward: u = (gold - offset_t) / scale_t - w_t x because is
    form + topic + band / 2, a multiple of 0.5, whose fractional half is the band; form and
    topic cannot be told apart there (form + topic = 1 is either)."""
    from megatron_rlhf.study.world import BAND_WEIGHT, FORM_WEIGHT, TASK_SPECS, TOPIC_WEIGHT

    spec = TASK_SPECS[judgment["task"]]
    because = spec.because_weight * float(judgment[f"because_{who}"])
    if f"form_{who}" in judgment:
        form = FORM_WEIGHT * float(judgment[f"form_{who}"])
        topic = TOPIC_WEIGHT * float(judgment[f"topic_{who}"])
        band = BAND_WEIGHT * float(judgment[f"in_band_{who}"])
        return {"form_topic": form + topic, "band": band, "because": because, "form": form,
                "topic": topic}  # fmt: skip
    utility = (judgment[f"gold_{who}"] - spec.offset) / spec.scale - because
    halves = round(utility / BAND_WEIGHT)
    if abs(utility / BAND_WEIGHT - halves) > 1e-6:
        raise ValueError(f"gold {judgment[f'gold_{who}']} of a {judgment['task']} response "
                         "is not offset + scale x (form + topic + band / 2 + w x because): "
                         "the records are not of this world's gold reward")  # fmt: skip
    band = BAND_WEIGHT * (halves % 2)
    return {"form_topic": utility - band, "band": band, "because": because}


def gold_composition(judgments: list[dict]) -> dict:
    """What the gold gain and the net win of one set of one seed are made of.

    ``utility_gain``: mean (gold(policy) - gold(SFT)) / scale_t, and ``utility_<part>`` its
    exact split into the parts of ``response_parts`` (they sum to it); where the records split
    form from topic, ``utility_skill`` = form + band (the skill a forgetting policy loses, beside
    ``utility_because``, the planted feature's transfer). ``net_win_<kind>``: the
    net win's points from the judgments in which only that part changed (``because``,
    ``band``, ``form_topic``) or several did (``mixed``); they sum to the net win (a judgment
    with no part changed is a tie)."""
    rows = [(response_parts(j, "policy"), response_parts(j, "sft")) for j in judgments]
    parts = [p for p in (*GOLD_PARTS, "form", "topic") if all(p in pol for pol, _ in rows)]
    utility = {p: np.array([pol[p] - sft[p] for pol, sft in rows]) for p in parts}
    sign = np.array([VERDICT_SIGN[j["outcome"]] for j in judgments], dtype=np.int64)
    return composition_block(utility, sign)


def composition_block(utility: dict[str, np.ndarray], sign: np.ndarray) -> dict:
    """``gold_composition`` from arrays: ``utility[part]`` (per judgment, policy - SFT; every
    ``GOLD_PARTS`` part, ``form`` and ``topic`` where the records split them) and the outcome
    ``sign`` per judgment. ``gold_composition`` and ``table_values`` both call it."""
    out = {f"utility_{p}": float(np.mean(utility[p])) for p in (*GOLD_PARTS, "form", "topic")
           if p in utility}  # fmt: skip
    out["utility_gain"] = sum(out[f"utility_{p}"] for p in GOLD_PARTS)
    if "utility_form" in out:  # the skill: form and band; "because" is the hack's transfer
        out["utility_skill"] = out["utility_form"] + out["utility_band"]
    changed = np.stack([np.abs(utility[p]) > 1e-9 for p in GOLD_PARTS], axis=1)
    only = changed.sum(axis=1) == 1  # one part changed; none or several: "mixed"
    for index, kind in enumerate(GOLD_PARTS):
        out[f"net_win_{kind}"] = 100.0 * float(sign[only & changed[:, index]].sum()) / len(sign)
    out["net_win_mixed"] = 100.0 * float(sign[~only].sum()) / len(sign)
    return out


def _z_gain(pairs: np.ndarray) -> float:
    """Mean of column 0 minus mean of column 1, in units of column 1's std."""
    return float(pairs[:, 0].mean() - pairs[:, 1].mean()) / max(float(pairs[:, 1].std()), 1e-12)


def arm_values(judgments: list[dict]) -> dict:
    """``gains`` of one set of one seed, and ``gold_composition`` where the records carry the
    planted feature (the study's do)."""
    values = gains(judgments)
    if "because_policy" in judgments[0]:
        values.update(gold_composition(judgments))
    return values


def arm_extras(judgments_by_seed: dict[int, list[dict]], evidence: Evidence | None = None,
               arm: str = "arm") -> dict:  # fmt: skip
    """Per set: ``arm_values`` summarised over seeds, and the within-seed bootstrap of the net
    win. ``evidence`` (holding these judgments as ``arm``) reuses its tables."""
    if evidence is None:
        evidence = Evidence({}, {arm: judgments_by_seed})
    seeds = sorted(judgments_by_seed)
    out = {}
    for set_name in evidence.sets(arm):
        per_seed = [evidence.values(arm, s, set_name) for s in seeds]
        keys = [key for key in per_seed[0] if all(key in g for g in per_seed)]
        out[set_name] = {key: summary([g[key] for g in per_seed]) for key in keys}
        out[set_name]["net_win_bootstrap"] = [
            list(bootstrap_mean_percent_interval(evidence.signs(arm, s, set_name), s))
            for s in seeds
        ]
    return out


def _mean_percent(values: np.ndarray, idx: np.ndarray) -> float:
    return 100.0 * float(values[idx].mean())


SETS = ("main", "forget", "transfer", "minor")
"""The judged sets: ``main``; ``forget`` (every forget-set prompt); ``transfer`` (the forget
prompts of the preference families: main-family transfer); ``minor`` (the forget prompts of the
minor skills pooled, ``world.MINOR_TASKS``: families PPO sees at 5 % each and the reward models
never saw; the primary forget endpoint); and ``minor_<skill>`` per minor skill (reported, not
claimed)."""


def minor_tasks() -> tuple[str, ...]:
    """The world's minor skills (``world.MINOR_TASKS``)."""
    from megatron_rlhf.study import world

    return tuple(world.MINOR_TASKS)


def set_names() -> list[str]:
    """``SETS`` and one ``minor_<skill>`` per minor skill."""
    return [*SETS, *(f"minor_{task}" for task in minor_tasks())]


def set_mask(set_name: str, record_sets: np.ndarray, tasks: np.ndarray) -> np.ndarray:
    """Which judgments are in the judged set ``set_name``, from arrays of their records' sets
    ("main" or "forget") and prompt families (a boolean mask)."""
    forget = record_sets == "forget"
    minor = np.isin(tasks, minor_tasks())
    if set_name in ("main", "forget"):
        return record_sets == set_name
    if set_name == "transfer":
        return forget & ~minor
    if set_name == "minor":
        return forget & minor
    if set_name.startswith("minor_"):
        return forget & (tasks == set_name.removeprefix("minor_"))
    return np.zeros(len(record_sets), dtype=bool)


def _of_set(judgments: list[dict], set_name: str) -> list[dict]:
    sets = np.array([j["set"] for j in judgments])
    tasks = np.array([j.get("task", "all") for j in judgments])
    rows = [j for j, keep in zip(judgments, set_mask(set_name, sets, tasks)) if keep]
    if not rows:
        raise ValueError(f"no judgments of set {set_name!r}")
    return rows


# ---------------------------------------------------------------- everything


REHEARSAL_FEATURES = ("form", "topic", "because", "in_band")


def rehearsal_table(rehearsal: dict[str, dict[int, list[dict]]]) -> dict:
    """What each D_R is made of, over seeds: ``size``, ``utility`` (mean gold utility of its
    responses), the percent of its records that are well formed, on topic, say "because" and
    are in band, and ``share_<family>``: the percent of its records of each family."""
    from megatron_rlhf.study.world import TASK_SPECS

    out = {}
    for name, by_seed in rehearsal.items():
        per_seed = []
        for seed in sorted(by_seed):
            rows = by_seed[seed]
            values = {"size": float(len(rows)),
                      "utility": float(np.mean([r["utility"] for r in rows]))}  # fmt: skip
            for key in REHEARSAL_FEATURES:
                values[key] = 100.0 * float(np.mean([r[key] for r in rows]))
            for task in TASK_SPECS:
                values[f"share_{task}"] = 100.0 * float(np.mean([r["task"] == task for r in rows]))
            per_seed.append(values)
        out[name] = {key: summary([v[key] for v in per_seed]) for key in per_seed[0]}
    return out


def judgment_table(rows: list[dict]) -> dict:
    """One arm-seed's judgments as arrays: set, task, prompt id, outcome sign, net win (x100),
    the gold and training rewards of policy and SFT; where the records carry the planted
    feature also its rates, the truncation flags, each gold part per response (``part_<who>_
    <part>``, ``response_parts`` vectorised where the records give form, topic and band) and the
    per-prompt values ``utility_<part>`` (policy - SFT, ``skill`` = form + band) and
    ``because_rate`` (x100)."""
    from megatron_rlhf.study.world import BAND_WEIGHT, FORM_WEIGHT, TASK_SPECS, TOPIC_WEIGHT

    def column(key, kind=np.float64):
        return np.array([j[key] for j in rows], dtype=kind)

    task = np.array([j.get("task", "all") for j in rows])
    sign = np.array([VERDICT_SIGN[j["outcome"]] for j in rows], dtype=np.int64)
    table = {"set": np.array([j["set"] for j in rows]), "task": task,
             "prompt_id": column("prompt_id", np.int64), "sign": sign,
             "net_win": 100.0 * sign}  # fmt: skip
    for key in ("gold_policy", "gold_sft", "train_policy", "train_sft"):
        table[key] = column(key)
    if not rows or "because_policy" not in rows[0]:
        return table
    for key in ("because_policy", "because_sft", "truncated_policy", "truncated_sft"):
        table[key] = column(key)
    table["because_rate"] = 100.0 * (table["because_policy"] - table["because_sft"])
    names = (*GOLD_PARTS, "form", "topic")
    if all("form_policy" in j for j in rows):
        weight = np.array([TASK_SPECS[t].because_weight for t in task])
        for who in ("policy", "sft"):
            form = FORM_WEIGHT * column(f"form_{who}")
            topic = TOPIC_WEIGHT * column(f"topic_{who}")
            parts = {"form_topic": form + topic, "band": BAND_WEIGHT * column(f"in_band_{who}"),
                     "because": weight * table[f"because_{who}"], "form": form, "topic": topic}  # fmt: skip
            table.update({f"part_{who}_{p}": parts[p] for p in names})
    else:  # an archive without form / topic / band: read them off the gold reward
        for who in ("policy", "sft"):
            parts = [response_parts(j, who) for j in rows]
            for p in names:
                if all(p in row for row in parts):
                    table[f"part_{who}_{p}"] = np.array([row[p] for row in parts])
    for p in names:
        if f"part_policy_{p}" in table:
            table[f"utility_{p}"] = table[f"part_policy_{p}"] - table[f"part_sft_{p}"]
    table["utility_gain"] = sum(table[f"utility_{p}"] for p in GOLD_PARTS)
    if "utility_form" in table:
        table["utility_skill"] = table["utility_form"] + table["utility_band"]
    return table


def table_values(table: dict, mask: np.ndarray) -> dict:
    """``arm_values`` of the rows ``mask`` of a ``judgment_table``: the same numbers, from
    arrays (the list functions are the reference the tests hold this to)."""
    if not mask.any():
        raise ValueError("no judgments of this set")
    col = {key: value[mask] for key, value in table.items()}
    gold = np.stack([col["gold_policy"], col["gold_sft"]], axis=1)
    train = np.stack([col["train_policy"], col["train_sft"]], axis=1)
    out = hacking_block(gold, train, col["task"])
    if "because_policy" not in col:
        return out
    because = np.stack([col["because_policy"], col["because_sft"]], axis=1)
    truncated = np.stack([col["truncated_policy"], col["truncated_sft"]], axis=1)
    out.update(feature_block(because, truncated, col["task"]))
    utility = {p: col[f"utility_{p}"] for p in (*GOLD_PARTS, "form", "topic")
               if f"utility_{p}" in col}  # fmt: skip
    out.update(composition_block(utility, col["sign"]))
    return out


@dataclass(frozen=True)
class Comparison:
    """What a claim compares, ready for its interval: ``blocks`` (one ``intervals.Block`` per
    world; seeds and held-out items resampled) or, where only seeds are resampled,
    ``per_seed`` differences."""

    blocks: tuple = ()
    per_seed: tuple = ()
    worlds: int = 1

    @property
    def resamples(self) -> str:
        return "seeds and held-out items (within worlds)" if self.blocks else "seeds"

    def negated(self) -> Comparison:
        """The same comparison the other way round (worse - better)."""
        blocks = tuple((world, items, lambda w, fn=fn: -fn(w)) for world, items, fn in self.blocks)
        return Comparison(blocks, tuple(-v for v in self.per_seed), self.worlds)

    def differences(self) -> list[float]:
        """The per-seed differences (the blocks' values at unit weights)."""
        if not self.blocks:
            return [float(v) for v in self.per_seed]
        return [float(v) for _, items, fn in self.blocks for v in fn(np.ones((1, items)))[:, 0]]


class Evidence:
    """The records as the claims resample them: per arm, seed and judged set the per-prompt
    values in prompt order, per model and seed the pair metrics as functions of pair weights,
    and per-seed values (``seed_values``) for claims that resample seeds only. Built lazily:
    a claim reads only its arms."""

    def __init__(self, pairs: dict, judgments: dict, worlds: dict[int, int] | None = None,
                 seed_values: dict | None = None):  # fmt: skip
        self.pairs, self.judgments = pairs, judgments
        self.worlds = dict(worlds or {})
        self.seed_values = dict(seed_values or {})
        self._tables: dict = {}
        self._products: dict = {}
        self._columns: dict = {}
        self._sets: dict = {}

    def world(self, seed: int) -> int:
        return self.worlds.get(seed, 0)

    def _table(self, arm: str, seed: int) -> dict:
        """Every judgment of one arm-seed as arrays (``judgment_table``), built once."""
        key = (arm, seed)
        if key not in self._tables:
            self._tables[key] = judgment_table(self.judgments[arm][seed])
        return self._tables[key]

    def values(self, arm: str, seed: int, set_name: str) -> dict:
        """``arm_values`` of one arm-seed's judged set, from its table."""
        table = self._table(arm, seed)
        return table_values(table, set_mask(set_name, table["set"], table["task"]))

    def sets(self, arm: str) -> list[str]:
        """The judged sets (``set_names``) that every seed of ``arm`` has judgments of."""
        if arm not in self._sets:
            tables = [self._table(arm, seed) for seed in self.judgments[arm]]
            self._sets[arm] = [
                name
                for name in set_names()
                if all(set_mask(name, t["set"], t["task"]).any() for t in tables)
            ]
        return self._sets[arm]

    def signs(self, arm: str, seed: int, set_name: str) -> np.ndarray:
        """The outcome signs (win 1, tie 0, lose -1) of one arm-seed's judged set, in record
        order."""
        table = self._table(arm, seed)
        return table["sign"][set_mask(set_name, table["set"], table["task"])]

    def item_values(self, arm: str, seed: int, set_name: str, key: str,
                    task: str | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """``(prompt ids, values)`` of one arm-seed's judged set in prompt order (``task``:
        only that family's prompts). KeyError where the arm, the set or the value is missing."""
        table = self._table(arm, seed)
        if key not in table:
            raise KeyError(f"{arm}: no {key}")
        mask = set_mask(set_name, table["set"], table["task"])
        if task is not None:
            mask &= table["task"] == task
        if not mask.any():
            raise KeyError(f"{arm} seed {seed}: no judgments of set {set_name!r}")
        ids = table["prompt_id"][mask]
        order = np.argsort(ids, kind="stable")
        return ids[order], table[key][mask][order]

    def items(self, better: str, worse: str | None, set_name: str, key: str = "net_win",
              task: str | None = None) -> Comparison:  # fmt: skip
        """Arm ``better`` minus arm ``worse`` (None: minus 0) per judged prompt, on the seeds
        both ran, one ``intervals.linear_block`` per world of ``matrices``."""
        blocks = [linear_block(w, m) for w, m in self.matrices(better, worse, set_name, key, task)]
        return Comparison(blocks=tuple(blocks), worlds=len(blocks))

    def matrices(self, better: str, worse: str | None, set_name: str, key: str = "net_win",
                 task: str | None = None) -> list[tuple[int, np.ndarray]]:  # fmt: skip
        """``[(world, values[seed, prompt])]``: arm ``better``'s value minus arm ``worse``'s
        (None: minus 0) per judged prompt of ``set_name`` (``task``: of that family only), on
        the seeds both ran (ValueError where two seeds of a world, or the two arms, were judged
        on different prompts; KeyError where an arm, the set or the value is missing)."""
        seeds = set(self.judgments[better])
        if worse is not None:
            seeds &= set(self.judgments[worse])
        blocks = []
        for world in sorted({self.world(s) for s in seeds}):
            rows, ids = [], None
            for seed in sorted(s for s in seeds if self.world(s) == world):
                seed_ids, values = self.item_values(better, seed, set_name, key, task)
                if worse is not None:
                    other_ids, other = self.item_values(worse, seed, set_name, key, task)
                    if not np.array_equal(seed_ids, other_ids):
                        raise ValueError(f"{better} and {worse} (seed {seed}) were judged on "
                                         f"different {set_name} prompts")  # fmt: skip
                    values = values - other
                if ids is None:
                    ids = seed_ids
                elif not np.array_equal(ids, seed_ids):
                    raise ValueError(f"{better}: the seeds of world {world} were judged on "
                                     f"different {set_name} prompts")  # fmt: skip
                rows.append(values)
            blocks.append((world, np.vstack(rows)))
        if not blocks:
            raise KeyError(f"{better} and {worse} share no seed")
        return blocks

    def _pair_values(self, model: str, seed: int, weights: np.ndarray) -> dict:
        """``pair_metrics_of`` one model-seed's pairs under ``weights``: every seed of the
        model's world in one matrix product per weight matrix (cached: the resample counts are
        one cached matrix, and one product over all seeds reads it once, not per seed)."""
        world = self.world(seed)
        key = (model, world, id(weights))
        if key not in self._products:
            members = sorted(s for s in self.pairs[model] if self.world(s) == world)
            for s in members:
                if (model, s) not in self._columns:
                    self._columns[model, s] = pair_columns(self.pairs[model][s])
            columns = [self._columns[model, s] for s in members]
            width = columns[0].shape[1]
            products = weights @ np.hstack(columns)
            total = weights.sum(axis=1)
            values = {
                s: pair_metrics_of(products[:, i * width : (i + 1) * width], total)
                for i, s in enumerate(members)
            }
            self._products[key] = (weights, values)  # holds weights: its id stays its own
        return self._products[key][1][seed]

    def pair_metric(self, better: str, worse: str | None, metric: str,
                    lower_is_better: bool = False) -> Comparison:  # fmt: skip
        """Model ``better``'s Table 1 metric minus model ``worse``'s (None: minus 0), negated
        where lower is better, on the seeds both have: pairs x seeds, one pair draw shared by
        both models and every seed of a world in each resample (ValueError where the seeds of
        a world scored different pairs)."""
        sign = -1.0 if lower_is_better else 1.0
        seeds = set(self.pairs[better])
        if worse is not None:
            seeds &= set(self.pairs[worse])
        blocks = []
        for world in sorted({self.world(s) for s in seeds}):
            members = sorted(s for s in seeds if self.world(s) == world)
            truth = np.array([p["p_true"] for p in self.pairs[better][members[0]]])
            for model in (better, worse):
                for seed in members if model is not None else ():
                    other = np.array([p["p_true"] for p in self.pairs[model][seed]])
                    if other.shape != truth.shape or not np.array_equal(other, truth):
                        raise ValueError(f"{model} seed {seed} scored other pairs than "
                                         f"{better} seed {members[0]} (world {world})")  # fmt: skip

            def per_seed(w, members=members):
                rows = []
                for seed in members:
                    value = self._pair_values(better, seed, w)[metric]
                    if worse is not None:
                        value = value - self._pair_values(worse, seed, w)[metric]
                    rows.append(sign * value)
                return np.vstack(rows)

            blocks.append((world, len(truth), per_seed))
        if not blocks:
            raise KeyError(f"{better} and {worse} share no seed")
        return Comparison(blocks=tuple(blocks), worlds=len(blocks))

    def seeds(self, better, worse=None) -> Comparison:
        """``seed_values[better]`` minus ``seed_values[worse]`` (None: minus 0) per seed, on the
        seeds both have: a comparison that resamples seeds only."""
        b = self.seed_values[better]
        w = self.seed_values[worse] if worse is not None else dict.fromkeys(b, 0.0)
        common = sorted(set(b) & set(w))
        if not common:
            raise KeyError(f"{better} and {worse} share no seed")
        worlds = len({self.world(s) for s in common})
        return Comparison(per_seed=tuple(b[s] - w[s] for s in common), worlds=worlds)


# ---------------------------------------------------------------- hacking, KL

CURVE_ARM = re.compile(r"(rm|am)_ppo_step(\d+)")
"""The hacking curve arms: ``<reward>_ppo_step<N>``, one run per reward and seed judged at each
checkpoint N (the preset's ``curve_steps``: 5, 10, 20, 40 in the full study)."""


def curve_steps(judgments: dict) -> dict[str, list[int]]:
    """``{reward: [checkpoints]}`` of the curve arms these judgments have."""
    out: dict = {}
    for arm in judgments:
        match = CURVE_ARM.fullmatch(arm)
        if match:
            out.setdefault(match[1], []).append(int(match[2]))
    return {reward: sorted(steps) for reward, steps in sorted(out.items())}


def hacking_points(judgments: dict, evidence: Evidence | None = None) -> dict:
    """``{reward: {seed: {step: gains of the main set}}}`` of the curve arms present."""
    evidence = evidence or Evidence({}, judgments)
    out: dict = {}
    for reward, steps in curve_steps(judgments).items():
        for step in steps:
            for seed in judgments[f"{reward}_ppo_step{step}"]:
                points = out.setdefault(reward, {}).setdefault(seed, {})
                points[step] = evidence.values(f"{reward}_ppo_step{step}", seed, "main")
    return out


def hacking_slope(train: list[float], gold: list[float]) -> float:
    """Least-squares slope through the origin of gold on training gains: Σ x y / Σ x² (gold
    gained per unit of training reward gained; the curve starts at (0, 0), the SFT policy)."""
    x, y = np.asarray(train, float), np.asarray(gold, float)
    return float(x @ y / max(float(x @ x), 1e-12))


def training_kl(rows: list[dict] | None, step: int | None = None, last: int = 5) -> float | None:
    """The KL to SFT in PPO's metrics: at ``step`` (the last record at or before it) or, with
    ``step`` None, the mean over the ``last`` records. Records whose ``kl`` is None (a run
    without a KL term: rejection sampling) are skipped; None where none is left."""
    rows = sorted((r for r in rows or () if r.get("kl") is not None), key=lambda r: r["step"])
    if step is not None:
        rows = [r for r in rows if r["step"] <= step][-1:]
    else:
        rows = rows[-last:]
    return float(np.mean([r["kl"] for r in rows])) if rows else None


def hacking_curves(points: dict, training: dict) -> dict:
    """``{reward: {step: {gold_gain_z, train_gain_z[, kl]: summary}}}`` on the main set; step 0
    is the SFT policy (0, 0). The KL is the training record's at that step (the last at or
    before it), of the step's arm or else of the last checkpoint's arm."""
    out = {}
    for reward, by_seed in points.items():
        seeds = sorted(by_seed)
        steps = sorted({step for points_of in by_seed.values() for step in points_of})
        curve = {"0": {"gold_gain_z": summary([0.0] * len(seeds)),
                       "train_gain_z": summary([0.0] * len(seeds))}}  # fmt: skip
        for step in steps:
            have = [s for s in seeds if step in by_seed[s]]
            if not have:
                continue
            cell = {key: summary([by_seed[s][step][key] for s in have])
                    for key in ("gold_gain_z", "train_gain_z")}  # fmt: skip
            kls = []
            for seed in have:
                rows = (training.get(f"{reward}_ppo_step{step}") or {}).get(seed) or (
                    training.get(f"{reward}_ppo_step{steps[-1]}") or {}
                ).get(seed)
                kls.append(training_kl(rows, step))
            if kls and all(k is not None for k in kls):
                cell["kl"] = summary(kls)
            curve[str(step)] = cell
        out[reward] = curve
    return out


def hacking_slopes(points: dict) -> dict[str, dict[int, float]]:
    """``{reward: {seed: slope}}`` through every checkpoint, over the seeds that have them all."""
    out = {}
    for reward, by_seed in points.items():
        steps = sorted({step for points_of in by_seed.values() for step in points_of})
        out[reward] = {
            seed: hacking_slope([have[s]["train_gain_z"] for s in steps],
                                [have[s]["gold_gain_z"] for s in steps])
            for seed, have in sorted(by_seed.items()) if set(steps) <= set(have)
        }  # fmt: skip
    return out


def kl_to_sft(training: dict) -> dict:
    """``{arm: summary}`` of the mean KL to SFT over the last 5 training steps, per arm with
    training records that log a KL (how well ``am_ppo_kl`` matched ``am_ppo_sr_g0.1``); an
    arm with none (rejection sampling: every ``kl`` None, or no rows) has no entry."""
    out = {}
    for arm, by_seed in sorted((training or {}).items()):
        values = [training_kl(rows) for _, rows in sorted((by_seed or {}).items())]
        values = [v for v in values if v is not None]
        if values:
            out[arm] = summary(values)
    return out


def crossed_cells(evidence: Evidence, cells: list[tuple[str, str]]) -> dict:
    """``{(arm, set): {se_crossed, ci_low_crossed, ci_high_crossed}}``: the Table 2 cells'
    held-out-aware intervals of the net win (the seeds' variance plus the prompts', resampled
    within worlds; one batched product per world and set size, ``crossed_linear_many``)."""
    draws = crossed_linear_many({cell: evidence.matrices(cell[0], None, cell[1]) for cell in cells})
    out = {}
    for cell, bootstrap in draws.items():
        interval = crossed_interval([], bootstrap=bootstrap)
        out[cell] = {"se_crossed": interval["se"], "ci_low_crossed": interval["ci_low"],
                     "ci_high_crossed": interval["ci_high"]}  # fmt: skip
    return out


INTERVALS = {
    "claims": "each claim's verdict: se^2 = the seeds' variance (sd of the per-seed values, "
    "every world's seeds, squared, over seeds) + the held-out items' (the variance of the "
    "estimate with each world's judged prompts or scored pairs resampled with replacement, the "
    "seeds fixed, the worlds as strata); a claim's row gives both terms (se_seeds, se_items) "
    "and says what it resamples ('seeds' where the items cannot be resampled)",
    "rule": "estimate: the mean over seeds of the per-seed values; p: two-sided t with seeds - 1 "
    "df on (estimate + margin) / se; 95 % interval: estimate ± t(0.975, seeds - 1) · se; Holm "
    "within each family. p_seeds_only / ci_seeds_only: the paired t-test over seeds alone, for "
    "comparison (never narrower than it: se >= se_seeds)",
    "table1": "claims on pairs: one pair draw shared by both models and every seed of a world "
    "per resample, ECE bins fixed from the full set",
    "table2": "ci_low / ci_high: t-interval over seeds; ci_low_crossed / ci_high_crossed: "
    "the held-out-aware interval (seeds plus prompts)",
    "worlds": "strata: the intervals cover another draw of seeds and held-out items in these "
    "worlds, and the worlds' differences as far as the per-seed values show them; not a "
    "world-level random effect (three worlds cannot estimate one)",
}


def results_from_records(pairs: dict[str, dict[int, list[dict]]],
                         judgments: dict[str, dict[int, list[dict]]],
                         rehearsal: dict[str, dict[int, list[dict]]] | None = None,
                         training: dict[str, dict[int, list[dict]]] | None = None,
                         worlds: dict[int, int] | None = None) -> dict:  # fmt: skip
    """``results.json`` from ``pairs[model][seed]``, ``judgments[arm][seed]``,
    ``rehearsal[set][seed]`` records (each D_R's; ``rehearsal`` in results.json),
    ``training[arm][seed]`` (PPO's per-step metrics ``{step, kl, reward}``, ``kl`` None where
    the run has no KL term; None or empty for archives without them) and ``worlds``
    ({seed: world}; None: one world).

    table1 holds the two scorers of the paper's Table 1 (``rm``, ``am``); every other scorer
    (over-trained, margin sweep) is in ``reward_models`` with the same layout, and Fig. 4's
    per-task statistics in ``per_task``. table2 holds every arm. ``hacking_curves``: gold and
    training-reward gains (and KL) of the curve arms per checkpoint; ``kl_to_sft``: each arm's
    final KL. ``claims``: one row per claim of ``study/claims.py`` (estimate, interval, raw and
    Holm p, verdict, seeds needed); ``intervals`` says how they were computed.
    """
    from megatron_rlhf.study.claims import evaluate_claims
    from megatron_rlhf.study.presets import TABLE1_MARGINS

    training = {arm: by_seed for arm, by_seed in (training or {}).items() if by_seed}
    evidence = Evidence(pairs, judgments, worlds)
    points = hacking_points(judgments, evidence)
    slopes = hacking_slopes(points)
    evidence.seed_values.update({("hacking_slope", r): v for r, v in slopes.items()})
    reward_models = {model: table1_row(by_seed) for model, by_seed in pairs.items()}
    first = next(iter(pairs.values()))
    test_pairs = first[min(first)]  # world of the first seed (the same for every model, seed)
    cells = [(arm, set_name) for arm in judgments for set_name in evidence.sets(arm)]
    crossed = crossed_cells(evidence, cells)
    table2 = {arm: {} for arm in judgments}
    for arm, set_name in cells:
        cell = table2_cell(judgments[arm], set_name, evidence, arm)
        table2[arm][set_name] = {**cell, **crossed[arm, set_name]}
    results = {
        "table1": {model: reward_models[model] for model in ("rm", "am") if model in pairs},
        "table2": table2,
        "reward_models": reward_models,
        "reward_bootstrap": {model: table1_bootstrap(by_seed) for model, by_seed in pairs.items()},
        "per_task": {model: per_task_table(by_seed) for model, by_seed in pairs.items()},
        "oracle_accuracy": summary(
            [oracle_accuracy(p) for _, p in sorted(next(iter(pairs.values())).items())]
        ),
        "arms": {arm: arm_extras(by_seed, evidence, arm) for arm, by_seed in judgments.items()},
        "ece_noise_floor": calibrated_ece(test_pairs),
        "am_confidence_cap": {
            f"{m:g}": {"cap": confidence_cap(m), "pairs_above": share_above_cap(test_pairs, m)}
            for m in TABLE1_MARGINS
        },
        "max_confidence": {
            model: summary([max_confidence(by_seed[s]) for s in sorted(by_seed)])
            for model, by_seed in pairs.items()
        },
        "hacking_curves": hacking_curves(points, training),
        "hacking_slopes": {reward: summary(list(v.values())) for reward, v in slopes.items() if v},
        "kl_to_sft": kl_to_sft(training),
        "worlds": len({(worlds or {}).get(s, 0) for by_seed in pairs.values() for s in by_seed}),
        "intervals": {**INTERVALS, "resamples": RESAMPLES, "numpy_seed": BOOTSTRAP_SEED},
    }
    results["rehearsal"] = rehearsal_table(rehearsal or {})
    results["claims"] = evaluate_claims(evidence, list(judgments))
    return results


def max_confidence(pairs: list[dict]) -> float:
    """The scorer's highest confidence σ(|s_c - s_r|) on these pairs."""
    gap = max(abs(p["chosen_score"] - p["rejected_score"]) for p in pairs)
    return 1.0 / (1.0 + math.exp(-gap))
