"""``python -m megatron_rlhf demo``: the paper's whole recipe on a tiny BLOOM, on the CPU.

The quick study's small cousin (``python -m megatron_rlhf study``): the same text world with a
known gold reward (``study/world.py``), one seed, three PPO arms. Every stage runs the real
command in this process (world size 1):

  1 tokenizer     a byte-level BPE trained on the world's text
  2 data          world prompts (held-out sets disjoint from training), SFT and labelled pairs
  3 SFT policy    a random tiny BLOOM fine-tuned on all seven task families
  4 RM and AM     train-reward (loss: rm, loss: am) from the SFT trunk; eval-reward on
                  held-out pairs (accuracy, ECE, per-task scores)
  5 curation      generate (SFT) -> score (AM) -> tools/build_rehearsal_clusters.py (D_R)
  6 PPO arms      AM-PPO-SR (ppo/), AM-PPO (ppo_am_ppo/) and RM-PPO (ppo_rm_ppo/): same beta,
                  lr and steps
  7 evaluation    eval-policy of each arm vs SFT on a main and a forget set, every response
                  re-judged by the gold reward (gold_judgments.md)

The models are tiny and train for seconds, so one seed's numbers are noisy: the study runs the
same comparison over seeds with confidence intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from megatron_rlhf.utils import InputError, check_output_dir, print_summary, write_jsonl

STAGES = 7
SIZES = {"sft": 60, "pref_train": 150, "pref_test": 24, "ppo_prompts": 32, "main_test": 6,
         "forget_test": 5}  # per family (world.WorldSizes), ppo_prompts in all  # fmt: skip
PPO = {"steps": 8, "prompts_per_step": 16, "micro_batch_size": 8,
       "num_minibatches": 2, "kl_coef": 0.02, "actor_lr": 1e-3, "critic_lr": 1e-3,
       "rehearsal_gamma": 0.01, "rehearsal_micro_batch_size": 2}  # fmt: skip
ARMS = {"am_ppo_sr": ("am", True), "am_ppo": ("am", False), "rm_ppo": ("rm", False)}
TIE_MARGIN = 0.1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--output-dir", default="demo_output", help="where everything goes")
    parser.add_argument("--ppo-steps", type=int, default=PPO["steps"])
    parser.add_argument("--overwrite", action="store_true", help="replace --output-dir")
    return parser


class Demo:
    def __init__(self, out: Path):
        self.out = out
        self.started = time.time()
        self.stage = 0

    def begin(self, title: str) -> float:
        self.stage += 1
        print(f"\n=== [{self.stage}/{STAGES}] {title}", flush=True)
        return time.time()

    def done(self, started: float, what: str) -> None:
        print(f"    -> {what} ({time.time() - started:.1f} s)", flush=True)


def main(argv: list[str]) -> int:
    from megatron_rlhf.study.run import set_threads

    args = build_parser().parse_args(argv)
    try:
        out = check_output_dir(args.output_dir, args.overwrite)
    except InputError as err:
        print(f"demo: error: {err}", file=sys.stderr)
        return 2
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_threads(1)
    demo = Demo(out)
    data = stage_data(demo)
    sft = stage_sft(demo, data)
    rewards = stage_reward_models(demo, sft, data)
    rehearsal = stage_curation(demo, sft, rewards["am"], data)
    runs = stage_ppo(demo, sft, rewards, data, rehearsal, args.ppo_steps)
    table = stage_evaluation(demo, runs, sft, rewards, data)
    print_summary(
        "demo",
        seconds=round(time.time() - demo.started, 1),
        am_ppo_sr_main_net_win=round(table["am_ppo_sr"]["main"]["net_win"], 1),
        am_ppo_sr_forget_net_win=round(table["am_ppo_sr"]["forget"]["net_win"], 1),
        outputs=str(out),
        report=str(out / "gold_judgments.md"),
    )
    return 0


def stage_data(demo: Demo) -> dict:
    from megatron_rlhf.study import stages, world

    started = demo.begin("tokenizer: byte-level BPE from the world's text")
    raw = demo.out / "raw"
    raw.mkdir()
    records = world.world_records(world.WorldSizes(
        sft_per_task=SIZES["sft"], pref_train_per_task=SIZES["pref_train"],
        pref_test_per_task=SIZES["pref_test"], ppo_prompts=SIZES["ppo_prompts"],
        main_test_per_task=SIZES["main_test"], forget_test_per_task=SIZES["forget_test"],
    ))  # fmt: skip
    for name, rows in records.items():
        write_jsonl(raw / f"{name}.jsonl", rows)
    texts = [r["prompt"] + r["response"] for r in records["sft"]]
    texts += [r["prompt"] + r["chosen"] for r in records["pref_train"]]
    tokenizer = stages.build_tokenizer(texts, demo.out / "tokenizer", vocab_size=600)
    demo.done(started, str(tokenizer))

    started = demo.begin("data: world prompts, SFT demonstrations, labelled pairs -> indexed")
    indexed = demo.out / "data"
    for name, kind in (("sft", "sft"), ("pref_train", "preference"),
                       ("pref_test", "preference"), ("ppo_prompts", "prompt")):  # fmt: skip
        stages.preprocess(raw / f"{name}.jsonl", kind, tokenizer, indexed / name, 96)
    demo.done(started, f"indexed datasets in {indexed}")
    # one generation budget above the longest demonstration of every family (PPO, D_R, eval)
    budget = stages.generation_budget(tokenizer, records["sft"])["budget"]
    return {"raw": raw, "indexed": indexed, "tokenizer": tokenizer, "budget": budget,
            "eos_id": stages.eos_id_of(tokenizer)}  # fmt: skip


def stage_sft(demo: Demo, data: dict) -> Path:
    from megatron_rlhf.study.stages import train_sft_policy

    started = demo.begin("SFT policy: train-sft on a random tiny BLOOM")
    hf_dir, losses = train_sft_policy(
        data["indexed"] / "sft", demo.out / "sft", hidden=64, layers=2, heads=4, steps=150,
        lr=3e-3, batch_size=32, max_length=96,
    )  # fmt: skip
    demo.done(started, f"NLL {losses[0]:.2f} -> {losses[-1]:.2f}; {hf_dir}")
    return hf_dir


def stage_reward_models(demo: Demo, sft: Path, data: dict) -> dict:
    from megatron_rlhf.reward.evaluate import main as eval_reward
    from megatron_rlhf.study.stages import run_command, score_pairs, train_reward_model

    started = demo.begin("RM and AM: train-reward (loss: rm, loss: am) from the SFT trunk")
    checkpoints = {}
    for loss in ("rm", "am"):
        run_dir = demo.out / loss
        checkpoints[loss] = train_reward_model(
            loss=loss, sft=sft, train_prefix=data["indexed"] / "pref_train", out=run_dir,
            epochs=1, lr=1e-3, global_batch_size=16, seed=0,
        )  # fmt: skip
        pairs = score_pairs(checkpoints[loss], data["raw"] / "pref_test.jsonl", data["tokenizer"],
                            run_dir / "heldout_scores.jsonl")  # fmt: skip
        run_command(eval_reward, ["--scores", pairs, "--output-dir", run_dir / "eval"])
    demo.done(started, f"{checkpoints['rm']} and {checkpoints['am']}; reports in */eval")
    return checkpoints


def stage_curation(demo: Demo, sft: Path, am: Path, data: dict) -> Path:
    from megatron_rlhf.study import stages

    started = demo.begin("curation: SFT responses, AM scores, FAISS clusters, top-k -> D_R")
    work = demo.out / "rehearsal"
    work.mkdir()
    responses = stages.generate_responses(sft, data["raw"] / "ppo_prompts.jsonl",
                                          work / "sft_responses.jsonl", data["budget"],
                                          seed=0)  # fmt: skip
    scored = stages.score_responses(am, responses, data["tokenizer"], work / "scored.jsonl")
    prefix = stages.build_rehearsal(scored, data["tokenizer"], work / "d_r", clusters=4,
                                    top_k=8, seed=0)  # fmt: skip
    demo.done(started, f"rehearsal set {prefix} (report: {prefix}.report.json)")
    return prefix


def arm_dir(out: Path, arm: str) -> Path:
    """AM-PPO-SR keeps the demo's historical ``ppo/``; the other arms sit beside it."""
    return out / ("ppo" if arm == "am_ppo_sr" else f"ppo_{arm}")


