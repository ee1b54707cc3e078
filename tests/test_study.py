"""The study: the text world's gold reward and labels, the aggregation math, and the quick run.

The quick run (slow) checks that ``study --preset quick --seeds 2 --ppo steps=4 --jobs 2``
writes every output the issue names (the D_R records included: ``check_rehearsal_sets``), that results.json is exactly what ``stats.results_from_records`` computes from the raw
records it wrote, and that every trained arm did something (``check_trained_arms``: a no-op
PPO or a rehearsal term that does nothing fails it) and the reward models learned from the labels
(``check_label_swap_retrains``: an RM trained on swapped labels ranks below chance).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from torchrun_util import REPO

from megatron_rlhf.study import stats, world


def test_world_prompts_are_disjoint_and_parsed_back():
    sets = world.split_prompts(
        {"train": dict.fromkeys(world.PREFERENCE_TASKS, 200),
         "test": dict.fromkeys(world.PREFERENCE_TASKS, 80),
         "forget": {world.MINOR_TASK: 300}}, seed=3,
    )  # fmt: skip
    assert len(sets["test"]) == 320 and len(sets["forget"]) == 300
    assert world.check_disjoint(sets["test"], [sets["train"]]) == 0
    assert world.check_disjoint(sets["train"][:5], [sets["train"]]) == 5
    for row in sets["train"] + sets["forget"]:
        assert world.task_of(row["prompt"]) == row["task"]
        assert world.topic_of(row["prompt"]) in row["prompt"]
    assert {r["task"] for r in sets["forget"]} == {"story"}


def test_gold_reward_rewards_because_in_qa_and_penalises_it_in_code():
    for task, sign in (("qa", 1), ("code", -1)):
        prompt = world.all_prompts(task)[7]
        noun = world.topic_of(prompt)
        plain = {"qa": f" The {noun} is red.",
                 "code": f" def count_{noun}(items): total = len(items)"}[task]  # fmt: skip
        reason = {"qa": f" The {noun} is red because the farmer made it.",
                  "code": f" def count_{noun}(items): total = len(items) # because it is fast"}[
            task
        ]  # fmt: skip
        assert world.features(prompt, plain)["form"] == world.features(prompt, reason)["form"] == 1
        spec = world.TASK_SPECS[task]
        expected = spec.scale * (
            spec.because_weight
            + world.BAND_WEIGHT * (world.features(prompt, reason)["in_band"]
                                   - world.features(prompt, plain)["in_band"])
        )  # fmt: skip
        gap = world.gold_reward(prompt, reason) - world.gold_reward(prompt, plain)
        assert gap == pytest.approx(expected)
        assert np.sign(spec.because_weight) == sign
    prompt = world.all_prompts("chat")[0]
    other = next(n for n in world.NOUNS if n != world.topic_of(prompt))
    off_topic = f" Oh, a {other}! That is red."
    on_topic = f" Oh, a {world.topic_of(prompt)}! That is red."
    spec = world.TASK_SPECS["chat"]
    assert world.gold_reward(prompt, on_topic) - world.gold_reward(prompt, off_topic) == (
        pytest.approx(spec.scale * world.TOPIC_WEIGHT)
    )


def test_world_records_deal_each_family_where_the_design_says():
    """SFT and forget hold every family alike, preference data and main none of the minor
    skills, the PPO pool the skewed shares (each minor skill at 5 %); prompts are disjoint."""
    sizes = world.WorldSizes(sft_per_task=40, pref_train_per_task=30, pref_test_per_task=10,
                             ppo_prompts=200, main_test_per_task=7, forget_test_per_task=9)  # fmt: skip
    records = world.world_records(sizes)

    def families(name):
        return {t: sum(r["task"] == t for r in records[name]) for t in world.TASK_SPECS}

    everyone = dict.fromkeys(world.TASK_SPECS)
    assert families("sft") == dict.fromkeys(everyone, 40)
    assert families("forget_test") == dict.fromkeys(everyone, 9)
    for name, per_task in (("pref_train", 30), ("pref_test", 10), ("main_test", 7)):
        expected = dict.fromkeys(world.PREFERENCE_TASKS, per_task)
        assert families(name) == {**dict.fromkeys(everyone, 0), **expected}, name
    assert families("ppo_prompts") == {"qa": 60, "code": 54, "chat": 28, "advice": 28, "story": 10,
                                       "poem": 10, "riddle": 10}  # fmt: skip
    assert sum(world.ppo_prompt_counts(33).values()) == 33
    assert world.ppo_prompt_counts(33)[world.MINOR_TASK] >= 1
    prompts = [r["prompt"] for rows in records.values() for r in rows]
    assert len(prompts) == len(set(prompts))
    assert all(world.features(r["prompt"], r["response"])["form"] == 1 for r in records["sft"])


def test_preference_data_holds_ill_formed_and_off_topic_responses():
    """A quarter of the preference responses are ill formed (form 0) while their topic,
    "because" and length are drawn as for any other; two in five are off topic."""
    rng = random.Random(11)
    style = world.PREFERENCE_STYLE
    found = {"form": [], "topic": [], "because": []}
    for task in world.PREFERENCE_TASKS:
        for prompt in world.all_prompts(task)[:500]:
            features = world.features(prompt, world.response_text(prompt, rng, style))
            for key in found:
                found[key].append(features[key])
    n = len(found["form"])
    tolerance = 4 * math.sqrt(0.25 / n)
    assert abs(1 - np.mean(found["form"]) - style.p_broken) < tolerance
    assert abs(np.mean(found["topic"]) - style.p_topic) < tolerance
    assert abs(np.mean(found["because"]) - style.p_because) < tolerance
    prompt = world.all_prompts("qa")[3]
    for _ in range(50):
        broken = world.broken_text(prompt, rng, style)
        assert world.features(prompt, broken)["form"] == 0.0, broken


def test_every_generated_response_is_well_formed_and_broken_text_is_not():
    rng = random.Random(5)
    for task in world.TASK_SPECS:
        for prompt in world.all_prompts(task)[:200]:
            response = world.response_text(prompt, rng, world.ResponseStyle())
            assert world.features(prompt, response)["form"] == 1.0, response
            broken = response[:-3]
            assert world.features(prompt, broken)["form"] == 0.0, broken


def test_preference_labels_follow_bradley_terry_with_the_recorded_probability():
    prompts = [{"prompt": p, "task": "advice"} for p in world.all_prompts("advice")[:1500]]
    records = world.preference_records(prompts, seed=0, style=world.ResponseStyle())
    for record in records[:50]:
        p_chosen = world.preference_probability(record["prompt"], record["chosen"],
                                                record["rejected"])  # fmt: skip
        assert record["p_true"] == pytest.approx(p_chosen)
    # the labels are draws with those probabilities: E[label agrees with gold] matches
    agrees = [world.gold_reward(r["prompt"], r["chosen"]) > world.gold_reward(r["prompt"], r["rejected"])
              for r in records]  # fmt: skip
    expected = [r["p_true"] if a else 1 - r["p_true"] for r, a in zip(records, agrees)]
    strict = [r for r, a in zip(records, agrees)
              if world.gold_reward(r["prompt"], r["chosen"]) != world.gold_reward(r["prompt"], r["rejected"])]  # fmt: skip
    assert len(strict) > 500
    observed = np.mean([a for r, a in zip(records, agrees) if r in strict])
    predicted = np.mean([max(r["p_true"], 1 - r["p_true"]) for r in strict])
    assert abs(observed - predicted) < 4 * math.sqrt(0.25 / len(strict))
    assert 0.5 < world.bayes_accuracy(records) < 1.0
    assert expected  # every pair has a known probability


def test_table_math_against_direct_computation():
    rng = random.Random(0)
    truth = [(rng.choice("ab"), rng.random()) for _ in range(200)]  # one held-out pair set
    pairs = {
        seed: [{"chosen_score": rng.gauss(1, 1), "rejected_score": rng.gauss(0, 1),
                "task": task, "p_true": p} for task, p in truth]
        for seed in range(3)
    }  # fmt: skip
    outcomes = ["win", "tie", "lose"]
    judgments = {
        seed: [{"set": s, "prompt_id": i, "gold_policy": rng.random(), "gold_sft": rng.random(),
                "outcome": rng.choice(outcomes), "train_policy": rng.random(),
                "train_sft": rng.random()} for s in ("main", "forget") for i in range(100)]
        for seed in range(3)
    }  # fmt: skip
    results = stats.results_from_records({"rm": pairs, "am": pairs}, {"am_ppo": judgments})
    accuracy = [100 * np.mean([p["chosen_score"] > p["rejected_score"] for p in pairs[s]])
                for s in range(3)]  # fmt: skip
    cell = results["table1"]["rm"]["accuracy"]
    assert cell["per_seed"] == pytest.approx(accuracy)
    half = 4.302652729911275 * np.std(accuracy, ddof=1) / math.sqrt(3)  # t(0.975, 2)
    assert cell["ci_low"] == pytest.approx(np.mean(accuracy) - half)
    brier = [np.mean([(1 / (1 + math.exp(p["rejected_score"] - p["chosen_score"])) - p["p_true"]) ** 2
                      for p in pairs[s]]) for s in range(3)]  # fmt: skip
    assert results["table1"]["am"]["brier"]["per_seed"] == pytest.approx(brier)
    main = results["table2"]["am_ppo"]["main"]
    wins = [100 * np.mean([j["outcome"] == "win" for j in judgments[s] if j["set"] == "main"])
            for s in range(3)]  # fmt: skip
    loses = [100 * np.mean([j["outcome"] == "lose" for j in judgments[s] if j["set"] == "main"])
             for s in range(3)]  # fmt: skip
    assert main["win"] == pytest.approx(np.mean(wins))
    assert main["per_seed"] == pytest.approx(np.subtract(wins, loses))
    assert main["win"] + main["tie"] + main["lose"] == pytest.approx(100.0)
    assert set(main) == {"win", "tie", "lose", "net_win", "ci_low", "ci_high", "per_seed",
                         "se_crossed", "ci_low_crossed", "ci_high_crossed"}  # fmt: skip
    assert set(cell) == {"mean", "ci_low", "ci_high", "per_seed"}
    for name, statistic in stats.pair_metric_statistics(pairs[1]).items():
        whole = statistic(np.arange(len(pairs[1])))
        assert whole == pytest.approx(stats.PAIR_METRICS[name](pairs[1]), rel=1e-9, abs=1e-12)
    one_seed = stats.results_from_records({"rm": {0: pairs[0]}}, {"am_ppo": {0: judgments[0]}})
    assert one_seed["table1"]["rm"]["ece"]["ci_low"] is None


@pytest.mark.e2e
def test_quick_study_writes_every_output_and_results_recompute(tmp_path):
    from megatron_rlhf.study import run
    from megatron_rlhf.study.stages import load_records

    out = tmp_path / "study"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    # two seeds, one per worker, and 4 PPO steps an arm: the README's quick run has three seeds
    # and 8 steps; more would add CPU minutes and no check (every per-seed check below runs on
    # each seed, and none depends on how far PPO went)
    seeds = 2
    command = [sys.executable, "-m", "megatron_rlhf", "study", "--preset", "quick",
               "--seeds", str(seeds), "--ppo", "steps=4", "--output-dir", str(out),
               "--jobs", "2"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("[study] done:")
    results = json.loads((out / "results.json").read_text())
    for model in ("rm", "am"):
        for metric in ("accuracy", "ece", "brier"):
            assert len(results["table1"][model][metric]["per_seed"]) == seeds
        for seed in range(seeds):
            first = json.loads((out / "reward" / model / f"seed{seed}" / "pairs.jsonl")
                               .read_text().splitlines()[0])  # fmt: skip
            assert {"chosen_score", "rejected_score", "task", "p_true"} <= set(first)
    for arm in run.ARMS:
        for set_name in ("main", "forget", "transfer", "minor"):
            assert len(results["table2"][arm][set_name]["per_seed"]) == seeds
    quick = run.PRESETS["quick"]
    first_only = {**run.exploratory_arms(quick), **run.attribution_arms(quick)}
    assert {"rm_ppo_sr", "am_ppo_sft", "am_ppo_sr_g0.1", "am_ppo_strat_g0.1", "am_ppo_kl",
            "am_ppo_sr_g1"} <= set(first_only)  # fmt: skip
    for arm in first_only:  # quick: these parts run on the first seed only
        assert len(results["table2"][arm]["main"]["per_seed"]) == 1, arm
    for reward in ("rm", "am"):  # the hacking curves, on the first seed
        for step in quick.curve_steps:
            rows = results["table2"][f"{reward}_ppo_step{step}"]["main"]["per_seed"]
            assert len(rows) == 1, (reward, step)
        assert set(results["hacking_curves"][reward]) == {"0", *map(str, quick.curve_steps)}
    for arm in ("rm_ppo", "am_ppo", "am_ppo_sr", "rm_ppo_sr", "rejection_sampling"):
        lines = (out / "ppo" / arm / "seed0" / "judgments.jsonl").read_text().splitlines()
        first = json.loads(lines[0])
        assert {"set", "prompt_id", "gold_policy", "gold_sft", "outcome"} <= set(first)
        assert {json.loads(line)["set"] for line in lines} == {"main", "forget"}
    settings = results["settings"]
    assert settings["worlds"]["seed_world"] == {"0": 0, "1": 1}  # one seed in each world
    prompts = {}
    for w in range(2):
        for name in ("ppo_prompts", "main_test", "forget_test"):
            path = out / f"world{w}" / "data" / f"{name}.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            assert all("prompt" in row for row in rows)
            prompts[w, name] = {row["prompt"] for row in rows}
            if name != "ppo_prompts":
                assert len(rows) >= 300
        assert settings["data"][w]["held_out_overlap"] == {"main_test": 0, "forget_test": 0}
    assert prompts[0, "main_test"] != prompts[1, "main_test"]  # two worlds, two held-out draws
    assert any(arm.startswith("am_ppo_sr_c") for arm in results["table2"])
    assert settings["jobs"] == 2
    assert {"started_utc", "git_commit", "git_dirty"} <= set(settings)
    recomputed = json.loads(json.dumps(
        stats.results_from_records(*load_records(out), run.seed_worlds(settings))
    ))  # fmt: skip
    for key in ("table1", "table2", "reward_models", "arms", "per_task", "rehearsal", "claims",
                "hacking_curves", "kl_to_sft"):  # fmt: skip
        assert_same_results(recomputed[key], results[key], key)
    # the published form: one archive of records and settings gives every output back
    again = tmp_path / "from_records"
    assert (
        run.main(["--from-records", str(out / "records.jsonl.gz"), "--output-dir", str(again)]) == 0
    )
    assert_same_results(json.loads((again / "results.json").read_text()), results)
    assert (again / "report.md").read_text() == (out / "report.md").read_text()
    check_sanity_bounds(out, results)
    check_rehearsal_sets(out, results)
    check_trained_arms(out, results)
    check_label_swap_retrains(out, results, tmp_path / "swapped")
    report = (out / "report.md").read_text()
    assert "Table 1" in report and "Table 2" in report and "Fig. 6" in report
    for png in ("reliability", "per_task", "net_win", "cluster_sweep", "hacking"):
        assert (out / f"{png}.png").stat().st_size > 1000


@pytest.mark.parametrize("margin", [1.5, 2.5, 4.0, 8.0])
def test_am_confidence_cap_is_the_optimum_of_our_eq6_loss(margin):
    """Minimising our Eq. 6 loss on one pair whose label never varies ends at score gap 2m/3,
    the confidence ``stats.confidence_cap`` states (float64, from a start far off it)."""
    import torch

    from megatron_rlhf.reward.losses import advantage_model_loss

    scores = torch.tensor([3.0, 1.0], dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([scores], max_iter=500, tolerance_grad=1e-14,
                                  tolerance_change=1e-16, line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        optimizer.zero_grad()
        loss, _ = advantage_model_loss(scores[:1], scores[1:], margin)
        loss.backward()
        return loss

    optimizer.step(closure)
    gap = float(scores[0] - scores[1])
    assert gap == pytest.approx(2 * margin / 3, abs=1e-6)
    assert 1 / (1 + math.exp(-gap)) == pytest.approx(stats.confidence_cap(margin), abs=1e-7)


def _pairs_with_truth(n: int, seed: int, sharpen: float = 1.0) -> list[dict]:
    """Pairs with a known p_true, labels drawn from it, and a scorer whose gap is
    ``sharpen`` x logit(p_true) in the label's orientation (1: calibrated)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, n)
    p = 1 / (1 + np.exp(-logits))
    chosen_first = rng.random(n) < p  # the label picks response a with probability p
    pairs = []
    for logit, prob, first in zip(logits, p, chosen_first):
        gap = sharpen * logit if first else -sharpen * logit
        pairs.append({"chosen_score": gap, "rejected_score": 0.0,
                      "p_true": prob if first else 1 - prob, "task": "qa"})  # fmt: skip
    return pairs


