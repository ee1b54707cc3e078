"""``python -m megatron_rlhf study --preset quick|full --output-dir DIR [--seeds N] [--jobs N]``.

The paper's claims measured in a text world with a known gold reward (``study/world.py``), every
stage a real command run in-process (world size 1); the per-seed stages run in --jobs worker
processes:

  data        world prompts, disjoint train / held-out sets, BPE tokenizer, indexed files
              (``world.world_records``: who sees which family)
  SFT         one tiny BLOOM fine-tuned on all five task families (shared by every seed)
  reward      per seed: RM and AM (Table 1); on the first extra_reward_seeds also an
              over-trained RM and AM and AM margins m
              -> held-out pairs scored: accuracy, ECE, Brier against the known p (Fig. 2, 4)
  curation    per seed: SFT responses to the PPO prompts, AM scores, FAISS clusters -> D_R
              (the main c, k), the same clusters' top-k by the gold utility (the ceiling of
              selection), a random D_R of equal size; on the exploratory seeds SFT
              demonstrations of all five families (the positive control); on the sweep
              seeds Fig. 6's c sweep at fixed k and at fixed c*k. Every D_R's records (family,
              form, topic, "because", band, utility) go into the archive
  PPO arms    per seed the core (``ARMS``): rm_ppo, rm_ppo_ma, am_ppo, am_ppo_sr, am_ppo_rr
              (random rehearsal), am_ppo_sr_gold (gold top-k), null (0 PPO steps); on the
              exploratory seeds ``exploratory_arms``: rm_ppo_sr, rejection_sampling,
              am_ppo_sft (positive control), the gamma dose and RM-PPO / AM-PPO at each
              setting of the PPO grid; the sweep arms. Same beta, lr and steps unless an arm
              says otherwise; every critic from the SFT trunk
  judging     eval-policy vs SFT on the main and forget sets, every response re-judged by the
              gold reward (win/tie/lose with a tie margin), and by the arm's own reward
  report      results.json (``stats.results_from_records`` over the raw records: the tables
              and the claims of ``study/claims.py``, Holm-corrected), report.md, PNGs, and
              records.jsonl.gz:
              every raw record the tables come from, with the settings; ``--from-records``
              recomputes every table from that file alone

Every generation (PPO, D_R's SFT responses, evaluation) gets one budget above the longest SFT
demonstration of every family (``stages.generation_budget``).

What varies with the seed: the reward models' head init and data order, k-means seeding, PPO
sampling and evaluation sampling. The world, the SFT policy and the SFT responses D_R is curated
from are shared (they are the "given" of the paper's recipe).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from megatron_rlhf.study import stages, world
from megatron_rlhf.study.claims import CLAIMS_VERSION
from megatron_rlhf.study.presets import (
    PRESETS,
    Preset,
    runs_exploratory,
    runs_extra_rewards,
    runs_sweep,
    seed_range,
)
from megatron_rlhf.study.stages import RECORDS_ARCHIVE
from megatron_rlhf.utils import (
    InputError,
    atomic_output,
    check_output_dir,
    print_summary,
    write_json,
    write_jsonl,
)

DEFAULT_MARGIN = 2.5
# arm -> (reward model, PPO options); rehearsal: a D_R of ``curation_stage`` ("main", "random",
# "gold", "sft" or (c, k)); ppo: settings that differ from the preset's
ARMS = {
    "rm_ppo": ("rm", {}),
    "rm_ppo_ma": ("rm", {"normalization": "moving_average"}),
    "am_ppo": ("am", {}),
    "am_ppo_sr": ("am", {"rehearsal": "main"}),
    "am_ppo_rr": ("am", {"rehearsal": "random"}),
    "am_ppo_sr_gold": ("am", {"rehearsal": "gold"}),
    "null": ("am", {"algorithm": "none"}),  # 0 PPO steps: the SFT policy judged against itself
}
"""The core arms: every seed runs them."""


def grid_arm(reward: str, settings: dict) -> str:
    """``rm_ppo_lr3e-4_s10``: the name of RM-PPO or AM-PPO at one setting of the PPO grid."""
    parts = [f"lr{settings['actor_lr']:.0e}".replace("e-0", "e-")] if "actor_lr" in settings else []
    parts += [f"s{settings['steps']}"] if "steps" in settings else []
    return "_".join([f"{reward}_ppo", *parts])


def exploratory_arms(preset: Preset) -> dict:
    """The arms of the exploratory seeds: rehearsal on RM-PPO, rejection sampling, the positive
    control (rehearsal on SFT demonstrations of every family), the gamma dose of AM-PPO-SR, and
    RM-PPO and AM-PPO at every other setting of the PPO grid."""
    arms = {
        "rm_ppo_sr": ("rm", {"rehearsal": "main"}),
        "rejection_sampling": ("am", {"algorithm": "rejection_sampling"}),
        "am_ppo_sft": ("am", {"rehearsal": "sft"}),
    }
    for gamma in preset.gammas:
        arms[f"am_ppo_sr_g{gamma:g}"] = ("am", {"rehearsal": "main",
                                                "ppo": {"rehearsal_gamma": gamma}})  # fmt: skip
    for settings in preset.ppo_grid:
        for reward in ("rm", "am"):
            arms[grid_arm(reward, settings)] = (reward, {"ppo": dict(settings)})
    return arms


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--output-dir", required=True, help="where everything goes")
    parser.add_argument(
        "--seeds", type=int, help="number of seeds (default: the preset's: quick 3, full 40)"
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds are FIRST .. FIRST + N - 1 (a development set that does not "
        "overlap the reporting seeds 0 .. N - 1: e.g. 100)",
    )
    parser.add_argument("--ppo", action="append", default=[], metavar="KEY=VALUE",
                        help="override one of the PPO settings every arm shares (repeatable; "
                             "e.g. --ppo actor_lr=3e-4 --ppo steps=20); the keys are the "
                             "preset's ppo keys")  # fmt: skip
    parser.add_argument("--exploratory-seeds", type=int,
                        help="how many of the seeds run the exploratory part (default: the "
                             "preset's: quick 1, full 10; 0 runs the core only)")  # fmt: skip
    parser.add_argument("--sweep-seeds", type=int,
                        help="how many of the seeds run Fig. 6's cluster sweep (default: the "
                             "preset's; 0 skips it, e.g. on development seeds)")  # fmt: skip
    parser.add_argument("--jobs", type=int,
                        help="worker processes for the per-seed stages (default: min(seeds, "
                             "CPUs)); the results do not depend on it")  # fmt: skip
    parser.add_argument("--from-records", metavar="ARCHIVE",
                        help="run nothing: recompute results.json, report.md and the PNGs in "
                             f"--output-dir from a study's raw records (its {RECORDS_ARCHIVE}, "
                             "e.g. docs/paper_study's)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace --output-dir")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset]
    if args.seeds is not None:
        if args.seeds < 1:
            print("study: error: --seeds must be >= 1", file=sys.stderr)
            return 2
        preset = replace(
            preset,
            seeds=args.seeds,
            sweep_seeds=min(preset.sweep_seeds, args.seeds),
            exploratory_seeds=min(preset.exploratory_seeds, args.seeds),
            extra_reward_seeds=min(preset.extra_reward_seeds, args.seeds),
        )
    if args.first_seed < 0:
        print("study: error: --first-seed must be >= 0", file=sys.stderr)
        return 2
    try:
        ppo = ppo_overrides(preset.ppo, args.ppo)
    except ValueError as err:
        print(f"study: error: {err}", file=sys.stderr)
        return 2
    preset = replace(preset, first_seed=args.first_seed, ppo=ppo)
    if args.sweep_seeds is not None:
        if args.sweep_seeds < 0:
            print("study: error: --sweep-seeds must be >= 0", file=sys.stderr)
            return 2
        preset = replace(preset, sweep_seeds=min(args.sweep_seeds, preset.seeds))
    if args.exploratory_seeds is not None:
        if args.exploratory_seeds < 0:
            print("study: error: --exploratory-seeds must be >= 0", file=sys.stderr)
            return 2
        preset = replace(preset, exploratory_seeds=min(args.exploratory_seeds, preset.seeds))
    jobs = args.jobs if args.jobs is not None else min(preset.seeds, os.cpu_count() or 1)
    if jobs < 1:
        print("study: error: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:
        out = check_output_dir(args.output_dir, args.overwrite)
    except InputError as err:
        print(f"study: error: {err}", file=sys.stderr)
        return 2
    if out.exists():
        shutil.rmtree(out)
    if args.from_records:
        return recompute(Path(args.from_records), out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_threads(preset.threads)
    started, cpu_started = time.time(), cpu_seconds()
    results = run_study(out, preset, args.preset, jobs)
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
        cpu_seconds=round(cpu_seconds() - cpu_started, 1),
        jobs=jobs,
        report=str(out / "report.md"),
    )
    return 0


def recompute(archive: Path, out: Path) -> int:
    """results.json, report.md and the PNGs from ``archive``'s records and settings alone,
    built in a temporary directory that becomes ``out`` only when everything is written."""
    from megatron_rlhf.study.report import write_report
    from megatron_rlhf.study.stats import results_from_records

    try:
        settings, pairs, judgments, rehearsal = stages.unpack_records(archive)
        with atomic_output(out) as tmp:
            tmp.mkdir()
            results = {**results_from_records(pairs, judgments, rehearsal), "settings": settings}
            write_json(tmp / "results.json", results)
            write_report(tmp, results, pairs)
    except InputError as err:
        print(f"study: error: {err}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as err:  # a field missing or of the wrong type
        print(f"study: error: {archive}: a record or the settings line does not have the "
              f"study's fields ({type(err).__name__}: {err}); recompute only from an archive "
              "that `study` wrote", file=sys.stderr)  # fmt: skip
        return 2
    print_summary("study", recomputed_from=str(archive), seeds=settings["seeds"],
                  models=len(pairs), arms=len(judgments), report=str(out / "report.md"))  # fmt: skip
    return 0


def ppo_overrides(settings: dict, items: list[str]) -> dict:
    """``settings`` with each ``KEY=VALUE`` of ``--ppo`` applied, the value parsed as the
    setting's type (int or float; ``max_new_tokens``: an int, or ``none`` for the data's
    budget). Raises ValueError naming the flag for an unknown key or a bad value."""
    settings = dict(settings)
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in settings:
            raise ValueError(f"--ppo {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(sorted(settings))}")  # fmt: skip
        kind = int if key == "max_new_tokens" else type(settings[key])
        try:
            settings[key] = (
                None if key == "max_new_tokens" and text.lower() == "none" else kind(text)
            )
        except ValueError:
            raise ValueError(f"--ppo {item!r}: {text!r} is not a valid {kind.__name__}") from None
    return settings


def set_threads(threads: int) -> None:
    """Tiny models run faster on one intra-op thread: their ops are too small to split, and
    on a shared machine idle OpenMP workers spin (measured: 10x less CPU per SFT step)."""
    import torch

    torch.set_num_threads(threads)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the --jobs workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class Progress:
    def __init__(self, started: float | None = None):
        self.started = time.time() if started is None else started

    def stage(self, title: str) -> None:
        print(f"\n=== study [{time.time() - self.started:7.1f} s] {title}", flush=True)


def run_study(out: Path, preset: Preset, preset_name: str, jobs: int = 1) -> dict:
    from megatron_rlhf.study.report import write_report
    from megatron_rlhf.study.stats import results_from_records

    progress, cpu_started = Progress(), cpu_seconds()
    started = code_provenance(progress.started)  # the code as it is when the run starts
    progress.stage("data: world prompts, tokenizer, indexed files")
    data = prepare_data(out, preset)
    # every generation (D_R's SFT responses, PPO rollouts, evaluation) gets the data's budget:
    # above the longest demonstration of every family, so the budget never decides a verdict
    if preset.ppo["max_new_tokens"] is None:  # unless --ppo max_new_tokens=N chose one
        preset = replace(preset, ppo={**preset.ppo, "max_new_tokens": data["budget"]["budget"]})
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
    shared = Shared(out=out, preset=preset, data=data, sft=sft, sft_responses=sft_responses,
                    started=progress.started)  # fmt: skip
    _, task_seconds = run_tasks(shared, seed_tasks(preset), jobs)
    progress.stage("report")
    pairs, judgments, rehearsal = stages.load_records(out)
    results = results_from_records(pairs, judgments, rehearsal)
    results["settings"] = {"preset": preset_name, **asdict(preset), "sft_losses": sft_losses,
                           "claims_version": CLAIMS_VERSION, **started,
                           "data": data["summary"], "jobs": jobs,
                           "seconds": time.time() - progress.started,
                           "cpu_seconds": cpu_seconds() - cpu_started,
                           "part_seconds": part_seconds(task_seconds)}  # fmt: skip
    write_json(out / "results.json", results)
    write_report(out, results, pairs)
    stages.pack_records(results["settings"], pairs, judgments, rehearsal, out / RECORDS_ARCHIVE)
    return results


PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The directory that holds ``megatron_rlhf/``: a git checkout's root when run from one."""