def stage_ppo(demo, sft: Path, rewards: dict, data: dict, rehearsal: Path, steps: int) -> dict:
    from megatron_rlhf.study.stages import train_policy

    started = demo.begin("PPO: AM-PPO-SR, AM-PPO and RM-PPO (same beta, lr and steps)")
    runs = {}
    for arm, (reward, with_rehearsal) in ARMS.items():
        runs[arm] = train_policy(
            out=arm_dir(demo.out, arm), sft=sft, reward=rewards[reward], reward_kind=reward,
            prompts=data["indexed"] / "ppo_prompts", seed=0,
            settings={**PPO, "steps": steps, "max_new_tokens": data["budget"]},
            rehearsal=rehearsal if with_rehearsal else None,
            clusters=rehearsal if with_rehearsal else None,
        )  # fmt: skip
    demo.done(started, ", ".join(str(run) for run in runs.values()))
    return runs


def stage_evaluation(demo: Demo, runs: dict, sft: Path, rewards: dict, data: dict) -> dict:
    from megatron_rlhf.study.stages import evaluate_policy
    from megatron_rlhf.study.stats import gains, outcome_rates

    started = demo.begin("evaluation: each arm vs SFT (main and forget sets), gold-judged")
    table = {}
    for arm, run_dir in runs.items():
        reward = ARMS[arm][0]
        eval_dir = demo.out / ("eval" if arm == "am_ppo_sr" else f"eval_{arm}")
        judgments = evaluate_policy(
            policy=run_dir, sft=sft, judge=rewards[reward], judge_kind=reward,
            main_test=data["raw"] / "main_test.jsonl",
            forget_test=data["raw"] / "forget_test.jsonl", out=eval_dir,
            max_new_tokens=data["budget"], seed=1000, tie_margin=TIE_MARGIN,
            eos_id=data["eos_id"],
        )  # fmt: skip
        write_jsonl(eval_dir / "judgments.jsonl", judgments)
        table[arm] = {}
        for set_name in ("main", "forget"):
            rows = [j for j in judgments if j["set"] == set_name]
            table[arm][set_name] = {**outcome_rates(rows), **gains(rows)}
    report = gold_table(table)
    (demo.out / "gold_judgments.md").write_text(report, encoding="utf-8")
    (demo.out / "gold_judgments.json").write_text(json.dumps(table, indent=2), encoding="utf-8")
    print(report)
    demo.done(started, str(demo.out / "gold_judgments.md"))
    return table


def gold_table(table: dict) -> str:
    lines = ["Each arm vs SFT, judged by the gold reward (percent; one seed, so noisy: see "
             "`study` for intervals). Hacking index = training-reward gain - gold gain (SFT-std "
             "units, per task, averaged). Cut: responses that reached the generation budget "
             "without their EOS.", "", "| arm | main W/T/L | main net | forget W/T/L | "
             "forget net | hacking index (main) | cut % (policy main / forget) |",
             "|---|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for arm, sets in table.items():
        cells = [arm]
        for set_name in ("main", "forget"):
            row = sets[set_name]
            cells += [f"{row['win']:.0f}/{row['tie']:.0f}/{row['lose']:.0f}",
                      f"{row['net_win']:+.1f}"]  # fmt: skip
        cells.append(f"{sets['main']['hacking_index']:+.2f}")
        cells.append(f"{sets['main']['truncated_policy']:.0f} / "
                     f"{sets['forget']['truncated_policy']:.0f}")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
