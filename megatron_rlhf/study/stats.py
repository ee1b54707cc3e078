"""The study's numbers as pure functions of its raw records (no I/O, no models).

``results_from_records`` turns the per-seed pair records (``reward/<model>/seed<S>/pairs.jsonl``)
and judgment records (``ppo/<arm>/seed<S>/judgments.jsonl``) into ``results.json``; a test
recomputes it from the files. Intervals are 95 %: across seeds a Student-t interval on the
per-seed values (``ci_low``/``ci_high``; absent with one seed), within a seed a percentile
bootstrap over pairs or prompts (``bootstrap``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import numpy as np

from megatron_rlhf.reward.calibration import (
    expected_calibration_error,
    per_task_stats,
    ranking_accuracy,
)
from megatron_rlhf.study.intervals import t_interval

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


def table1_bootstrap(pairs_by_seed: dict[int, list[dict]]) -> dict:
    """Within-seed bootstrap intervals: ``{metric: [[low, high] per seed]}``."""
    out = {name: [] for name in PAIR_METRICS}
    for seed in sorted(pairs_by_seed):
        pairs = pairs_by_seed[seed]
        for name, statistic in pair_metric_statistics(pairs).items():
            out[name].append(list(bootstrap_interval(np.arange(len(pairs)), statistic, seed)))
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


def table2_cell(judgments_by_seed: dict[int, list[dict]], set_name: str) -> dict:
    """``{win, tie, lose, net_win, ci_low, ci_high, per_seed}``: rates are seed means; the
    interval and ``per_seed`` are of the net win."""
    seeds = sorted(judgments_by_seed)
    rates = [outcome_rates(_of_set(judgments_by_seed[s], set_name)) for s in seeds]
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
    out = {"gold_gain": float(gold[:, 0].mean() - gold[:, 1].mean()),
           "train_gain": float(train[:, 0].mean() - train[:, 1].mean())}  # fmt: skip
    tasks = sorted({j.get("task", "all") for j in judgments})
    per_task = {}
    for task in tasks:
        rows = np.array([j.get("task", "all") == task for j in judgments])
        gold_z = _z_gain(gold[rows])
        train_z = _z_gain(train[rows])
        per_task[task] = {"gold_gain_z": gold_z, "train_gain_z": train_z,
                          "hacking": train_z - gold_z}  # fmt: skip
    for key in ("gold_gain_z", "train_gain_z"):
        out[key] = float(np.mean([row[key] for row in per_task.values()]))
    out["hacking_index"] = float(np.mean([row["hacking"] for row in per_task.values()]))
    if len(tasks) > 1:
        out.update({f"hacking_{task}": row["hacking"] for task, row in per_task.items()})
    if "because_policy" in judgments[0]:
        for task in tasks:
            rows = [j for j in judgments if j["task"] == task]
            out[f"because_{task}"] = 100.0 * float(
                np.mean([j["because_policy"] for j in rows])
                - np.mean([j["because_sft"] for j in rows])
            )
        for who in ("policy", "sft"):
            out[f"truncated_{who}"] = 100.0 * float(
                np.mean([j[f"truncated_{who}"] for j in judgments])
            )
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
    exact split into the parts of ``response_parts`` (they sum to it). ``net_win_<kind>``: the
    net win's points from the judgments in which only that part changed (``because``,
    ``band``, ``form_topic``) or several did (``mixed``); they sum to the net win (a judgment
    with no part changed is a tie)."""
    rows = [(response_parts(j, "policy"), response_parts(j, "sft"), j) for j in judgments]
    parts = [p for p in (*GOLD_PARTS, "form", "topic") if all(p in pol for pol, _, _ in rows)]
    out = {f"utility_{p}": float(np.mean([pol[p] - sft[p] for pol, sft, _ in rows]))
           for p in parts}  # fmt: skip
    out["utility_gain"] = sum(out[f"utility_{p}"] for p in GOLD_PARTS)
    net = dict.fromkeys((*GOLD_PARTS, "mixed"), 0.0)
    for policy, sft, judgment in rows:
        changed = [p for p in GOLD_PARTS if abs(policy[p] - sft[p]) > 1e-9]
        kind = changed[0] if len(changed) == 1 else "mixed"
        net[kind] += VERDICT_SIGN[judgment["outcome"]]
    out.update({f"net_win_{kind}": 100.0 * count / len(rows) for kind, count in net.items()})
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