def code_provenance(started: float, root: Path = PACKAGE_ROOT) -> dict:
    """What a run records about when it started and from which code (results.json
    ``settings``), so a reader can order it against the commits that fixed its design:
    ``started_utc`` (ISO 8601, UTC), ``git_commit`` (HEAD of the checkout ``root`` is the top
    of) and ``git_dirty`` (whether tracked files differ from it: untracked ones, such as a run's
    own output directory, do not count), or, where ``root`` is not the top of a git checkout
    (an installed package) or git is missing, both None and ``git`` saying why."""
    when = datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")
    info = {"started_utc": when, "git_commit": None, "git_dirty": None}

    def git(*args: str) -> str:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=60, check=True)  # fmt: skip
        return proc.stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if Path(top).resolve() != root.resolve():
            return {**info, "git": f"not a git checkout ({root} is inside {top}, not its top)"}
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except FileNotFoundError:
        return {**info, "git": "git not found"}
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return {**info, "git": f"not a git checkout ({root})"}
    return {**info, "git_commit": commit, "git_dirty": dirty}


# ---------------------------------------------------------------- per-seed tasks

Task = tuple[str, int, str]
"""``("reward", seed, model)``, ``("curation", seed, "")`` or ``("arm", seed, arm)``."""


@dataclass(frozen=True)
class Shared:
    """What every per-seed task reads: the shared stages' outputs."""

    out: Path
    preset: Preset
    data: dict
    sft: Path
    sft_responses: Path
    started: float
    """The study's start (progress lines count from it)."""


