"""``python -m megatron_rlhf study --preset quick|full --output-dir DIR [--seeds N]``.

The paper's claims measured in a text world with a known gold reward (``study/world.py``), every
stage a real command run in this one process:

  data        world prompts, disjoint train / held-out sets, BPE tokenizer, indexed files
  SFT         one tiny BLOOM fine-tuned on all five task families (shared by every seed)
  reward      per seed: RM and AM (Table 1), an over-trained RM and AM, AM margins m
              -> held-out pairs scored: accuracy, ECE, Brier against the known p (Fig. 2, 4)
  curation    per seed: SFT responses to the PPO prompts, AM scores, FAISS clusters -> D_R
              (the main c, k; Fig. 6's c sweep at fixed k and at fixed c*k; a random D_R)
  PPO arms    per seed: rm_ppo, rm_ppo_ma, am_ppo, am_ppo_sr, rm_ppo_sr, rejection_sampling,
              am_ppo_rr (random rehearsal) and the sweep arms; same beta, lr and steps
  judging     eval-policy vs SFT on the main and forget sets, every response re-judged by the
              gold reward (win/tie/lose with a tie margin), and by the arm's own reward
  report      results.json (``stats.results_from_records`` over the raw records), report.md,
              PNGs

What varies with the seed: the reward models' head init and data order, k-means seeding, PPO
sampling and evaluation sampling. The world, the SFT policy and the SFT responses D_R is curated
from are shared (they are the "given" of the paper's recipe).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from megatron_rlhf.study import stages, world
from megatron_rlhf.study.presets import PRESETS, Preset
from megatron_rlhf.utils import print_summary, write_json, write_jsonl

DEFAULT_MARGIN = 2.5
# arm -> (reward model, PPO options); rehearsal: "main" | "random" | (c, k)
ARMS = {
    "rm_ppo": ("rm", {}),
    "rm_ppo_ma": ("rm", {"normalization": "moving_average"}),
    "am_ppo": ("am", {}),
    "am_ppo_sr": ("am", {"rehearsal": "main"}),
    "rm_ppo_sr": ("rm", {"rehearsal": "main"}),
    "rejection_sampling": ("am", {"algorithm": "rejection_sampling"}),
    "am_ppo_rr": ("am", {"rehearsal": "random"}),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--output-dir", required=True, help="where everything goes")
    parser.add_argument("--seeds", type=int, help="number of seeds (default: the preset's, 3)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output-dir")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset]
    if args.seeds is not None:
        if args.seeds < 1:
            print("study: error: --seeds must be >= 1", file=sys.stderr)
            return 2
        preset = replace(preset, seeds=args.seeds, sweep_seeds=min(preset.sweep_seeds, args.seeds))
    out = Path(args.output_dir)
    if out.exists():
        if not args.overwrite:
            print(f"study: error: {out} exists; pass --overwrite or another --output-dir",
                  file=sys.stderr)  # fmt: skip
            return 2
        shutil.rmtree(out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_threads(preset.threads)
    started, cpu_started = time.time(), time.process_time()
    results = run_study(out, preset, args.preset)
    table2 = results["table2"]
    print_summary(
        "study",
        preset=args.preset,
        seeds=preset.seeds,
        rm_ece=round(results["table1"]["rm"]["ece"]["mean"], 2),
        am_ece=round(results["table1"]["am"]["ece"]["mean"], 2),
        am_ppo_sr_net_win_main=round(table2["am_ppo_sr"]["main"]["net_win"], 1),
        am_ppo_sr_net_win_forget=round(table2["am_ppo_sr"]["forget"]["net_win"], 1),
        seconds=round(time.time() - started, 1),
        cpu_seconds=round(time.process_time() - cpu_started, 1),
        report=str(out / "report.md"),
    )
    return 0


def set_threads(threads: int) -> None:
    """Tiny models run faster on one intra-op thread: their ops are too small to split, and
    on a shared machine idle OpenMP workers spin (measured: 10x less CPU per SFT step)."""
    import torch

    torch.set_num_threads(threads)


class Progress:
    def __init__(self):
        self.started = time.time()

    def stage(self, title: str) -> None:
        print(f"\n=== study [{time.time() - self.started:7.1f} s] {title}", flush=True)


def run_study(out: Path, preset: Preset, preset_name: str) -> dict:
    from megatron_rlhf.study.report import write_report

    progress, cpu_started = Progress(), time.process_time()
    progress.stage("data: world prompts, tokenizer, indexed files")
    data = prepare_data(out, preset)
    progress.stage("SFT policy (shared by every seed)")
    sft, sft_losses = stages.train_sft_policy(
        data["indexed"] / "sft", out / "sft", hidden=preset.hidden, layers=preset.layers,
        heads=preset.heads, steps=preset.sft_steps, lr=preset.sft_lr,
        batch_size=preset.sft_batch, max_length=preset.max_length,
    )  # fmt: skip
    progress.stage("SFT responses to the PPO prompts (the pool D_R is curated from)")
    sft_responses = stages.generate_responses(sft, data["raw"] / "ppo_prompts.jsonl",
                                              out / "rehearsal" / "sft_responses.jsonl",
                                              preset.ppo["max_new_tokens"], seed=0)  # fmt: skip
    for seed in range(preset.seeds):
        progress.stage(f"seed {seed}: reward models")
        rewards = reward_stage(out, preset, data, sft, seed)
        progress.stage(f"seed {seed}: curation (D_R)")
        rehearsal = curation_stage(out, preset, data, sft_responses, rewards["am"], seed)
        for arm, (reward_name, options) in arms_of(preset, seed).items():
            progress.stage(f"seed {seed}: PPO arm {arm}")
            run_arm(out, preset, data, sft, rewards[reward_name], reward_name, rehearsal,
                    arm, options, seed)  # fmt: skip
    progress.stage("report")
    results = compute_results(out)
    results["settings"] = {"preset": preset_name, **asdict(preset), "sft_losses": sft_losses,
                           "data": data["summary"], "seconds": time.time() - progress.started,
                           "cpu_seconds": time.process_time() - cpu_started}  # fmt: skip
    write_json(out / "results.json", results)
    write_report(out, results)
    return results


# ---------------------------------------------------------------- data


def prepare_data(out: Path, preset: Preset) -> dict:
    raw, indexed = out / "data", out / "data" / "indexed"
    indexed.mkdir(parents=True)
    ppo = {t: preset.ppo_prompts_per_task for t in world.PPO_TASKS}
    sets = world.split_prompts({
        "sft": dict.fromkeys(world.TASK_SPECS, preset.sft_per_task),
        "pref_train": dict.fromkeys(world.PPO_TASKS, preset.pref_train_per_task),
        "pref_test": dict.fromkeys(world.PPO_TASKS, preset.pref_test_per_task),
        "ppo_prompts": ppo,
        "main_test": dict.fromkeys(world.PPO_TASKS, preset.main_test_per_task),
        "forget_test": {world.FORGET_TASK: preset.forget_test},
    }, seed=0)  # fmt: skip
    training = [sets[name] for name in ("sft", "pref_train", "pref_test", "ppo_prompts")]
    overlap = {name: world.check_disjoint(sets[name], training)
               for name in ("main_test", "forget_test")}  # fmt: skip
    if any(overlap.values()):
        raise SystemExit(f"held-out prompts overlap the training prompts: {overlap}")
    style = world.ResponseStyle()
    records = {
        "sft": world.sft_records(sets["sft"], seed=1, style=style),
        "pref_train": world.preference_records(sets["pref_train"], seed=2, style=style),
        "pref_test": world.preference_records(sets["pref_test"], seed=3, style=style),
    }
    for name in ("ppo_prompts", "main_test", "forget_test"):
        records[name] = sets[name]
    for name, rows in records.items():
        write_jsonl(raw / f"{name}.jsonl", rows)
    texts = [r["prompt"] + r["response"] for r in records["sft"]]
    texts += [r["prompt"] + r["chosen"] for r in records["pref_train"]]
    tokenizer = stages.build_tokenizer(texts, out / "tokenizer", preset.vocab_size)
    for name, kind in (("sft", "sft"), ("pref_train", "preference"), ("ppo_prompts", "prompt")):
        stages.preprocess(raw / f"{name}.jsonl", kind, tokenizer, indexed / name,
                          preset.max_length)  # fmt: skip
    summary = {name: len(rows) for name, rows in records.items()}
    summary["held_out_overlap"] = overlap
    summary["oracle_accuracy_pref_test"] = 100.0 * world.bayes_accuracy(records["pref_test"])
    return {"raw": raw, "indexed": indexed, "tokenizer": tokenizer, "summary": summary}


# ---------------------------------------------------------------- reward models


def reward_models(preset: Preset) -> dict:
    """name -> (loss, epochs, margin): Table 1's pair, the over-trained pair, the margin sweep."""
    models = {
        "rm": ("rm", preset.reward_epochs, None),
        "am": ("am", preset.reward_epochs, DEFAULT_MARGIN),
        "rm_long": ("rm", preset.long_epochs, None),
        "am_long": ("am", preset.long_epochs, DEFAULT_MARGIN),
    }
    for margin in preset.margins:
        models[f"am_m{margin:g}"] = ("am", preset.reward_epochs, margin)
    return models