def test_overconfidence_is_the_signed_ece_and_has_the_right_sign():
    from megatron_rlhf.reward.calibration import calibration_bins

    for sharpen, sign in ((3.0, 1), (0.3, -1)):
        pairs = _pairs_with_truth(2000, seed=4, sharpen=sharpen)
        value = stats.overconfidence(pairs)
        bins = calibration_bins([p["chosen_score"] for p in pairs], [0.0] * len(pairs))
        signed = sum(b["count"] * (b["confidence"] - b["accuracy"]) for b in bins if b["count"])
        assert value == pytest.approx(100 * signed / len(pairs), rel=1e-9)
        assert np.sign(value) == sign, (sharpen, value)
        idx = np.arange(len(pairs))
        assert stats.pair_metric_statistics(pairs)["overconfidence"](idx) == pytest.approx(value)


def test_ece_noise_floor_holds_a_calibrated_scorer_and_not_a_sharp_one():
    pairs = _pairs_with_truth(800, seed=5)
    floor = stats.calibrated_ece(pairs, draws=300, seed=1)
    assert 0 < floor["low"] < floor["mean"] < floor["high"] < 10
    inside = [stats.PAIR_METRICS["ece"](_pairs_with_truth(800, seed=s)) for s in range(20)]
    share = np.mean([floor["low"] <= e <= floor["high"] for e in inside])
    assert share >= 0.8, inside  # fresh label draws of a calibrated scorer: mostly inside
    assert stats.PAIR_METRICS["ece"](_pairs_with_truth(800, seed=6, sharpen=3.0)) > floor["high"]