def seed_tasks(preset: Preset) -> dict[Task, tuple[Task, ...]]:
    """Every per-seed task -> the tasks whose results it needs, in an order that runs."""
    tasks = {}
    for seed in seed_range(preset):
        for name in reward_models(preset, seed):
            tasks[("reward", seed, name)] = ()
        tasks[("curation", seed, "")] = (("reward", seed, "am"),)
        for arm, (reward_name, options) in arms_of(preset, seed).items():
            needs = (("reward", seed, reward_name),)
            if "rehearsal" in options:
                needs += (("curation", seed, ""),)
            tasks[("arm", seed, arm)] = needs
    return tasks


def task_title(task: Task) -> str:
    kind, seed, name = task
    what = {
        "reward": f"reward model {name}",
        "curation": "curation (D_R)",
        "arm": f"PPO arm {name}",
    }
    return f"seed {seed}: {what[kind]}"


def run_task(shared: Shared, task: Task, inputs: dict) -> tuple[object, float]:
    """One task (in this process or a worker); ``inputs`` are the results of its needs.
    Returns its result and its wall seconds."""
    kind, seed, name = task
    started = time.time()
    Progress(shared.started).stage(task_title(task))
    out, preset, data, sft = shared.out, shared.preset, shared.data, shared.sft
    if kind == "reward":
        result = reward_stage(out, preset, data, sft, seed, name)
    elif kind == "curation":
        am = inputs[("reward", seed, "am")]
        result = curation_stage(out, preset, data, shared.sft_responses, am, seed)
    else:
        reward_name, options = arms_of(preset, seed)[name]
        rehearsal = inputs.get(("curation", seed, ""))
        run_arm(out, preset, data, sft, inputs[("reward", seed, reward_name)], reward_name,
                rehearsal, name, options, seed)  # fmt: skip
        result = None
    return result, time.time() - started