def arm_extras(judgments_by_seed: dict[int, list[dict]]) -> dict:
    """Per set: ``arm_values`` summarised over seeds, and the within-seed bootstrap of the net
    win."""
    seeds = sorted(judgments_by_seed)
    out = {}
    for set_name in sets_of(judgments_by_seed):
        per_seed = [arm_values(_of_set(judgments_by_seed[s], set_name)) for s in seeds]
        keys = [key for key in per_seed[0] if all(key in g for g in per_seed)]
        out[set_name] = {key: summary([g[key] for g in per_seed]) for key in keys}
        out[set_name]["net_win_bootstrap"] = []
        for s in seeds:
            signs = np.array(
                [VERDICT_SIGN[j["outcome"]] for j in _of_set(judgments_by_seed[s], set_name)]
            )
            out[set_name]["net_win_bootstrap"].append(
                list(bootstrap_mean_percent_interval(signs, s))
            )
    return out


def _mean_percent(values: np.ndarray, idx: np.ndarray) -> float:
    return 100.0 * float(values[idx].mean())


SETS = ("main", "forget", "minor")
"""The judged sets: main, forget, and ``minor``: the forget set's prompts of the minor skill
(``world.MINOR_TASK``, the family PPO sees at 5 % and the reward models never saw)."""


def sets_of(judgments_by_seed: dict[int, list[dict]]) -> list[str]:
    """The ``SETS`` these judgments have (``minor`` only where the forget set holds the minor
    skill on every seed)."""
    from megatron_rlhf.study.world import MINOR_TASK

    def has_minor(rows: list[dict]) -> bool:
        return any(j["set"] == "forget" and j.get("task") == MINOR_TASK for j in rows)

    minor = all(has_minor(rows) for rows in judgments_by_seed.values())
    return [name for name in SETS if name != "minor" or minor]


def _of_set(judgments: list[dict], set_name: str) -> list[dict]:
    from megatron_rlhf.study.world import MINOR_TASK

    if set_name == "minor":
        rows = [j for j in judgments if j["set"] == "forget" and j["task"] == MINOR_TASK]
    else:
        rows = [j for j in judgments if j["set"] == set_name]
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


def results_from_records(pairs: dict[str, dict[int, list[dict]]],
                         judgments: dict[str, dict[int, list[dict]]],
                         rehearsal: dict[str, dict[int, list[dict]]] | None = None) -> dict:  # fmt: skip
    """``results.json`` from ``pairs[model][seed]``, ``judgments[arm][seed]`` and
    ``rehearsal[set][seed]`` records (each D_R's; ``rehearsal`` in results.json).

    table1 holds the two scorers of the paper's Table 1 (``rm``, ``am``); every other scorer
    (over-trained, margin sweep) is in ``reward_models`` with the same layout, and Fig. 4's
    per-task statistics in ``per_task``. table2 holds every arm. ``claims``: one row per
    claim of ``study/claims.py`` (estimate, interval, raw and Holm p, verdict, seeds needed).
    """
    from megatron_rlhf.study.claims import evaluate_claims
    from megatron_rlhf.study.presets import TABLE1_MARGINS

    reward_models = {model: table1_row(by_seed) for model, by_seed in pairs.items()}
    first = next(iter(pairs.values()))
    test_pairs = first[min(first)]  # the held-out pairs are the same for every model and seed
    results = {
        "table1": {model: reward_models[model] for model in ("rm", "am") if model in pairs},
        "table2": {
            arm: {set_name: table2_cell(by_seed, set_name) for set_name in sets_of(by_seed)}
            for arm, by_seed in judgments.items()
        },
        "reward_models": reward_models,
        "reward_bootstrap": {model: table1_bootstrap(by_seed) for model, by_seed in pairs.items()},
        "per_task": {model: per_task_table(by_seed) for model, by_seed in pairs.items()},
        "oracle_accuracy": summary(
            [oracle_accuracy(p) for _, p in sorted(next(iter(pairs.values())).items())]
        ),
        "arms": {arm: arm_extras(by_seed) for arm, by_seed in judgments.items()},
        "ece_noise_floor": calibrated_ece(test_pairs),
        "am_confidence_cap": {
            f"{m:g}": {"cap": confidence_cap(m), "pairs_above": share_above_cap(test_pairs, m)}
            for m in TABLE1_MARGINS
        },
        "max_confidence": {
            model: summary([max_confidence(by_seed[s]) for s in sorted(by_seed)])
            for model, by_seed in pairs.items()
        },
    }
    results["rehearsal"] = rehearsal_table(rehearsal or {})
    results["claims"] = evaluate_claims(results)
    return results


def max_confidence(pairs: list[dict]) -> float:
    """The scorer's highest confidence σ(|s_c - s_r|) on these pairs."""
    gap = max(abs(p["chosen_score"] - p["rejected_score"]) for p in pairs)
    return 1.0 / (1.0 + math.exp(-gap))