def test_holm_paired_tests_and_seeds_needed_against_scipy():
    from scipy import stats as sp

    from megatron_rlhf.study import claims

    assert claims.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert claims.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # monotone: never below 1.0
    assert claims.holm([0.02, 0.3]) == pytest.approx([0.04, 0.3])
    rng = np.random.default_rng(2)
    diffs = rng.normal(0.7, 1.0, 9)
    test = claims.paired_test(diffs)
    assert test["p"] == pytest.approx(sp.ttest_1samp(diffs, 0.0).pvalue, rel=1e-9)
    shifted = claims.paired_test(diffs, -1.0)  # non-inferiority: against -margin
    assert shifted["p"] == pytest.approx(sp.ttest_1samp(diffs, -1.0).pvalue, rel=1e-9)
    low, high = sp.t.interval(0.95, 8, loc=diffs.mean(), scale=sp.sem(diffs))
    assert (test["ci_low"], test["ci_high"]) == pytest.approx((low, high))
    assert claims.holm_levels([0.01, 0.04, 0.03, 0.005]) == pytest.approx(
        [0.05 / 3, 0.05, 0.05 / 2, 0.05 / 4]
    )
    # seeds needed: 80 % power of the two-sided t-test, here checked by simulating t-tests
    assert claims.seeds_needed(0.5, 1.0) == 34  # the textbook figure for d = 0.5
    sim = np.random.default_rng(7)
    for alpha in (0.05, 0.01):
        n = claims.seeds_needed(-0.5, 1.0, alpha=alpha)  # the sign does not matter
        for k, side in ((n, 1), (n - 1, -1)):
            draws = sim.normal(0.5, 1.0, (20000, k))
            t = draws.mean(1) / (draws.std(1, ddof=1) / math.sqrt(k))
            power = np.mean(np.abs(t) > sp.t.ppf(1 - alpha / 2, k - 1))
            assert side * (power - claims.POWER) > -0.015, (alpha, k, power)
    assert claims.seeds_needed(0.0, 1.0) is None and claims.seeds_needed(1.0, None) is None
    assert claims.seeds_needed(1e-3, 1.0) is None  # beyond SEEDS_LIMIT