def part_of(task: Task) -> str:
    """Which part of the study a task belongs to: "core" (every seed), "extra_rewards",
    "exploratory" or "sweep" (the first seeds)."""
    kind, _, name = task
    if kind == "reward":
        return "core" if name in ("rm", "am") else "extra_rewards"
    if kind == "curation" or name in ARMS:
        return "core"
    return "sweep" if name.startswith("am_ppo_sr_c") else "exploratory"


def part_seconds(seconds: dict[Task, float]) -> dict[str, float]:
    """Task wall seconds summed by ``part_of`` (with --jobs N, N tasks run at a time)."""
    parts = {}
    for task, value in seconds.items():
        part = part_of(task)
        parts[part] = parts.get(part, 0.0) + value
    return parts


def run_tasks(shared: Shared, tasks: dict[Task, tuple[Task, ...]], jobs: int,
              runner=run_task) -> tuple[dict, dict]:  # fmt: skip
    """Run ``tasks`` in order here (jobs=1) or, each as soon as its needs are done, in ``jobs``
    spawned workers. Seeds are independent and every command seeds itself, so the records do
    not depend on ``jobs``. A failing task stops the study with its error, the other workers
    killed mid-task. Returns each task's result and its wall seconds (``runner``: what runs a
    task, ``run_task``'s signature)."""
    results, seconds = {}, {}
    if jobs == 1:
        for task, needs in tasks.items():
            results[task], seconds[task] = runner(
                shared, task, {need: results[need] for need in needs}
            )
        return results, seconds
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=start_worker, initargs=(shared.preset.threads,))  # fmt: skip
    waiting, running = dict(tasks), {}
    try:
        while waiting or running:
            ready = [task for task, needs in waiting.items() if all(n in results for n in needs)]
            for task in ready:
                inputs = {need: results[need] for need in waiting.pop(task)}
                running[pool.submit(runner, shared, task, inputs)] = task
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                task = running.pop(future)
                if future.exception() is not None:
                    error = future.exception()
                    traceback.print_exception(error)
                    raise SystemExit(f"study: {task_title(task)} failed: {error}")
                results[task], seconds[task] = future.result()
    except BaseException:
        stop_workers(pool)
        raise
    pool.shutdown()
    return results, seconds


