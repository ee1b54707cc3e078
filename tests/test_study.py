"""The study: the text world's gold reward and labels, the aggregation math, and the quick run.

The quick run (slow) checks that ``study --preset quick --jobs 2`` writes every output the issue
names and that results.json is exactly what ``stats.results_from_records`` computes from the raw
records it wrote.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
from torchrun_util import REPO

from megatron_rlhf.study import stats, world


def test_world_prompts_are_disjoint_and_parsed_back():
    sets = world.split_prompts(
        {"train": dict.fromkeys(world.PPO_TASKS, 200), "test": dict.fromkeys(world.PPO_TASKS, 80),
         "forget": {world.FORGET_TASK: 300}}, seed=3,
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
    pairs = {
        seed: [{"chosen_score": rng.gauss(1, 1), "rejected_score": rng.gauss(0, 1),
                "task": rng.choice("ab"), "p_true": rng.random()} for _ in range(200)]
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
    assert set(main) == {"win", "tie", "lose", "net_win", "ci_low", "ci_high", "per_seed"}
    assert set(cell) == {"mean", "ci_low", "ci_high", "per_seed"}
    for name, statistic in stats.pair_metric_statistics(pairs[1]).items():
        whole = statistic(np.arange(len(pairs[1])))
        assert whole == pytest.approx(stats.PAIR_METRICS[name](pairs[1]), rel=1e-9, abs=1e-12)
    one_seed = stats.results_from_records({"rm": {0: pairs[0]}}, {"am_ppo": {0: judgments[0]}})
    assert one_seed["table1"]["rm"]["ece"]["ci_low"] is None


@pytest.mark.slow
def test_quick_study_writes_every_output_and_results_recompute(tmp_path):
    from megatron_rlhf.study.run import compute_results

    out = tmp_path / "study"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "megatron_rlhf", "study", "--preset", "quick",
               "--output-dir", str(out), "--jobs", "2"]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("[study] done:")
    results = json.loads((out / "results.json").read_text())
    for model in ("rm", "am"):
        for metric in ("accuracy", "ece", "brier"):
            assert len(results["table1"][model][metric]["per_seed"]) == 3
        for seed in range(3):
            first = json.loads((out / "reward" / model / f"seed{seed}" / "pairs.jsonl")
                               .read_text().splitlines()[0])  # fmt: skip
            assert {"chosen_score", "rejected_score", "task", "p_true"} <= set(first)
    for arm in ("rm_ppo", "rm_ppo_ma", "am_ppo", "am_ppo_sr", "rm_ppo_sr", "rejection_sampling"):
        for set_name in ("main", "forget"):
            assert len(results["table2"][arm][set_name]["per_seed"]) == 3
        lines = (out / "ppo" / arm / "seed0" / "judgments.jsonl").read_text().splitlines()
        first = json.loads(lines[0])
        assert {"set", "prompt_id", "gold_policy", "gold_sft", "outcome"} <= set(first)
        assert {json.loads(line)["set"] for line in lines} == {"main", "forget"}
    for name in ("ppo_prompts", "main_test", "forget_test"):
        rows = [json.loads(x) for x in (out / "data" / f"{name}.jsonl").read_text().splitlines()]
        assert all("prompt" in row for row in rows)
        if name != "ppo_prompts":
            assert len(rows) >= 300
    assert any(arm.startswith("am_ppo_sr_c") for arm in results["table2"])
    assert results["settings"]["jobs"] == 2
    assert results["settings"]["data"]["held_out_overlap"] == {"main_test": 0, "forget_test": 0}
    recomputed = json.loads(json.dumps(compute_results(out)))
    for key in ("table1", "table2", "reward_models", "arms", "per_task"):
        assert recomputed[key] == results[key]
    report = (out / "report.md").read_text()
    assert "Table 1" in report and "Table 2" in report and "Fig. 6" in report
    for png in ("reliability", "per_task", "net_win", "cluster_sweep"):
        assert (out / f"{png}.png").stat().st_size > 1000