def reward_stage(out: Path, preset: Preset, data: dict, sft: Path, seed: int) -> dict:
    checkpoints = {}
    for name, (loss, epochs, margin) in reward_models(preset).items():
        run_dir = out / "reward" / name / f"seed{seed}"
        checkpoints[name] = stages.train_reward_model(
            loss=loss, sft=sft, train_prefix=data["indexed"] / "pref_train", out=run_dir,
            epochs=epochs, lr=preset.reward_lr, global_batch_size=preset.reward_batch,
            seed=seed, margin=margin,
        )  # fmt: skip
        stages.score_pairs(checkpoints[name], data["raw"] / "pref_test.jsonl", data["tokenizer"],
                           run_dir / "pairs.jsonl")  # fmt: skip
    return checkpoints


# ---------------------------------------------------------------- curation and arms


def curation_stage(out: Path, preset: Preset, data: dict, sft_responses: Path, am: Path,
                   seed: int) -> dict:  # fmt: skip
    """D_R prefixes: "main" (c, k), "random" (same size), and (c, k) of Fig. 6's sweep."""
    work = out / "rehearsal" / f"seed{seed}"
    work.mkdir(parents=True)
    scored = stages.score_responses(am, sft_responses, data["tokenizer"], work / "scored.jsonl")
    c, k = preset.clusters, preset.top_k
    build = dict(tokenizer=data["tokenizer"], seed=seed)
    sets = {"main": stages.build_rehearsal(scored, prefix=work / "d_r", clusters=c, top_k=k,
                                           **build)}  # fmt: skip
    sets["random"] = stages.build_random_rehearsal(scored, data["tokenizer"], work / "random",
                                                   c * k, seed)  # fmt: skip
    if seed < preset.sweep_seeds and preset.sweep_clusters:
        others = [count for count in preset.sweep_clusters if count != c]
        stages.build_rehearsal(scored, prefix=work / "fixed_k", clusters=others, top_k=k, **build)
        for count in others:
            sets[(count, k)] = work / f"fixed_k_c{count}"
            per_cluster = max(1, c * k // count)
            sets[(count, per_cluster)] = stages.build_rehearsal(
                scored, prefix=work / f"fixed_ck_c{count}", clusters=count, top_k=per_cluster,
                **build,
            )  # fmt: skip
    return sets


def sweep_arm(clusters: int, top_k: int) -> str:
    return f"am_ppo_sr_c{clusters}_k{top_k}"


def arms_of(preset: Preset, seed: int) -> dict:
    arms = dict(ARMS)
    if seed < preset.sweep_seeds and preset.sweep_clusters:
        c, k = preset.clusters, preset.top_k
        for count in preset.sweep_clusters:
            if count != c:
                arms[sweep_arm(count, k)] = ("am", {"rehearsal": (count, k)})
                arms[sweep_arm(count, max(1, c * k // count))] = (
                    "am", {"rehearsal": (count, max(1, c * k // count))})  # fmt: skip
    return arms


def run_arm(out, preset, data, sft, reward, reward_name, rehearsal, arm, options, seed) -> None:
    run_dir = out / "ppo" / arm / f"seed{seed}"
    reward_kind = "am" if reward_name.startswith("am") else "rm"
    which = options.get("rehearsal")
    rehearsal_set = rehearsal[which] if which is not None else None
    clusters = rehearsal["main"] if which == "main" else None
    stages.train_policy(out=run_dir, sft=sft, reward=reward, reward_kind=reward_kind,
                        prompts=data["indexed"] / "ppo_prompts", settings=preset.ppo, seed=seed,
                        rehearsal=rehearsal_set, clusters=clusters,
                        algorithm=options.get("algorithm", "ppo"),
                        normalization=options.get("normalization", "none"))  # fmt: skip
    judgments = stages.evaluate_policy(
        policy=run_dir, sft=sft, judge=reward, judge_kind=reward_kind,
        main_test=data["raw"] / "main_test.jsonl", forget_test=data["raw"] / "forget_test.jsonl",
        out=run_dir / "eval", max_new_tokens=preset.ppo["max_new_tokens"], seed=1000 + seed,
        tie_margin=preset.tie_margin,
    )  # fmt: skip
    write_jsonl(run_dir / "judgments.jsonl", judgments)
    for step_dir in run_dir.glob("step_*"):  # the arm is judged; its weights are not needed
        shutil.rmtree(step_dir)


# ---------------------------------------------------------------- results


def load_records(out: Path) -> tuple[dict, dict]:
    """``pairs[model][seed]`` and ``judgments[arm][seed]`` from the raw records under ``out``."""
    pairs, judgments = {}, {}
    for kind, table, name in (("reward", pairs, "pairs.jsonl"),
                              ("ppo", judgments, "judgments.jsonl")):  # fmt: skip
        for path in sorted((out / kind).glob(f"*/seed*/{name}")):
            seed = int(path.parent.name.removeprefix("seed"))
            table.setdefault(path.parent.parent.name, {})[seed] = stages.read_records(path)
    return pairs, judgments


def compute_results(out: Path) -> dict:
    from megatron_rlhf.study.stats import results_from_records

    return results_from_records(*load_records(out))