def start_worker(threads: int) -> None:
    """A worker runs its commands as the single process of fresh 1-process groups: nothing of
    this process's rendezvous may leak in. It leads its own process group, so that stopping it
    also stops what it forked (the checkpoint writer's ``Manager`` would otherwise outlive it
    and hold the pipe the pool watches for the worker's exit)."""
    os.setpgrp()
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "TORCHELASTIC_RUN_ID"):  # fmt: skip
        os.environ.pop(name, None)
    set_threads(threads)


def stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the workers now: ``shutdown`` alone would wait for the running tasks to finish.
    SIGKILL, to each worker's process group: a SIGTERM is what a training command catches to
    save a checkpoint and stop cleanly, after which the worker sat blocked sending back its
    result while this process waited for it in ``shutdown``, spinning (the study has no
    resume, so there is nothing to save)."""
    for process in list((pool._processes or {}).values()):  # no public way before Python 3.14
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- data


def prepare_data(out: Path, preset: Preset) -> dict:
    raw, indexed = out / "data", out / "data" / "indexed"
    indexed.mkdir(parents=True)
    records = world.world_records(world.WorldSizes(
        sft_per_task=preset.sft_per_task, pref_train_per_task=preset.pref_train_per_task,
        pref_test_per_task=preset.pref_test_per_task, ppo_prompts=preset.ppo_prompts,
        main_test_per_task=preset.main_test_per_task,
        forget_test_per_task=preset.forget_test_per_task,
    ))  # fmt: skip
    training = [records[name] for name in ("sft", "pref_train", "pref_test", "ppo_prompts")]
    overlap = {name: world.check_disjoint(records[name], training)
               for name in ("main_test", "forget_test")}  # fmt: skip
    if any(overlap.values()):
        raise SystemExit(f"held-out prompts overlap the training prompts: {overlap}")
    for name, rows in records.items():
        write_jsonl(raw / f"{name}.jsonl", rows)
    texts = [r["prompt"] + r["response"] for r in records["sft"]]
    texts += [r["prompt"] + r["chosen"] for r in records["pref_train"]]
    tokenizer = stages.build_tokenizer(texts, out / "tokenizer", preset.vocab_size)
    for name, kind in (("sft", "sft"), ("pref_train", "preference"), ("ppo_prompts", "prompt")):
        stages.preprocess(raw / f"{name}.jsonl", kind, tokenizer, indexed / name,
                          preset.max_length)  # fmt: skip
    summary = {name: len(rows) for name, rows in records.items()}
    summary["families"] = {name: dict(sorted(Counter(r["task"] for r in rows).items()))
                           for name, rows in records.items()}  # fmt: skip
    summary["held_out_overlap"] = overlap
    summary["oracle_accuracy_pref_test"] = 100.0 * world.bayes_accuracy(records["pref_test"])
    budget = stages.generation_budget(tokenizer, records["sft"])
    summary["generation_budget"] = budget
    return {"raw": raw, "indexed": indexed, "tokenizer": tokenizer, "summary": summary,
            "budget": budget, "eos_id": stages.eos_id_of(tokenizer)}  # fmt: skip


# ---------------------------------------------------------------- reward models


def reward_models(preset: Preset, seed: int) -> dict:
    """name -> (loss, epochs, margin): Table 1's pair; on the first ``extra_reward_seeds`` also
    the over-trained pair and the margin sweep."""
    models = {
        "rm": ("rm", preset.reward_epochs, None),
        "am": ("am", preset.reward_epochs, DEFAULT_MARGIN),
    }
    if runs_extra_rewards(preset, seed):
        models["rm_long"] = ("rm", preset.long_epochs, None)
        models["am_long"] = ("am", preset.long_epochs, DEFAULT_MARGIN)
        for margin in preset.margins:
            models[f"am_m{margin:g}"] = ("am", preset.reward_epochs, margin)
    return models


def reward_stage(out: Path, preset: Preset, data: dict, sft: Path, seed: int, name: str) -> Path:
    """Train reward model ``name`` of ``seed`` and score the held-out pairs; its checkpoint."""
    loss, epochs, margin = reward_models(preset, seed)[name]
    run_dir = out / "reward" / name / f"seed{seed}"
    checkpoint = stages.train_reward_model(
        loss=loss, sft=sft, train_prefix=data["indexed"] / "pref_train", out=run_dir,
        epochs=epochs, lr=preset.reward_lr, global_batch_size=preset.reward_batch,
        seed=seed, margin=margin,
    )  # fmt: skip
    stages.score_pairs(checkpoint, data["raw"] / "pref_test.jsonl", data["tokenizer"],
                       run_dir / "pairs.jsonl")  # fmt: skip
    return checkpoint


# ---------------------------------------------------------------- curation and arms


def curation_stage(out: Path, preset: Preset, data: dict, sft_responses: Path, am: Path,
                   seed: int) -> dict:  # fmt: skip
    """D_R prefixes by name: "main" (top-k by the AM in each of c clusters), "gold" (the same
    clusters' top-k by the gold utility: the ceiling of selection), "random" (as many records
    drawn uniformly), on the exploratory seeds "sft" (as many SFT demonstrations drawn
    uniformly from all five families: the positive control), and on the sweep seeds (c, k) of
    Fig. 6. Each set's records are described in ``rehearsal/seed<S>/d_r.jsonl``
    (``stages.describe_rehearsal``)."""
    work = out / "rehearsal" / f"seed{seed}"
    work.mkdir(parents=True)
    scored = stages.score_responses(am, sft_responses, data["tokenizer"], work / "scored.jsonl")
    c, k = preset.clusters, preset.top_k
    build = dict(tokenizer=data["tokenizer"], seed=seed)
    sets = {"main": stages.build_rehearsal(scored, prefix=work / "d_r", clusters=c, top_k=k,
                                           **build)}  # fmt: skip
    gold = stages.gold_scored(scored, work / "gold_scored.jsonl")
    sets["gold"] = stages.build_rehearsal(gold, prefix=work / "gold", clusters=c, top_k=k, **build)
    sets["random"] = stages.build_random_rehearsal(scored, data["tokenizer"], work / "random",
                                                   c * k, seed)  # fmt: skip
    if runs_exploratory(preset, seed):
        sets["sft"] = stages.build_random_rehearsal(data["raw"] / "sft.jsonl", data["tokenizer"],
                                                    work / "sft", c * k, seed)  # fmt: skip
    if runs_sweep(preset, seed):
        others = [count for count in preset.sweep_clusters if count != c]
        fixed_k = stages.build_rehearsal(scored, prefix=work / "fixed_k", clusters=others,
                                         top_k=k, **build)  # fmt: skip
        for count in others:  # a sweep of one count is a plain run at the prefix itself
            sets[(count, k)] = work / f"fixed_k_c{count}" if len(others) > 1 else fixed_k
            per_cluster = max(1, c * k // count)
            sets[(count, per_cluster)] = stages.build_rehearsal(
                scored, prefix=work / f"fixed_ck_c{count}", clusters=count, top_k=per_cluster,
                **build,
            )  # fmt: skip
    stages.describe_rehearsal({rehearsal_name(which): prefix for which, prefix in sets.items()},
                              work / "d_r.jsonl")  # fmt: skip
    return sets


def rehearsal_name(which) -> str:
    """A D_R's name in the records: "main", "gold", ... or "c<c>_k<k>" for a sweep set."""
    return which if isinstance(which, str) else f"c{which[0]}_k{which[1]}"