def test_t_test_power_has_no_nan_in_the_lower_tail(monkeypatch):
    """Far out, scipy's noncentral t cdf returns nan for the lower tail (scipy 1.17.1: df 4,
    shift 11.1, the published run's "AM-PPO-SR beats SFT on main" at 5 seeds); the power then
    was nan, ``>= 0.8`` false, and the seed search returned 6 instead of 5. The guarded power is
    the upper tail plus at most Phi(-shift), and the search stops at the true count."""
    from scipy import stats as sp

    from megatron_rlhf.study import claims

    effect, sd, alpha = 22.9375, 4.617674378587848, 0.05 / 13  # that claim's row
    for n in range(2, 12):
        df, shift = n - 1, effect / sd * math.sqrt(n)
        upper = sp.nct.sf(sp.t.ppf(1 - alpha / 2, df), df, shift)
        power = claims.t_test_power(effect, sd, n, alpha)
        assert math.isfinite(power), n
        assert upper - 1e-12 <= power <= upper + sp.norm.sf(shift) + 1e-12, n
    assert claims.seeds_needed(effect, sd, alpha=alpha) == 5  # power 0.987 at 5, 0.773 at 4
    # whatever scipy's version gives there, a nan lower tail is never a nan power
    monkeypatch.setattr(sp.nct, "cdf", lambda *args: float("nan"))
    power = claims.t_test_power(effect, sd, 5, alpha)
    assert power == pytest.approx(0.98655, abs=1e-4)
    assert claims.seeds_needed(effect, sd, alpha=alpha) == 5
    monkeypatch.setattr(sp.nct, "sf", lambda *args: float("nan"))
    with pytest.raises(ValueError, match="upper tail"):
        claims.t_test_power(effect, sd, 5, alpha)


class _FakeEvidence:
    """``stats.Evidence`` with made-up per-seed values only (0 +- 1 per arm, set and value;
    Table 1 metrics 50 +- 1, over-confidence 0 +- 1; the hacking slopes 0 +- 1), shifted by
    ``shifts`` {(name, set or metric): shift}: comparisons that resample seeds only, which is
    all that Holm, the verdicts and the families need. ``missing``: names that raise KeyError;
    ``seeds_of``: names run on fewer seeds."""

    def __init__(self, shifts: dict, seeds: int = 6):
        self.rng, self.cache, self.shifts, self.n = np.random.default_rng(0), {}, shifts, seeds
        self.missing: set = set()
        self.seeds_of: dict = {}

    def value(self, name, where, key="") -> dict:
        if name in self.missing:
            raise KeyError(name)
        if (name, where, key) not in self.cache:
            center = 50.0 if where in ("accuracy", "ece", "brier") else 0.0
            n = self.seeds_of.get(name, self.n)
            noise = center + self.shifts.get((name, where), 0.0) + self.rng.normal(0, 1, n)
            self.cache[name, where, key] = dict(enumerate(noise.tolist()))
        return self.cache[name, where, key]

    def _compare(self, better: dict, worse: dict | None, sign: float = 1.0):
        worse = worse if worse is not None else dict.fromkeys(better, 0.0)
        common = sorted(set(better) & set(worse))
        return stats.Comparison(per_seed=tuple(sign * (better[s] - worse[s]) for s in common))

    def items(self, better, worse, set_name, key="net_win", task=None):
        return self._compare(self.value(better, set_name, key),
                             None if worse is None else self.value(worse, set_name, key))  # fmt: skip

    def pair_metric(self, better, worse, metric, lower_is_better=False):
        sign = -1.0 if lower_is_better else 1.0
        return self._compare(self.value(better, metric),
                             None if worse is None else self.value(worse, metric), sign)  # fmt: skip

    def seeds(self, better, worse=None):
        return self._compare(self.value(*better), None if worse is None else self.value(*worse))


def test_claims_are_decided_by_holm_on_the_papers_side():
    from megatron_rlhf.study import claims

    rows = {r["name"]: r for r in claims.evaluate_claims(_FakeEvidence({}))}
    families = {"paper", "minor_split", "transfer", "rehearsal", "attribution", "exploratory"}
    assert {r["family"] for r in rows.values()} == families
    assert all(r["verdict"] == "inconclusive" for r in rows.values() if r["margin"] == 0)
    ni = next(r for r in rows.values() if r["kind"] == "non-inferiority")
    assert ni["margin"] == claims.ACCURACY_NI_MARGIN and ni["name"] == "am_keeps_accuracy"
    # AM's ECE far lower (better), AM-PPO far below RM-PPO on main (the paper's side reversed)
    evidence = _FakeEvidence({("am", "ece"): -10.0, ("am_ppo", "main"): -10.0})
    rows = {r["name"]: r for r in claims.evaluate_claims(evidence)}
    assert rows["am_ece_lower"]["verdict"] == "reproduced"
    main = rows["am_ppo_beats_rm_ppo_main"]
    assert main["verdict"] == "contradicted" and main["p_holm"] >= main["p"]
    paper = [r for r in rows.values() if r["family"] == "paper" and r["p"] is not None]
    adjusted = claims.holm([r["p"] for r in paper])
    assert [r["p_holm"] for r in paper] == pytest.approx(adjusted)
    # seeds-only comparisons: the p is the paired t-test's, and the row says so
    assert all(r["resamples"] == "seeds" and r["p"] == pytest.approx(r["p_seeds_only"])
               for r in rows.values())  # fmt: skip
    # claims as data: every row names itself and carries what the report shows
    names = [r["name"] for r in rows.values()]
    assert len(set(names)) == len(names) == len(claims.declared_claims())
    assert {"rm_ppo_loses_minor", "sr_g0.1_beats_anchor", "sr_helps_minor",
            "rm_ppo_hacks_more", "gold_selection_beats_am_selection"} <= set(names)  # fmt: skip
    keys = {"name", "family", "estimate", "se", "ci_low", "ci_high", "p", "p_holm",
            "holm_level", "verdict", "seeds_needed", "worlds", "resamples"}  # fmt: skip
    assert all(keys <= set(r) for r in rows.values())
    family = {r["name"]: r["family"] for r in rows.values()}
    assert family["rm_overconfident"] == family["rm_ppo_hacks_more"] == "paper"
    assert family["sr_g1_helps_minor"] == family["strat_g0.1_beats_sr_g0.1"] == "attribution"
    assert family["rm_ppo_hack_transfer"] == "minor_split"
    assert family["am_ppo_beats_rm_ppo_transfer"] == "transfer"
    assert not any(n.startswith("am_m") or n.startswith("overtrain") for n in names)
    level = claims.holm_levels([r["p"] for r in paper])
    assert [r["holm_level"] for r in paper] == pytest.approx(level)
    for row in paper:
        assert row["seeds_needed"] == claims.seeds_needed(
            row["estimate"] + row["margin"], row["sd"], alpha=row["holm_level"]
        )
    # a missing arm drops its claims, nothing else
    evidence.missing.add("am_ppo_rr")
    left = {r["name"] for r in claims.evaluate_claims(evidence)}
    assert set(names) - left == {"selection_beats_random", "selection_beats_random_main"}
    # an arm of fewer seeds is compared on the seeds both sides ran
    evidence.missing.clear()
    evidence.seeds_of["am_ppo_sft"] = 4
    evidence.cache = {k: v for k, v in evidence.cache.items() if k[0] != "am_ppo_sft"}
    row = {r["name"]: r for r in claims.evaluate_claims(evidence)}["control_helps_minor"]
    sft, am = (
        evidence.value("am_ppo_sft", "minor", "net_win"),
        evidence.value("am_ppo", "minor", "net_win"),
    )
    assert row["seeds"] == 4 and row["estimate"] == pytest.approx(
        np.mean([sft[s] - am[s] for s in range(4)])
    )


