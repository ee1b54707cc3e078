"""The study's held-out-aware intervals (``study/intervals.py``) and the claims v5 machinery
(``study/stats.py``, ``study/claims.py``), each against an independent reference on fresh
random inputs: a slow explicit-resampling loop, the analytic crossed variance, metrics on
explicitly duplicated pairs, ``np.linalg.lstsq``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rlhf.study import claims, intervals, stats, world


def _items_se_loop(matrices: dict[int, np.ndarray], draws: int, seed: int) -> float:
    """The items' term written out: per resample and world, draw the items with replacement
    (every seed keeps its row), take each seed's mean over the drawn items, pool every world's
    seeds."""
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(draws):
        per_seed = []
        for d in matrices.values():
            cols = rng.integers(0, d.shape[1], d.shape[1])
            per_seed.extend(d[:, cols].mean(axis=1))
        values.append(np.mean(per_seed))
    return float(np.std(values, ddof=1))


def test_held_out_aware_se_is_the_seeds_term_plus_the_items_term():
    rng = np.random.default_rng(0)
    d = rng.normal(0, 1, (6, 25)) + rng.normal(0, 0.7, (6, 1)) + rng.normal(0, 1.3, (1, 25))
    # identity resample: the per-seed statistic at unit weights is each seed's mean
    world, items, per_seed = intervals.linear_block(0, d)
    assert per_seed(np.ones((1, 25)))[:, 0] == pytest.approx(d.mean(axis=1))
    estimate, draws, values = intervals.crossed_bootstrap([intervals.linear_block(0, d)])
    assert estimate == pytest.approx(d.mean()) and values == pytest.approx(d.mean(axis=1))
    assert draws.shape == (intervals.RESAMPLES,)
    se_items = float(np.std(draws, ddof=1))
    assert se_items == pytest.approx(_items_se_loop({0: d}, 4000, seed=1), rel=0.08)
    # analytic: the items' term is the variance of the seed-averaged item values over P items
    s, p = d.shape
    assert se_items**2 == pytest.approx(np.var(d.mean(axis=0)) / p, rel=0.15)
    interval = intervals.crossed_interval([intervals.linear_block(0, d)])
    se_seeds = float(np.std(d.mean(axis=1), ddof=1)) / np.sqrt(s)
    assert interval["se_seeds"] == pytest.approx(se_seeds)
    assert interval["se_items"] == pytest.approx(se_items)
    assert interval["se"] == pytest.approx(np.hypot(se_seeds, se_items))


def test_the_interval_is_never_narrower_than_the_seeds_only_test():
    """The first crossed bootstrap (seeds resampled within fixed world strata) was narrower
    than the seeds-only t-test on most development claims: it dropped the worlds' differences
    and (n - 1) / n of the seeds' variance. Here: worlds that differ a lot, two seeds each,
    items that barely matter; the se is at least the seeds-only se, and their p agree."""
    rng = np.random.default_rng(11)
    blocks = [intervals.linear_block(w, rng.normal(3.0 * w, 1.0, (2, 1)) + rng.normal(0, 0.01, (2, 30)))
              for w in range(3)]  # fmt: skip
    interval = intervals.crossed_interval(blocks)
    per_seed = np.concatenate([fn(np.ones((1, n)))[:, 0] for _, n, fn in blocks])
    seeds_only = claims.paired_test(list(per_seed))
    assert interval["se"] >= seeds_only["sd"] / np.sqrt(6)
    assert interval["p"] == pytest.approx(seeds_only["p"], rel=0.05)


def test_items_that_dominate_the_noise_widen_the_interval_beyond_the_seeds_only_test():
    rng = np.random.default_rng(3)
    item_effects = rng.normal(0, 3.0, (1, 40))  # shared by every seed: the held-out draw
    d = 1.0 + item_effects + rng.normal(0, 0.3, (10, 40))
    crossed = intervals.crossed_interval([intervals.linear_block(0, d)])
    seeds_only = claims.paired_test(list(d.mean(axis=1)))
    assert crossed["ci_high"] - crossed["ci_low"] > 3 * (
        seeds_only["ci_high"] - seeds_only["ci_low"]
    )
    assert crossed["p"] > seeds_only["p"]
    # the rule: t with seeds - 1 df on estimate / se
    from scipy import stats as sp

    t = crossed["estimate"] / crossed["se"]
    assert crossed["p"] == pytest.approx(2 * sp.t.sf(abs(t), 9))
    half = sp.t.ppf(0.975, 9) * crossed["se"]
    assert crossed["ci_low"] == pytest.approx(crossed["estimate"] - half)


def test_world_strata_never_mix_items_and_each_world_is_resampled_on_its_own():
    rng = np.random.default_rng(4)
    worlds = {0: rng.normal(0, 1, (4, 7)) + 5.0, 1: rng.normal(0, 1, (3, 19)) - 5.0}
    blocks = [intervals.linear_block(w, d) for w, d in worlds.items()]
    estimate, draws, values = intervals.crossed_bootstrap(blocks)
    assert len(values) == 7
    assert estimate == pytest.approx(
        np.concatenate([d.mean(axis=1) for d in worlds.values()]).mean()
    )
    # items of world 0 (around +5) mixed into world 1 (around -5) would spread the draws far
    # wider; within strata each world keeps its seeds, so the means stay near the estimate
    slow = _items_se_loop(worlds, 3000, seed=5)
    assert float(np.std(draws, ddof=1)) == pytest.approx(slow, rel=0.1)
    assert np.abs(draws - estimate).max() < 1.5
    # the counts of each world's strata: one row per resample, each summing to its size
    for rows in (7, 19, 4, 3):
        counts = intervals.resample_counts(rows, 0, intervals.ITEMS)
        assert counts.shape == (intervals.RESAMPLES, rows)
        assert (counts.sum(axis=1) == rows).all()
    assert not np.array_equal(
        intervals.resample_counts(7, 0, intervals.ITEMS),
        intervals.resample_counts(7, 1, intervals.ITEMS),
    )


def test_batched_crossed_bootstrap_equals_one_at_a_time():
    rng = np.random.default_rng(10)
    cells = {
        "a": [(0, rng.normal(0, 1, (3, 11))), (1, rng.normal(0, 1, (2, 8)))],
        "b": [(0, rng.normal(1, 1, (4, 11)))],
        "c": [(1, rng.normal(0, 2, (2, 5)))],
    }
    batched = intervals.crossed_linear_many(cells)
    for key, blocks in cells.items():
        one = intervals.crossed_bootstrap([intervals.linear_block(w, d) for w, d in blocks])
        assert batched[key][0] == pytest.approx(one[0], rel=1e-12)
        assert batched[key][1] == pytest.approx(one[1], rel=1e-9, abs=1e-12)
        assert batched[key][2] == pytest.approx(one[2], rel=1e-12)


def _pairs(n: int, rng) -> list[dict]:
    truth = rng.random(n)
    return [{"chosen_score": float(rng.normal(0.5, 1.5)), "rejected_score": 0.0,
             "p_true": float(t), "task": "qa"} for t in truth]  # fmt: skip


def test_weighted_pair_metrics_equal_the_unweighted_and_the_duplicated_pairs():
    rng = np.random.default_rng(6)
    pairs = _pairs(150, rng)
    pairs[3]["rejected_score"] = pairs[3]["chosen_score"]  # a tie counts 1/2 in the ECE
    weighted = stats.pair_metric_weighted(pairs)
    plain = stats.pair_metric_statistics(pairs)
    ones = np.ones((1, len(pairs)))
    for name, metric in stats.PAIR_METRICS.items():
        assert weighted[name](ones)[0] == pytest.approx(metric(pairs), rel=1e-9, abs=1e-12)
    counts = rng.integers(0, 4, (5, len(pairs))).astype(float)
    for row in counts:
        idx = np.repeat(np.arange(len(pairs)), row.astype(int))  # the pairs drawn that often
        for name, statistic in plain.items():
            assert weighted[name](row[None, :])[0] == pytest.approx(statistic(idx), rel=1e-9)
        dup = [pairs[i] for i in idx]
        for name in ("accuracy", "brier", "overconfidence"):
            assert weighted[name](row[None, :])[0] == pytest.approx(
                stats.PAIR_METRICS[name](dup), rel=1e-9
            )


def test_table1_bootstrap_equals_the_per_resample_loop():
    rng = np.random.default_rng(12)
    pairs = {seed: _pairs(80, rng) for seed in (3, 4)}
    fast = stats.table1_bootstrap(pairs)
    for k, seed in enumerate(sorted(pairs)):
        for name, statistic in stats.pair_metric_statistics(pairs[seed]).items():
            slow = stats.bootstrap_interval(np.arange(80), statistic, seed)
            assert fast[name][k] == pytest.approx(list(slow), rel=1e-9, abs=1e-12)


def test_pair_claims_share_one_pair_draw_across_models_and_seeds():
    rng = np.random.default_rng(7)
    base = _pairs(60, rng)
    pairs = {
        model: {
            seed: [{**p, "chosen_score": p["chosen_score"] * scale + rng.normal(0, 0.1)}
                   for p in base]
            for seed in range(5)
        }
        for model, scale in (("rm", 2.0), ("am", 0.7))
    }  # fmt: skip
    ev = stats.Evidence(pairs, {})
    comparison = ev.pair_metric("am", "rm", "brier", lower_is_better=True)
    diffs = comparison.differences()
    expected = [stats.brier(pairs["rm"][s]) - stats.brier(pairs["am"][s]) for s in range(5)]
    assert diffs == pytest.approx(expected)
    _, draws, _ = intervals.crossed_bootstrap(list(comparison.blocks))
    # the reference: one pair draw for both models and all seeds
    w = intervals.resample_counts(60, 0, intervals.ITEMS)
    for b in (0, 17, 1999):
        idx = np.repeat(np.arange(60), w[b].astype(int))
        per_seed = [stats.brier([pairs["rm"][s][i] for i in idx])
                    - stats.brier([pairs["am"][s][i] for i in idx]) for s in range(5)]  # fmt: skip
        assert draws[b] == pytest.approx(np.mean(per_seed))
    other = {**pairs, "am": {**pairs["am"], 2: _pairs(60, rng)}}
    with pytest.raises(ValueError, match="other pairs"):
        stats.Evidence(other, {}).pair_metric("am", "rm", "ece", lower_is_better=True)


def test_hacking_slope_is_least_squares_through_the_origin():
    rng = np.random.default_rng(8)
    x, y = rng.normal(1, 1, 4), rng.normal(0.5, 1, 4)
    expected = np.linalg.lstsq(x[:, None], y, rcond=None)[0][0]
    assert stats.hacking_slope(list(x), list(y)) == pytest.approx(expected)


# ---------------------------------------------------------------- results_from_records


def _judgment(rng, record_set: str, prompt_id: int, task: str, lift: float) -> dict:
    flags = {}
    for who, p in (("policy", 0.5 + lift), ("sft", 0.5)):
        for feature in ("form", "topic", "in_band", "because"):
            flags[f"{feature}_{who}"] = bool(rng.random() < min(max(p, 0.05), 0.95))
        flags[f"truncated_{who}"] = False
    gold_sft, gold_policy = rng.normal(0, 1), rng.normal(lift, 1)
    outcome = rng.choice(["win", "tie", "lose"], p=[0.4 + lift / 4, 0.2, 0.4 - lift / 4])
    return {"set": record_set, "prompt_id": prompt_id, "task": task, "gold_sft": gold_sft,
            "gold_policy": gold_policy, "outcome": str(outcome),
            "train_sft": rng.normal(0, 1), "train_policy": rng.normal(2 * lift, 1), **flags}  # fmt: skip


ARMS = {"rm_ppo": 0.0, "rm_ppo_ma": 0.05, "am_ppo": 0.1, "am_ppo_sr": 0.15, "am_ppo_rr": 0.1,
        "am_ppo_sr_gold": 0.2, "null": 0.0, "am_ppo_sr_g0.1": 0.2, "am_ppo_kl": 0.1}  # fmt: skip
CURVE = {f"{reward}_ppo_step{step}": step / 100 for reward in ("rm", "am")
         for step in (5, 10, 20, 40)}  # fmt: skip


def _records(worlds: dict[int, list[int]], prompts: dict[int, int]):
    """A small study: per world its own pairs and prompts (``prompts[world]`` per family and
    set), every arm on every seed but the gamma 0.1 arms on the first seed of each world."""
    rng = np.random.default_rng(9)
    tasks = {"main": list(world.PREFERENCE_TASKS),
             "forget": [*world.PREFERENCE_TASKS, *stats.minor_tasks()]}  # fmt: skip
    seed_world = {s: w for w, seeds in worlds.items() for s in seeds}
    base = {w: _pairs(30 + 10 * w, rng) for w in worlds}
    pairs = {model: {s: [{**p, "chosen_score": p["chosen_score"] * scale + rng.normal(0, 0.2)}
                         for p in base[seed_world[s]]] for s in seed_world}
             for model, scale in (("rm", 2.0), ("am", 0.8))}  # fmt: skip
    judgments, training = {}, {}
    for arm, lift in {**ARMS, **CURVE}.items():
        seeds = [min(s) for s in worlds.values()] if "g0.1" in arm or "kl" in arm else seed_world
        judgments[arm] = {}
        for s in sorted(seeds):
            n = prompts[seed_world[s]]
            records = [
                _judgment(rng, record_set, i * len(tasks[record_set]) + k, task, lift)
                for record_set in ("main", "forget")
                for i in range(n)
                for k, task in enumerate(tasks[record_set])
            ]
            rng.shuffle(records)  # prompt order is restored by prompt_id
            judgments[arm][s] = records
        training[arm] = {s: [{"step": t, "kl": lift * t, "reward": 0.0} for t in range(40)]
                         for s in seeds}  # fmt: skip
    return pairs, judgments, training, seed_world


def _old_format(j: dict) -> dict:
    """The record as the 15-seed published run wrote it: no form / topic / band fields, a gold
    reward that is exactly offset + scale x (form + topic + band / 2 + w x because)."""
    spec = world.TASK_SPECS[j["task"]]
    out = {k: v for k, v in j.items() if not k.startswith(("form_", "topic_", "in_band_"))}
    for who in ("policy", "sft"):
        utility = (world.FORM_WEIGHT * j[f"form_{who}"] + world.TOPIC_WEIGHT * j[f"topic_{who}"]
                   + world.BAND_WEIGHT * j[f"in_band_{who}"]
                   + spec.because_weight * j[f"because_{who}"])  # fmt: skip
        out[f"gold_{who}"] = spec.offset + spec.scale * utility
    return out


def test_vectorised_arm_values_equal_the_list_functions():
    _, judgments, _, _ = _records({0: [0]}, {0: 4})
    rows = judgments["rm_ppo"][0]
    for records in (rows, [_old_format(j) for j in rows]):
        table = stats.judgment_table(records)
        for set_name in stats.set_names():
            mask = stats.set_mask(set_name, table["set"], table["task"])
            expected = stats.arm_values(stats._of_set(records, set_name))
            got = stats.table_values(table, mask)
            assert list(got) == list(expected)
            assert got == pytest.approx(expected, rel=1e-12, abs=1e-12), set_name
    assert "utility_skill" in stats.table_values(stats.judgment_table(rows), table["set"] != "")


def test_results_from_records_gives_every_claim_a_crossed_interval_deterministically():
    pairs, judgments, training, seed_world = _records({0: [0, 1, 2], 1: [5, 6]}, {0: 3, 1: 5})
    results = stats.results_from_records(pairs, judgments, None, training, seed_world)
    again = stats.results_from_records(pairs, judgments, None, training, seed_world)
    assert json.dumps(results, sort_keys=True) == json.dumps(again, sort_keys=True)
    rows = {r["name"]: r for r in results["claims"]}
    families = {r["family"] for r in rows.values()}
    assert families == {"paper", "minor_split", "transfer", "rehearsal", "attribution",
                        "exploratory"}  # fmt: skip
    for row in rows.values():
        assert {"se", "worlds", "resamples", "p_seeds_only", "ci_seeds_only", "p_holm",
                "verdict", "seeds_needed"} <= set(row)  # fmt: skip
        assert row["worlds"] == 2 and row["se"] > 0
        assert row["ci_low"] < row["estimate"] < row["ci_high"]
        if row["name"] == "rm_ppo_hacks_more":
            assert row["resamples"] == "seeds"
        else:
            assert row["resamples"] == "seeds and held-out items (within worlds)"
    assert rows["sr_g0.1_helps_minor"]["seeds"] == 2 and rows["sr_helps_minor"]["seeds"] == 5
    assert "am_ppo_strat_g0.1" not in judgments and "strat_g0.1_beats_sr_g0.1" not in rows
    # the estimate is the mean over seeds of the per-seed net-win differences of table2
    net = results["table2"]
    for name, (better, worse, set_name) in {
        "am_ppo_beats_rm_ppo_main": ("am_ppo", "rm_ppo", "main"),
        "sr_helps_minor": ("am_ppo_sr", "am_ppo", "minor"),
        "am_ppo_beats_rm_ppo_transfer": ("am_ppo", "rm_ppo", "transfer"),
    }.items():
        diffs = np.subtract(net[better][set_name]["per_seed"], net[worse][set_name]["per_seed"])
        assert rows[name]["estimate"] == pytest.approx(diffs.mean())
        assert rows[name]["p_seeds_only"] == pytest.approx(claims.paired_test(diffs)["p"])
    sft_wins = -np.mean(net["rm_ppo"]["minor"]["per_seed"])
    assert rows["rm_ppo_loses_minor"]["estimate"] == pytest.approx(sft_wins)
    skill = results["arms"]["rm_ppo"]["minor"]["utility_skill"]["per_seed"]
    assert rows["rm_ppo_loses_skill"]["estimate"] == pytest.approx(-np.mean(skill))
    # Holm within each family on the crossed p-values
    for family in families:
        members = [r for r in results["claims"] if r["family"] == family]
        assert [r["p_holm"] for r in members] == pytest.approx(
            claims.holm([r["p"] for r in members])
        )
    # sets, the crossed Table 2 interval, hacking curves, KL, the intervals note
    assert set(net["am_ppo"]) == {"main", "forget", "transfer", "minor",
                                  *(f"minor_{t}" for t in stats.minor_tasks())}  # fmt: skip
    cell = net["am_ppo"]["minor"]
    assert cell["ci_low_crossed"] < cell["net_win"] < cell["ci_high_crossed"]
    curve = results["hacking_curves"]["rm"]
    assert list(curve) == ["0", "5", "10", "20", "40"]
    assert curve["40"]["kl"]["mean"] == pytest.approx(0.4 * 39)  # the last step before 40
    slopes = results["hacking_slopes"]["am"]["per_seed"]
    points = stats.hacking_points(judgments)["am"][0]
    x = [points[s]["train_gain_z"] for s in (5, 10, 20, 40)]
    y = [points[s]["gold_gain_z"] for s in (5, 10, 20, 40)]
    assert slopes[0] == pytest.approx(np.linalg.lstsq(np.array(x)[:, None], y, rcond=None)[0][0])
    assert results["kl_to_sft"]["am_ppo_kl"]["mean"] == pytest.approx(0.1 * 37)
    assert results["intervals"]["resamples"] == intervals.RESAMPLES
    assert results["worlds"] == 2


def test_one_seed_one_world_gives_direction_only_verdicts():
    pairs, judgments, _, _ = _records({0: [0]}, {0: 2})
    results = stats.results_from_records(pairs, judgments)
    assert results["claims"] and all(
        r["verdict"].startswith("direction only (1 seed)") and r["p"] is None
        for r in results["claims"]
    )
    assert results["kl_to_sft"] == {} and results["table2"]["am_ppo"]["main"]["ci_low"] is None


def test_training_rows_without_a_kl_give_no_kl_not_a_crash_or_a_zero(tmp_path):
    """``training_curve`` keeps every step's row, ``kl`` None where the run logs no KL
    (rejection sampling has no KL term); ``training_kl`` skips those rows and a run with none
    gives None, so ``kl_to_sft`` has no entry for it: the same as the empty curves of runs
    recorded before rows without a KL were kept."""
    from megatron_rlhf.study import stages
    from megatron_rlhf.utils import write_jsonl

    write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": 1, "reward/mean": 0.5, "kl/coef": 0.1},
        {"step": 2, "reward/mean": 0.7, "kl/coef": 0.1},
    ])  # fmt: skip
    curve = stages.training_curve(tmp_path)
    assert curve == [{"step": 1, "kl": None, "reward": 0.5},
                     {"step": 2, "kl": None, "reward": 0.7}]  # fmt: skip
    assert stats.training_kl(curve) is None and stats.training_kl(curve, step=2) is None
    mixed = [*curve, {"step": 3, "kl": 0.25, "reward": 0.1}, {"step": 4, "kl": None, "reward": 0}]
    assert stats.training_kl(mixed) == 0.25 and stats.training_kl(mixed, step=4) == 0.25
    assert stats.training_kl(mixed, step=2) is None
    ppo = [{"step": t, "kl": 0.1 * t, "reward": 0.0} for t in range(1, 6)]
    by_arm = {"am_ppo": {0: ppo, 1: ppo}, "rejection_sampling": {0: curve, 1: curve}}
    old = {"am_ppo": {0: ppo, 1: ppo}, "rejection_sampling": {0: [], 1: []}}
    assert stats.kl_to_sft(by_arm) == stats.kl_to_sft(old)
    assert set(stats.kl_to_sft(by_arm)) == {"am_ppo"}
    assert stats.kl_to_sft(by_arm)["am_ppo"]["mean"] == pytest.approx(0.3)


def test_misaligned_prompts_within_a_world_are_an_error():
    pairs, judgments, _, seed_world = _records({0: [0, 1]}, {0: 2})
    judgments["am_ppo"][1] = [{**j, "prompt_id": j["prompt_id"] + 1000}
                              for j in judgments["am_ppo"][1]]  # fmt: skip
    with pytest.raises(ValueError, match="different"):
        stats.Evidence(pairs, judgments, seed_world).items("am_ppo", "rm_ppo", "main")