def sweep_arm(clusters: int, top_k: int) -> str:
    return f"am_ppo_sr_c{clusters}_k{top_k}"


def arms_of(preset: Preset, seed: int) -> dict:
    """The arms ``seed`` runs: the core, the exploratory ones on the first
    ``exploratory_seeds`` and the sweep on the first ``sweep_seeds``."""
    arms = dict(ARMS)
    if runs_exploratory(preset, seed):
        arms.update(exploratory_arms(preset))
    if runs_sweep(preset, seed):
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
    algorithm = options.get("algorithm", "ppo")
    policy = sft
    if algorithm != "none":
        policy = stages.train_policy(
            out=run_dir, sft=sft, reward=reward, reward_kind=reward_kind,
            prompts=data["indexed"] / "ppo_prompts", settings={**preset.ppo,
                                                               **options.get("ppo", {})},
            seed=seed,
            rehearsal=rehearsal_set, clusters=clusters, algorithm=algorithm,
            normalization=options.get("normalization", "none"),
        )  # fmt: skip
    judgments = stages.evaluate_policy(
        policy=policy, sft=sft, judge=reward, judge_kind=reward_kind,
        main_test=data["raw"] / "main_test.jsonl", forget_test=data["raw"] / "forget_test.jsonl",
        out=run_dir / "eval", max_new_tokens=preset.ppo["max_new_tokens"], seed=1000 + seed,
        tie_margin=preset.tie_margin, eos_id=data["eos_id"],
    )  # fmt: skip
    write_jsonl(run_dir / "judgments.jsonl", judgments)
    for step_dir in run_dir.glob("step_*"):  # the arm is judged; its weights are not needed
        shutil.rmtree(step_dir)


# ---------------------------------------------------------------- results