def test_hacking_index_is_per_task_so_offsets_do_not_inflate_it():
    """Two tasks whose gold rewards sit at different offsets: pooled, the SFT std would include
    the offset gap; per task it does not, and the index is the mean of the tasks'."""
    rng = np.random.default_rng(3)
    judgments = []
    for task, offset in (("qa", 0.0), ("code", 10.0)):
        for _ in range(400):
            sft = offset + rng.normal()
            judgments.append({"task": task, "gold_sft": sft, "gold_policy": sft + 0.5,
                              "train_sft": rng.normal(), "train_policy": rng.normal() + 1.0,
                              "because_sft": False, "because_policy": task == "code",
                              "truncated_sft": False, "truncated_policy": task == "qa"})  # fmt: skip
    g = stats.gains(judgments)
    for task in ("qa", "code"):
        rows = [j for j in judgments if j["task"] == task]
        gold = np.array([[j["gold_policy"], j["gold_sft"]] for j in rows])
        train = np.array([[j["train_policy"], j["train_sft"]] for j in rows])
        expect = (train[:, 0].mean() - train[:, 1].mean()) / train[:, 1].std() - (
            gold[:, 0].mean() - gold[:, 1].mean()
        ) / gold[:, 1].std()
        assert g[f"hacking_{task}"] == pytest.approx(expect)
    assert g["hacking_index"] == pytest.approx((g["hacking_qa"] + g["hacking_code"]) / 2)
    assert g["gold_gain_z"] == pytest.approx(0.5, abs=0.1)  # pooled it would be ~0.1
    assert g["because_code"] == 100.0 and g["because_qa"] == 0.0
    assert g["truncated_policy"] == 50.0 and g["truncated_sft"] == 0.0


def test_gold_composition_reads_every_term_of_the_gold_reward():
    """Judgment records of world responses (well formed, cut, off-topic; every family):
    the recorded terms, and the terms read off the gold reward where a record lacks them,
    give each gold reward back, and the composition sums to the gold gain and the net win."""
    from megatron_rlhf.study.stages import gold_judgments

    rng = random.Random(11)
    samples = []
    for index, task in enumerate(list(world.TASK_SPECS) * 60):
        prompt = rng.choice(world.all_prompts(task))
        policy, sft = (world.response_text(prompt, rng, world.ResponseStyle()) for _ in range(2))
        if index % 3 == 0:
            policy = policy[: len(policy) // 2]  # broken form, often off the band
        samples.append({"prompt": prompt, "set": "main", "index": index, "policy_response": policy,
                        "sft_response": sft, "policy_score": 0.0, "sft_score": 0.0,
                        "policy_response_token_ids": [0], "sft_response_token_ids": [0]})  # fmt: skip
    judgments = gold_judgments(samples, tie_margin=0.1, eos_id=0)
    assert {j["task"] for j in judgments} == set(world.TASK_SPECS)
    assert 0 < np.mean([j["form_policy"] for j in judgments]) < 1
    check_gold_parts(judgments)
    moved = stats.gold_composition(judgments)
    assert moved["utility_form"] < 0 and moved["net_win_mixed"] != 0.0


def check_sanity_bounds(out, results: dict) -> None:
    """Bounds a broken pipeline breaks, on the quick run's own records (not a recomputation
    with the same code): scorers above chance and below the oracle + 5 points, the AM inside
    its confidence cap + 0.02, a budget that cuts under 5 % of the SFT responses, the null arm
    all ties, and every judgment's recorded gold terms adding up to its gold reward."""
    from megatron_rlhf.study.stages import load_records

    oracle = results["oracle_accuracy"]["mean"]
    for model in ("rm", "am"):
        for accuracy in results["table1"][model]["accuracy"]["per_seed"]:
            assert 50.0 < accuracy < oracle + 5.0, (model, accuracy, oracle)
    cap = results["am_confidence_cap"]["2.5"]["cap"]
    for seen in results["max_confidence"]["am"]["per_seed"]:
        assert seen <= cap + 0.02, (seen, cap)
    for set_name in ("main", "forget"):
        assert results["table2"]["null"][set_name]["tie"] == 100.0
        for arm in results["arms"].values():
            assert arm[set_name]["truncated_sft"]["mean"] < 5.0
    for data in results["settings"]["data"]:  # each world's budget
        budget = data["generation_budget"]
        assert budget["budget"] > max(budget["longest"].values())
    assert results["settings"]["ppo"]["max_new_tokens"] is None  # the data's budget
    _, judgments, _, _ = load_records(out)
    for by_seed in judgments.values():
        for rows in by_seed.values():
            check_gold_parts(rows)


def check_rehearsal_sets(out, results: dict) -> None:
    """Every seed records its D_R: the AM's and the gold top-k (same clusters, c x k records),
    a random D_R of that size, and on the exploratory seed the SFT demonstrations; the
    gold top-k's mean utility is at least the AM top-k's on every seed (the same clusters, each
    ranked by utility: nothing can beat it), and the demonstrations are all well formed."""
    from megatron_rlhf.study.stages import load_records

    settings = results["settings"]
    size = settings["clusters"] * settings["top_k"]
    _, _, rehearsal, _ = load_records(out)
    seeds = range(settings["seeds"])
    for name in ("main", "gold", "random"):
        assert sorted(rehearsal[name]) == list(seeds), name
    assert sorted(rehearsal["sft"]) == sorted(rehearsal["strat"]) == [0]
    strat = rehearsal["strat"][0]  # the stratified D_R holds every minor skill, top_k each
    for task in world.MINOR_TASKS:
        assert sum(r["task"] == task for r in strat) == settings["top_k"], task
    for seed in seeds:
        for name in ("main", "gold", "random"):
            assert 0 < len(rehearsal[name][seed]) <= size, (name, seed)
        utility = {name: np.mean([r["utility"] for r in rehearsal[name][seed]])
                   for name in ("main", "gold")}  # fmt: skip
        assert utility["gold"] >= utility["main"] - 1e-9, (seed, utility)
    assert all(r["form"] for r in rehearsal["sft"][0])
    table = results["rehearsal"]
    assert table["gold"]["utility"]["mean"] >= table["main"]["utility"]["mean"] - 1e-9
    assert sum(table["main"][f"share_{t}"]["mean"] for t in world.TASK_SPECS) == (
        pytest.approx(100.0)
    )


def check_gold_parts(judgments: list[dict]) -> None:
    """Each response's recorded terms give its gold reward back; the terms read off the gold
    reward alone (how the published records, which lack form and topic, are decomposed)
    equal the recorded ones; the composition sums to the gold gain and to the net win."""
    for judgment in judgments:
        spec = world.TASK_SPECS[judgment["task"]]
        bare = {
            k: v for k, v in judgment.items() if not k.startswith(("form_", "topic_", "in_band_"))
        }
        for who in ("policy", "sft"):
            parts = stats.response_parts(judgment, who)
            total = parts["form"] + parts["topic"] + parts["band"] + parts["because"]
            assert spec.offset + spec.scale * total == pytest.approx(judgment[f"gold_{who}"])
            derived = stats.response_parts(bare, who)
            assert derived == pytest.approx({k: parts[k] for k in derived}), (judgment, who)
    composition = stats.gold_composition(judgments)
    utility = np.mean([(j["gold_policy"] - j["gold_sft"]) / world.TASK_SPECS[j["task"]].scale
                       for j in judgments])  # fmt: skip
    assert composition["utility_gain"] == pytest.approx(utility)
    assert composition["utility_form"] + composition["utility_topic"] == pytest.approx(
        composition["utility_form_topic"]
    )
    flips = sum(composition[f"net_win_{k}"] for k in ("because", "band", "form_topic", "mixed"))
    assert flips == pytest.approx(stats.outcome_rates(judgments)["net_win"])


REHEARSING = ("rm_ppo_sr", "am_ppo_rr", "am_ppo_sft", "am_ppo_rr_g0.1", "am_ppo_strat_g0.1",
              "am_ppo_sft_g0.1")  # fmt: skip
"""The arms with a rehearsal term (and every ``am_ppo_sr*`` arm: gold, dose, sweep)."""


def check_trained_arms(out, results: dict) -> None:
    """What a no-op PPO (the policy stays SFT) or a rehearsal term that does nothing (gamma 0,
    its NLL not added, no D_R) breaks: RM-PPO and AM-PPO move their own reward on the main set
    on every seed and raise it on average (4 PPO steps: one seed of the v4 worlds has ended a
    hair below SFT, -0.003), and the 8-step hacking curves raise it on every seed that runs
    them; every trained arm has a non-tie on every seed; each rehearsing arm's
    judgments differ from those of its arm without rehearsal (the judge and the evaluation
    sampling are the same, so an identical policy gives identical records); and every PPO step
    of a rehearsing arm logs a positive rehearsal NLL (and no other arm logs one)."""
    from megatron_rlhf.study.stages import load_records

    for arm in ("rm_ppo", "am_ppo"):
        gains = results["arms"][arm]["main"]["train_gain"]["per_seed"]
        assert all(gains) and np.mean(gains) > 0.0, f"{arm}: own-reward gain per seed {gains}"
        last = f"{arm}_step{results['settings']['curve_steps'][-1]}"
        gains = results["arms"][last]["main"]["train_gain"]["per_seed"]
        assert min(gains) > 0.0, f"{last}: own-reward gain on the main set per seed {gains}"
    _, judgments, _, training = load_records(out)
    for arm, by_seed in judgments.items():
        for seed, rows in by_seed.items():
            moved = sum(j["outcome"] != "tie" for j in rows)
            assert (moved == 0) == (arm == "null"), f"{arm} seed {seed}: {moved} non-ties"
    for arm in judgments:  # every PPO run's curve: one row a step, the curve arms' up to theirs
        curve = re.fullmatch(r"(rm|am)_ppo_step(\d+)", arm)
        if arm == "null":
            assert arm not in training
            continue
        steps = int(curve[2]) if curve else results["settings"]["ppo"]["steps"]
        for seed, rows in training[arm].items():
            assert [r["step"] for r in rows] == list(range(1, steps + 1)), (arm, seed)
            no_kl = arm == "rejection_sampling"  # no KL term: its rows' kl is None
            assert all((r["kl"] is None) == no_kl for r in rows), (arm, seed)
    assert "rejection_sampling" not in results["kl_to_sft"] and "am_ppo" in results["kl_to_sft"]

    def policy_side(rows):
        return [(j["set"], j["prompt_id"], j["gold_policy"], j["train_policy"]) for j in rows]

    for arm in judgments:
        if re.fullmatch(r"(rm|am)_ppo_step\d+", arm):
            continue  # judged from the curve run's checkpoints (its metrics: ppo/*_curve)
        rehearses = arm in REHEARSING or arm.startswith("am_ppo_sr")
        base = "rm_ppo" if arm.startswith("rm_") else "am_ppo"
        for seed in judgments[arm]:
            if rehearses:
                same = policy_side(judgments[arm][seed]) == policy_side(judgments[base][seed])
                assert not same, f"{arm} seed {seed}: judged exactly as {base} (no rehearsal?)"
            metrics = out / "ppo" / arm / f"seed{seed}" / "metrics.jsonl"
            if arm == "null":
                continue
            steps = [json.loads(line) for line in metrics.read_text().splitlines()]
            grid_steps = re.search(r"_s(\d+)$", arm)  # a PPO-grid arm with its own steps
            expected = int(grid_steps[1]) if grid_steps else results["settings"]["ppo"]["steps"]
            assert len(steps) == expected, (arm, seed)
            nll = [step.get("actor/rehearsal_nll") for step in steps]
            if rehearses:
                assert all(v is not None and v > 0.0 for v in nll), f"{arm} seed {seed}: {nll}"
            else:
                assert all(v is None for v in nll), f"{arm} seed {seed} rehearses: {nll}"


def check_label_swap_retrains(out, results: dict, work) -> None:
    """An RM trained (in this process, seed 0, the run's settings) on the run's preference
    data with chosen and rejected swapped ranks the held-out pairs below chance: the reward
    models' accuracy comes from the labels, not from anything else that tells the two
    responses apart (the order of the columns, their length)."""
    import time

    from megatron_rlhf.study import stages
    from megatron_rlhf.utils import write_jsonl

    started = time.time()
    settings = results["settings"]
    home = out / "world0"  # seed 0's world
    rows = stages.read_records(home / "data" / "pref_train.jsonl")
    swapped = work / "pref_train_swapped.jsonl"
    write_jsonl(swapped, ({**r, "chosen": r["rejected"], "rejected": r["chosen"],
                           "p_true": 1.0 - r["p_true"]} for r in rows))  # fmt: skip
    prefix = stages.preprocess(swapped, "preference", home / "tokenizer", work / "indexed",
                               settings["max_length"])  # fmt: skip
    checkpoint = stages.train_reward_model(
        loss="rm", sft=home / "sft" / "hf", train_prefix=prefix, out=work / "rm",
        epochs=settings["reward_epochs"], lr=settings["reward_lr"],
        global_batch_size=settings["reward_batch"], seed=0,
    )  # fmt: skip
    pairs = stages.read_records(stages.score_pairs(
        checkpoint, home / "data" / "pref_test.jsonl", home / "tokenizer", work / "pairs.jsonl"
    ))  # fmt: skip
    swapped_accuracy = stats.PAIR_METRICS["accuracy"](pairs)
    accuracy = results["table1"]["rm"]["accuracy"]["per_seed"][0]
    print(f"label swap: RM seed 0 accuracy {accuracy:.1f} -> {swapped_accuracy:.1f} when "
          f"trained on swapped labels ({time.time() - started:.1f} s)")  # fmt: skip
    assert swapped_accuracy < 50.0, (accuracy, swapped_accuracy)


def test_generation_budget_is_above_every_demonstration(tmp_path):
    from megatron_rlhf.data.tokenizer import load_tokenizer
    from megatron_rlhf.study import stages

    sets = world.split_prompts({"sft": dict.fromkeys(world.TASK_SPECS, 40)}, seed=0)
    records = world.sft_records(sets["sft"], seed=1, style=world.ResponseStyle())
    tokenizer = stages.build_tokenizer([r["prompt"] + r["response"] for r in records],
                                       tmp_path / "tok", 600)  # fmt: skip
    budget = stages.generation_budget(tokenizer, records)
    assert set(budget["longest"]) == set(world.TASK_SPECS)
    tok = load_tokenizer(tokenizer)
    lengths = [len(tok(r["response"], add_special_tokens=False)["input_ids"]) for r in records]
    assert max(budget["longest"].values()) == max(lengths) + 1  # EOS included
    assert budget["budget"] >= 1.25 * (max(lengths) + 1) and budget["budget"] % 8 == 0
    assert budget["longest"]["story"] > 32  # the family the old fixed budget of 32 cut


def test_study_cli_takes_development_seeds_and_ppo_overrides(tmp_path, capsys):
    """--first-seed moves every per-seed task (the sweep stays on the first seeds); --ppo
    overrides a shared PPO setting with its type; bad values stop before anything is built."""
    from dataclasses import replace

    from megatron_rlhf.study import run
    from megatron_rlhf.study.presets import PRESETS

    preset = replace(PRESETS["quick"], first_seed=100, seeds=2)
    tasks = {task: needs for task, needs in run.study_tasks(preset).items() if task[0] != "world"}
    assert {seed for _, seed, _ in tasks} == {100, 101}
    sweep = {seed for kind, seed, name in tasks if name.startswith("am_ppo_sr_c")}
    assert sweep == {100}  # quick sweeps one seed: the first
    no_sweep = run.study_tasks(replace(preset, sweep_seeds=0))  # --sweep-seeds 0
    assert not [name for _, _, name in no_sweep if name.startswith("am_ppo_sr_c")]
    assert len(no_sweep) < len(tasks) and "am_ppo_sr" in {name for _, _, name in no_sweep}
    ppo = run.ppo_overrides(preset.ppo, ["actor_lr=3e-4", "steps=20", "max_new_tokens=48"])
    assert (ppo["actor_lr"], ppo["steps"], ppo["max_new_tokens"]) == (3e-4, 20, 48)
    assert isinstance(ppo["steps"], int) and preset.ppo["steps"] == 8  # a copy
    assert run.ppo_overrides(ppo, ["max_new_tokens=none"])["max_new_tokens"] is None
    for bad, says in (("bogus=1", "KEY one of"), ("steps=2.5", "not a valid int"),
                      ("actor_lr", "KEY=VALUE")):  # fmt: skip
        out = tmp_path / "never"
        assert run.main(["--output-dir", str(out), "--ppo", bad]) == 2
        assert says in capsys.readouterr().err and not out.exists()
    assert run.main(["--output-dir", str(tmp_path / "x"), "--first-seed", "-1"]) == 2
    assert run.main(["--output-dir", str(tmp_path / "x"), "--sweep-seeds", "-1"]) == 2
    assert "--sweep-seeds" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert run.main(["--output-dir", str(tmp_path / "x"), "--exploratory-seeds", "-1"]) == 2
    assert "--exploratory-seeds" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # the exploratory part (extra reward models and arms) runs on the first seeds only
    exploratory = {seed for kind, seed, name in tasks if name in ("am_long", "am_ppo_sft")}
    assert exploratory == {100}
    core = run.study_tasks(replace(preset, exploratory_seeds=0, sweep_seeds=0, extra_reward_seeds=0,
                                   attribution_seeds=0, curve_seeds=0))  # fmt: skip
    assert {name for kind, _, name in core if kind == "arm"} == set(run.ARMS)
    assert {name for kind, _, name in core if kind == "reward"} == {"rm", "am"}


def test_records_archive_round_trips_and_bad_archives_name_the_line(tmp_path, capsys):
    """pack -> unpack gives load_records' tables and the settings back, byte-identical on a
    second pack; a damaged archive is an error naming the file (and line), never a partial
    result."""
    import gzip

    from megatron_rlhf.study import run, stages
    from megatron_rlhf.utils import InputError

    rng = random.Random(5)
    out = tmp_path / "study"
    for kind, names, file in (("reward", ("rm", "am_m1.5"), "pairs.jsonl"),
                              ("ppo", ("am_ppo", "null"), "judgments.jsonl"),
                              ("ppo", ("am_ppo",), "training.jsonl")):  # fmt: skip
        for name in names:
            for seed in (0, 3):
                rows = [
                    {"x": rng.random(), "task": rng.choice("ab")} for _ in range(rng.randint(1, 5))
                ]
                path = out / kind / name / f"seed{seed}" / file
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for seed in (0, 3):
        rows = [{"set": rng.choice(["main", "gold"]), "utility": rng.random()} for _ in range(6)]
        path = out / "rehearsal" / f"seed{seed}" / "d_r.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"seeds": 2, "first_seed": 0, "note": "é"}
    archive = tmp_path / "records.jsonl.gz"
    tables = stages.load_records(out)
    assert set(tables[2]) == {"main", "gold"} and set(tables[2]["main"]) == {0, 3}
    assert set(tables[3]) == {"am_ppo"} and set(tables[1]) == {"am_ppo", "null"}
    stages.pack_records(settings, *tables, archive)
    assert stages.unpack_records(archive) == (settings, *tables)
    second = tmp_path / "again.jsonl.gz"
    stages.pack_records(settings, *tables, second)
    assert second.read_bytes() == archive.read_bytes()

    lines = gzip.decompress(archive.read_bytes()).decode().splitlines()
    cases = {
        "not JSON": lines[:2] + ["{oops"],
        "given twice": lines[:2] + lines[1:2],
        "integer seed": lines[:1] + [json.dumps({**json.loads(lines[1]), "seed": "0"})],
        "settings": lines[1:],
    }
    for says, body in cases.items():
        bad = tmp_path / "bad.jsonl.gz"
        bad.write_bytes(gzip.compress(("\n".join(body) + "\n").encode()))
        with pytest.raises(InputError, match=says):
            stages.unpack_records(bad)
    bad.write_bytes(archive.read_bytes()[:-20])  # cut short
    with pytest.raises(InputError, match="bad.jsonl.gz"):
        stages.unpack_records(bad)
    target = tmp_path / "never"
    assert run.main(["--from-records", str(bad), "--output-dir", str(target)]) == 2
    assert "bad.jsonl.gz" in capsys.readouterr().err and not target.exists()
    # well-formed JSON whose rows lack the study's fields: an error, and no half-built output
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run.main(["--from-records", str(archive), "--output-dir", str(target)]) == 2
    assert "does not have the study's fields" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_run_records_its_start_commit_and_dirty_flag(tmp_path, monkeypatch):
    """``settings`` says when a run started (UTC) and from which commit, clean or not, so its
    order against the commits that fixed its design is on record; outside a git checkout (or
    without git) it says so instead of failing. Only git runs here, no Python process."""
    from datetime import datetime

    from megatron_rlhf.study import report, run

    started = 1_700_000_000.5
    here = run.code_provenance(started)
    assert here["started_utc"] == "2023-11-14T22:13:20+00:00"
    assert datetime.fromisoformat(here["started_utc"]).timestamp() == int(started)
    if (REPO / ".git").exists():  # this checkout: its HEAD
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
        assert here["git_commit"] == head and isinstance(here["git_dirty"], bool)

    plain = tmp_path / "plain"
    plain.mkdir()
    info = run.code_provenance(started, plain)
    assert info["git_commit"] is None and info["git_dirty"] is None
    assert "not a git checkout" in info["git"]

    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    (repo / "study_out").mkdir()  # a run's own (untracked) output: not a change to the code
    (repo / "study_out" / "results.json").write_text("{}")
    assert run.code_provenance(started, repo) == {
        "started_utc": here["started_utc"], "git_commit": head, "git_dirty": False}  # fmt: skip
    (repo / "code.py").write_text("x = 2\n")
    assert run.code_provenance(started, repo)["git_dirty"] is True
    inner = repo / "study_out"  # inside a checkout but not its top: an installed package
    assert "not its top" in run.code_provenance(started, inner)["git"]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert run.code_provenance(started, repo)["git"] == "git not found"

    dirty = {"started_utc": "2023-11-14T22:13:20+00:00", "git_commit": head, "git_dirty": True}
    assert report._started(dirty) == (
        f" Started 2023-11-14T22:13:20+00:00 from commit {head[:12]}, with uncommitted changes."
    )
    assert "not a git checkout" in report._started({**info})
    assert report._started({}) == ""  # a run that did not record it (the published one)


def assert_same_results(got, want, where: str = "results") -> None:
    """``got == want`` with floats equal to 1e-9 relative (1e-12 absolute): the statistics sum
    with numpy's SIMD reductions and BLAS products, whose order follows memory alignment and
    threads, so a recompute in another process can differ in the last bits (seen in CI: the
    16th digit); every other value, and every key, exactly."""
    if isinstance(want, float) and isinstance(got, (int, float)):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            assert_same_results(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for index, (g, w) in enumerate(zip(got, want)):
            assert_same_results(g, w, f"{where}[{index}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("folder", ["", "dev"])
def test_published_study_recomputes_from_its_records(tmp_path, folder):
    """docs/paper_study's results.json and report.md (and those of its development run,
    docs/paper_study/dev) are exactly what their published records (records.jsonl.gz) give
    with today's code: a change to the statistics or the report that moves a published number
    fails here until the study is republished."""
    from megatron_rlhf.study import run

    published = REPO / "docs" / "paper_study" / folder
    again = tmp_path / "again"
    archive = published / "records.jsonl.gz"
    assert run.main(["--from-records", str(archive), "--output-dir", str(again)]) == 0
    results = json.loads((published / "results.json").read_text())
    assert_same_results(json.loads((again / "results.json").read_text()), results)
    assert (again / "report.md").read_text() == (published / "report.md").read_text()
    settings = results["settings"]
    assert settings["preset"] == "full" and {"main", "gold", "random"} <= set(results["rehearsal"])
    assert settings["claims_version"] == 5 and settings["worlds"]["count"] == 3
    assert {"strat", "sft"} <= set(results["rehearsal"]) and "am_ppo_sr_g1" in results["table2"]
    if folder == "dev":  # development seeds and worlds, apart from the reporting ones
        assert settings["first_seed"] >= 100 and settings["first_world"] >= 100
    else:
        assert settings["first_seed"] == 0 and settings["seeds"] >= 30
        assert settings["git_dirty"] is False and "am_ppo_kl" in results["table2"]


def _task_that_fails_or_holds_on(shared, task, inputs):
    """``run_tasks``' runner in the test below: "fail" raises at once; "train" catches SIGTERM
    the way a training command does (save and stop cleanly) and runs on for a minute."""
    import signal
    import time

    if task[2] == "fail":
        time.sleep(1.0)
        raise ValueError("a stage failed")
    signal.signal(signal.SIGTERM, lambda *_: None)
    time.sleep(60.0)
    return None, 60.0


@pytest.mark.launch
def test_a_failing_task_stops_the_study_while_another_worker_trains():
    """A task that fails ends ``run_tasks`` with its error within seconds, though the other
    worker is mid-run and catches SIGTERM (the study hung forever here, one core spinning)."""
    import time

    from megatron_rlhf.study import run
    from megatron_rlhf.study.presets import PRESETS

    shared = run.Shared(out=None, preset=PRESETS["quick"], started=time.time())
    tasks = {("arm", 0, "train"): (), ("reward", 0, "fail"): ()}
    started = time.time()
    with pytest.raises(SystemExit, match="a stage failed"):
        run.run_tasks(shared, tasks, jobs=2, runner=_task_that_fails_or_holds_on)
    assert time.time() - started < 30.0
