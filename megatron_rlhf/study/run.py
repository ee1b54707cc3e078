"""``python -m megatron_rlhf study --preset quick|full --output-dir DIR [--seeds N] [--jobs N]``.

The paper's claims measured in a text world with a known gold reward (``study/world.py``), every
stage a real command run in-process (world size 1); the tasks run in --jobs worker processes,
each as soon as the tasks it needs are done:

  worlds      per world (``--worlds``; seeds are nested in worlds): its prompts, disjoint train /
              held-out sets, BPE tokenizer and indexed files (``world.world_records``: who
              sees which family), one tiny BLOOM fine-tuned on every task family, and that SFT
              policy's responses to the PPO prompts (the pool D_R is curated from)
  reward      per seed: RM and AM (Table 1); on the first extra_reward_seeds also an
              over-trained RM and AM and AM margins m (descriptive)
              -> the world's held-out pairs scored: accuracy, ECE, Brier against the known p
  curation    per seed: AM scores of the SFT responses, FAISS clusters -> D_R (the main c, k),
              the same clusters' top-k by the gold utility (the ceiling of selection), a
              random D_R of equal size; on the attribution seeds a family-stratified D_R that
              holds every minor skill; SFT demonstrations of every family (the positive
              control); on the sweep seeds Fig. 6's c sweep at fixed k and at fixed c*k. Every
              D_R's records (family, form, topic, "because", band, utility) go into the archive
  PPO arms    per seed the core (``ARMS``): rm_ppo, rm_ppo_ma, am_ppo, am_ppo_sr, am_ppo_rr
              (random rehearsal), am_ppo_sr_gold (gold top-k), null (0 PPO steps); on the
              attribution seeds ``attribution_arms`` (at gamma 0.1: selective, random,
              stratified and positive-control rehearsal, a KL-matched arm without rehearsal,
              and the dose); on the exploratory seeds ``exploratory_arms``; the sweep arms.
              Same beta, lr and steps unless an arm says otherwise; every critic from the SFT
              trunk
  curves      on the curve seeds one RM-PPO and one AM-PPO run of ``curve_steps[-1]`` steps,
              judged at each of ``curve_steps`` (the paper's Fig. 5: gold and training reward
              over training)
  judging     eval-policy vs SFT on the world's main and forget sets, every response
              re-judged by the gold reward (win/tie/lose with a tie margin), and by the arm's
              own reward; each PPO run's KL and reward per step
  report      results.json (``stats.results_from_records`` over the raw records: the tables
              and the claims of ``study/claims.py``, Holm-corrected, intervals that resample
              seeds and held-out items), report.md, PNGs, and records.jsonl.gz:
              every raw record the tables come from, with the settings; ``--from-records``
              recomputes every table from that file alone

A stopped run (killed, preempted, out of time) continues with ``--resume``: each task's last
write is its ``done.json``, so finished tasks are kept and an unfinished one starts again
from an empty directory; the records are those of an unstopped run.

What varies with the seed: the reward models' head init and data order, k-means seeding, PPO
sampling and evaluation sampling; with the world: the SFT data, the preference data, the
held-out sets, the tokenizer and the SFT policy.
"""

from __future__ import annotations

import argparse
import json
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
    runs_attribution,
    runs_curves,
    runs_exploratory,
    runs_extra_rewards,
    runs_sweep,
    seed_range,
    world_of,
    world_seed,
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
# "gold", "strat", "sft" or (c, k)); ppo: settings that differ from the preset's
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
    control at the paper's gamma (rehearsal on SFT demonstrations of every family), and RM-PPO
    and AM-PPO at every setting of the PPO grid."""
    arms = {
        "rm_ppo_sr": ("rm", {"rehearsal": "main"}),
        "rejection_sampling": ("am", {"algorithm": "rejection_sampling"}),
        "am_ppo_sft": ("am", {"rehearsal": "sft"}),
    }
    for settings in preset.ppo_grid:
        for reward in ("rm", "am"):
            arms[grid_arm(reward, settings)] = (reward, {"ppo": dict(settings)})
    return arms


def attribution_arms(preset: Preset) -> dict:
    """The arms that ask where rehearsal acts, at ``attribution_gamma`` (where it moves the minor
    skills): AM-PPO-SR, random rehearsal of equal size, a family-stratified D_R that holds every
    minor skill (the coverage mechanism: rehearse what PPO forgets), the positive control
    (SFT demonstrations), AM-PPO without rehearsal held closer to SFT by a larger KL
    coefficient (anchoring alone: ``Preset.kl_matched_coefs``), and the rest of the gamma
    dose."""
    gamma = preset.attribution_gamma
    rehearse = {"ppo": {"rehearsal_gamma": gamma}}
    arms = {
        f"am_ppo_sr_g{gamma:g}": ("am", {"rehearsal": "main", **rehearse}),
        f"am_ppo_rr_g{gamma:g}": ("am", {"rehearsal": "random", **rehearse}),
        f"am_ppo_strat_g{gamma:g}": ("am", {"rehearsal": "strat", **rehearse}),
        f"am_ppo_sft_g{gamma:g}": ("am", {"rehearsal": "sft", **rehearse}),
    }
    for coef in preset.kl_matched_coefs:
        name = "am_ppo_kl" if len(preset.kl_matched_coefs) == 1 else f"am_ppo_kl{coef:g}"
        arms[name] = ("am", {"ppo": {"kl_coef": coef}})
    for other in preset.gammas:
        arms[f"am_ppo_sr_g{other:g}"] = ("am", {"rehearsal": "main",
                                                "ppo": {"rehearsal_gamma": other}})  # fmt: skip
    return arms


CURVE_RUNS = {"rm_ppo_curve": "rm", "am_ppo_curve": "am"}
"""The hacking curves: one run per reward model of ``curve_steps[-1]`` steps, judged at every
step of ``curve_steps`` as the arms ``<reward>_ppo_step<N>`` (``curve_arm``)."""


def curve_arm(reward: str, step: int) -> str:
    return f"{reward}_ppo_step{step}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_rlhf study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--output-dir", required=True, help="where everything goes")
    parser.add_argument(
        "--seeds", type=int, help="number of seeds (default: the preset's: quick 3, full 30)"
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="seeds are FIRST .. FIRST + N - 1 (a development set that does not "
        "overlap the reporting seeds 0 .. N - 1: e.g. 100)",
    )
    parser.add_argument("--worlds", type=int,
                        help="worlds the seeds are nested in (default: the preset's: quick 2, "
                             "full 3)")  # fmt: skip
    parser.add_argument("--first-world", type=int, default=0,
                        help="world seeds are FIRST .. FIRST + W - 1 (a development run on "
                             "worlds of its own: e.g. 100)")  # fmt: skip
    parser.add_argument("--ppo", action="append", default=[], metavar="KEY=VALUE",
                        help="override one of the PPO settings every arm shares (repeatable; "
                             "e.g. --ppo actor_lr=3e-4 --ppo steps=20); the keys are the "
                             "preset's ppo keys")  # fmt: skip
    for part, what in (("exploratory", "the exploratory arms"),
                       ("attribution", "the attribution arms and the gamma dose"),
                       ("curve", "the hacking curves"), ("sweep", "Fig. 6's cluster sweep"),
                       ("extra-reward", "the over-trained and margin reward models")):  # fmt: skip
        parser.add_argument(f"--{part}-seeds", type=int,
                            help=f"how many of the seeds run {what} (default: the preset's; "
                                 "0 skips them)")  # fmt: skip
    parser.add_argument("--kl-matched-coef", type=float, action="append", metavar="BETA",
                        help="KL coefficient of the no-rehearsal arm matched to SR's KL "
                             "(repeatable: a development run that chooses it; default: the "
                             "preset's)")  # fmt: skip
    parser.add_argument("--jobs", type=int,
                        help="worker processes for the per-world and per-seed stages (default: "
                             "min(tasks, CPUs)); the results do not depend on it")  # fmt: skip
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --output-dir that was stopped (killed, "
                             "preempted, out of time): finished tasks are kept, unfinished "
                             "ones redone, with the settings the run started with (its "
                             f"{RUN_FILE}); refused unless the code is the commit it started "
                             "from, clean")  # fmt: skip
    parser.add_argument("--from-records", metavar="ARCHIVE",
                        help="run nothing: recompute results.json, report.md and the PNGs in "
                             f"--output-dir from a study's raw records (its {RECORDS_ARCHIVE}, "
                             "e.g. docs/paper_study's)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace --output-dir")
    return parser


SUBSET_COUNTS = ("exploratory_seeds", "attribution_seeds", "curve_seeds", "sweep_seeds",
                 "extra_reward_seeds")  # fmt: skip
"""The preset's counts of "the first N seeds" (each at most the number of seeds)."""


def preset_from_args(args) -> Preset:
    """The preset with the command line's overrides; raises ValueError naming the flag."""
    preset = PRESETS[args.preset]
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError("--seeds must be >= 1")
        preset = replace(preset, seeds=args.seeds)
    if args.first_seed < 0 or args.first_world < 0:
        raise ValueError("--first-seed and --first-world must be >= 0")
    if args.worlds is not None:
        if args.worlds < 1:
            raise ValueError("--worlds must be >= 1")
        preset = replace(preset, worlds=args.worlds)
    preset = replace(preset, first_seed=args.first_seed, first_world=args.first_world,
                     ppo=ppo_overrides(preset.ppo, args.ppo))  # fmt: skip
    for key in SUBSET_COUNTS:
        value = getattr(args, key, None)
        if value is not None and value < 0:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 0")
        preset = replace(preset, **{key: min(getattr(preset, key) if value is None else value,
                                             preset.seeds)})  # fmt: skip
    if args.kl_matched_coef:
        if any(coef <= 0 for coef in args.kl_matched_coef):
            raise ValueError("--kl-matched-coef must be > 0")
        preset = replace(preset, kl_matched_coefs=tuple(args.kl_matched_coef))
    if preset.worlds > preset.seeds:
        raise ValueError(f"--worlds {preset.worlds} is more than the {preset.seeds} seeds: "
                         "every world needs a seed")  # fmt: skip
    return preset


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.resume:
            if args.overwrite or args.from_records:
                raise ValueError("--resume continues a run: it takes neither --overwrite nor "
                                 "--from-records")  # fmt: skip
            out, preset, preset_name = resume_settings(Path(args.output_dir))
        else:
            preset, preset_name = preset_from_args(args), args.preset
            out = check_output_dir(args.output_dir, args.overwrite)
    except (ValueError, InputError) as err:
        print(f"study: error: {err}", file=sys.stderr)
        return 2
    jobs = args.jobs if args.jobs is not None else min(preset.seeds, os.cpu_count() or 1)
    if jobs < 1:
        print("study: error: --jobs must be >= 1", file=sys.stderr)
        return 2
    if out.exists() and not args.resume:
        shutil.rmtree(out)
    if args.from_records:
        return recompute(Path(args.from_records), out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    set_threads(preset.threads)
    started, cpu_started = time.time(), cpu_seconds()
    results = run_study(out, preset, preset_name, jobs, resume=args.resume)
    table2 = results["table2"]
    print_summary(
        "study",
        preset=preset_name,
        seeds=preset.seeds,
        worlds=preset.worlds,
        rm_ece=round(results["table1"]["rm"]["ece"]["mean"], 2),
        am_ece=round(results["table1"]["am"]["ece"]["mean"], 2),
        am_ppo_sr_net_win_main=round(table2["am_ppo_sr"]["main"]["net_win"], 1),
        am_ppo_sr_net_win_minor=round(table2["am_ppo_sr"]["minor"]["net_win"], 1),
        seconds=round(time.time() - started, 1),
        cpu_seconds=round(cpu_seconds() - cpu_started, 1),
        jobs=jobs,
        report=str(out / "report.md"),
    )
    return 0


RUN_FILE = "run.json"
"""What a run is, written before its first task: the preset (with every override), its name
and the code it started from (``code_provenance``). ``--resume`` reads it back."""


def resume_settings(out: Path) -> tuple[Path, Preset, str]:
    """The output dir, preset and preset name of the stopped run in ``out``; raises InputError
    when there is none or when this code is not the code it started from."""
    path = out / RUN_FILE
    if not path.is_file():
        raise InputError(f"--resume: {path}: no such file; --output-dir must be a study run "
                         "this command started")  # fmt: skip
    try:
        saved = json.loads(path.read_text())
        preset = Preset(**{**saved["preset"], **{key: tuple(saved["preset"][key])
                                                 for key in TUPLE_FIELDS}})  # fmt: skip
        name, commit, dirty = saved["preset_name"], saved["git_commit"], saved["git_dirty"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"--resume: {path}: not a study run file ({err})") from None
    now = code_provenance(time.time())
    if commit is None or dirty or now["git_dirty"] or now["git_commit"] != commit:
        raise InputError(
            f"--resume: {out} started from commit {commit} (dirty: {dirty}); this code is "
            f"{now['git_commit']} (dirty: {now['git_dirty']}). A resumed run's records must all "
            "come from one clean commit: check it out, or start a new run"
        )  # fmt: skip
    return out, preset, name


TUPLE_FIELDS = tuple(name for name, value in asdict(Preset()).items() if isinstance(value, tuple))
"""Preset fields that are tuples (JSON gives lists back)."""


def recompute(archive: Path, out: Path) -> int:
    """results.json, report.md and the PNGs from ``archive``'s records and settings alone,
    built in a temporary directory that becomes ``out`` only when everything is written."""
    from megatron_rlhf.study.report import write_report
    from megatron_rlhf.study.stats import results_from_records

    try:
        settings, pairs, judgments, rehearsal, training = stages.unpack_records(archive)
        settings = with_minor_skills(settings)
        if settings.get("minor_skills", list(world.MINOR_TASKS)) != list(world.MINOR_TASKS):
            raise InputError(f"{archive}: its minor skills {settings['minor_skills']} are not "
                             f"this code's {list(world.MINOR_TASKS)} (study/world.py): the "
                             "records are of another world")  # fmt: skip
        with atomic_output(out) as tmp:
            tmp.mkdir()
            results = {**results_from_records(pairs, judgments, rehearsal, training,
                                              seed_worlds(settings)),
                       "settings": settings}  # fmt: skip
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


def run_study(out: Path, preset: Preset, preset_name: str, jobs: int = 1,
              resume: bool = False) -> dict:  # fmt: skip
    """Every task of ``study_tasks`` (those finished before, on ``resume``, are kept), then the
    report. The records do not depend on ``jobs`` or on where a run was stopped: every task
    seeds itself and starts from its own empty directory."""
    from megatron_rlhf.study.report import write_report
    from megatron_rlhf.study.stats import results_from_records

    progress, cpu_started = Progress(), cpu_seconds()
    if resume:
        run = json.loads((out / RUN_FILE).read_text())
        run["resumed_utc"] = [*run.get("resumed_utc", []),
                              code_provenance(progress.started)["started_utc"]]  # fmt: skip
        progress.stage(f"resuming the run started {run['started_utc']}")
    else:
        out.mkdir(parents=True)
        run = {"preset_name": preset_name, "preset": asdict(preset),
               **code_provenance(progress.started)}  # fmt: skip
    write_json(out / RUN_FILE, run)
    shared = Shared(out=out, preset=preset, started=progress.started)
    results_of, task_seconds = run_tasks(shared, study_tasks(preset), jobs)
    progress.stage("report")
    pairs, judgments, rehearsal, training = stages.load_records(out)
    world_info = [results_of[("world", w, "")] for w in range(preset.worlds)]
    settings = {"preset": preset_name, **asdict(preset), "claims_version": CLAIMS_VERSION,
                **{key: run[key] for key in ("started_utc", "git_commit", "git_dirty", "git")
                   if key in run},
                "resumed_utc": run.get("resumed_utc", []),
                "worlds": {"count": preset.worlds,
                           "world_seeds": [world_seed(preset, w) for w in range(preset.worlds)],
                           "seed_world": {str(s): world_of(preset, s) for s in seed_range(preset)}},
                "minor_skills": list(world.MINOR_TASKS),
                "sft_losses": [info["sft_losses"] for info in world_info],
                "data": [info["summary"] for info in world_info], "jobs": jobs,
                "seconds": time.time() - progress.started,
                "cpu_seconds": cpu_seconds() - cpu_started,
                "part_seconds": part_seconds(task_seconds, preset)}  # fmt: skip
    results = results_from_records(pairs, judgments, rehearsal, training, seed_worlds(settings))
    results["settings"] = settings
    write_json(out / "results.json", results)
    # the archive before the report: everything is recomputed from it (--from-records)
    stages.pack_records(settings, pairs, judgments, rehearsal, training, out / RECORDS_ARCHIVE)
    write_report(out, results, pairs)
    return results


def with_minor_skills(settings: dict) -> dict:
    """``settings`` with ``minor_skills`` (the families of the primary forget endpoint): as a
    run recorded it, or for a run that did not (v4's first, whose runner predates the key)
    read off its recorded data: the families of its PPO prompts that its preference data
    never holds, in every world. An archive without per-world data is returned as it is."""
    data = settings.get("data")
    if "minor_skills" in settings or not isinstance(data, list):
        return settings
    minor = [sorted(set(world_data["families"]["ppo_prompts"])
                    - set(world_data["families"]["pref_train"])) for world_data in data]  # fmt: skip
    if any(skills != minor[0] for skills in minor):
        raise InputError(f"the worlds' minor skills differ: {minor}")
    order = [task for task in world.TASK_SPECS if task in minor[0]]
    return {**settings, "minor_skills": order}


def seed_worlds(settings: dict) -> dict[int, int] | None:
    """``{seed: world}`` from results.json's settings (None for a run before worlds: one)."""
    worlds = settings.get("worlds")
    if not isinstance(worlds, dict):
        return None
    return {int(seed): int(world) for seed, world in worlds["seed_world"].items()}


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


# ---------------------------------------------------------------- tasks

Task = tuple[str, int, str]
"""``("world", w, "")``, ``("reward", seed, model)``, ``("curation", seed, "")``,
``("arm", seed, arm)`` or ``("curve", seed, run)``."""


@dataclass(frozen=True)
class Shared:
    """What every task reads besides its needs' results."""

    out: Path
    preset: Preset
    started: float
    """The study's start (progress lines count from it)."""


def study_tasks(preset: Preset) -> dict[Task, tuple[Task, ...]]:
    """Every task -> the tasks whose results it needs, in an order that runs: the worlds first
    (data, SFT policy, SFT responses), then per seed its reward models, D_R and arms."""
    tasks = {("world", w, ""): () for w in range(preset.worlds)}
    for seed in seed_range(preset):
        home = ("world", world_of(preset, seed), "")
        for name in reward_models(preset, seed):
            tasks[("reward", seed, name)] = (home,)
        tasks[("curation", seed, "")] = (home, ("reward", seed, "am"))
        for arm, (reward_name, options) in arms_of(preset, seed).items():
            needs = (home, ("reward", seed, reward_name))
            if "rehearsal" in options:
                needs += (("curation", seed, ""),)
            tasks[("arm", seed, arm)] = needs
        if runs_curves(preset, seed):
            for run, reward_name in CURVE_RUNS.items():
                tasks[("curve", seed, run)] = (home, ("reward", seed, reward_name))
    return tasks


def task_title(task: Task) -> str:
    kind, seed, name = task
    if kind == "world":
        return f"world {seed}: data, SFT policy, SFT responses"
    what = {"reward": f"reward model {name}", "curation": "curation (D_R)",
            "arm": f"PPO arm {name}", "curve": f"hacking curve {name}"}  # fmt: skip
    return f"seed {seed}: {what[kind]}"


def task_dirs(out: Path, preset: Preset, task: Task) -> list[Path]:
    """Where a task writes: removed before it (re)starts, so a resumed task starts clean."""
    kind, seed, name = task
    if kind == "world":
        return [out / f"world{seed}"]
    if kind == "reward":
        return [out / "reward" / name / f"seed{seed}"]
    if kind == "curation":
        return [out / "rehearsal" / f"seed{seed}"]
    if kind == "arm":
        return [out / "ppo" / name / f"seed{seed}"]
    reward = CURVE_RUNS[name]
    return [
        out / "ppo" / name / f"seed{seed}",
        *(out / "ppo" / curve_arm(reward, step) / f"seed{seed}" for step in preset.curve_steps),
    ]


def done_file(out: Path, preset: Preset, task: Task) -> Path:
    """The task's last write: its result, relative to ``out``. Its presence means done."""
    return task_dirs(out, preset, task)[0] / "done.json"


def run_task(shared: Shared, task: Task, inputs: dict) -> tuple[object, float]:
    """One task (in this process or a worker); ``inputs`` are the results of its needs.
    Returns its result and its wall seconds; a task done before (``done_file``) is not run
    again, its result read back."""
    kind, seed, name = task
    out, preset = shared.out, shared.preset
    done = done_file(out, preset, task)
    if done.is_file():
        return from_json(out, json.loads(done.read_text())), 0.0
    for path in task_dirs(out, preset, task):
        if path.exists():
            shutil.rmtree(path)
    started = time.time()
    Progress(shared.started).stage(task_title(task))
    home = inputs.get(("world", world_of(preset, seed), "")) if kind != "world" else None
    if kind == "world":
        result = world_stage(out, preset, seed)
    elif kind == "reward":
        result = reward_stage(out, preset, home, seed, name)
    elif kind == "curation":
        result = curation_stage(out, preset, home, inputs[("reward", seed, "am")], seed)
    elif kind == "arm":
        reward_name, options = arms_of(preset, seed)[name]
        rehearsal = inputs.get(("curation", seed, ""))
        run_arm(out, preset, home, inputs[("reward", seed, reward_name)], reward_name,
                rehearsal, name, options, seed)  # fmt: skip
        result = None
    else:
        reward_name = CURVE_RUNS[name]
        run_curve(out, preset, home, inputs[("reward", seed, reward_name)], reward_name, name,
                  seed)  # fmt: skip
        result = None
    write_json(done, to_json(out, result))
    return result, time.time() - started


def to_json(out: Path, value):
    """A task's result as JSON: paths relative to ``out`` (``{"path": ...}``), tuples as
    ``{"tuple": [...]}``, dicts with non-string keys as ``{"items": [[key, value], ...]}``."""
    if isinstance(value, Path):
        return {"path": str(value.relative_to(out))}
    if isinstance(value, tuple):
        return {"tuple": [to_json(out, v) for v in value]}
    if isinstance(value, dict):
        return {"items": [[to_json(out, k), to_json(out, v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [to_json(out, v) for v in value]
    return value


def from_json(out: Path, value):
    """``to_json`` back; a path must stay inside ``out`` (the file is data, not a pointer)."""
    if isinstance(value, list):
        return [from_json(out, v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"path"}:
            path = (out / value["path"]).resolve()
            if not path.is_relative_to(out.resolve()):
                raise InputError(f"{out}: a task's done.json names {value['path']!r}, outside "
                                 "the run")  # fmt: skip
            return out / value["path"]
        if set(value) == {"tuple"}:
            return tuple(from_json(out, v) for v in value["tuple"])
        if set(value) == {"items"}:
            return {from_json(out, k): from_json(out, v) for k, v in value["items"]}
        raise InputError(f"{out}: a task's done.json holds an unknown object {sorted(value)}")
    return value


def part_of(task: Task, preset: Preset) -> str:
    """Which part of the study a task of ``preset`` belongs to: "worlds", "core" (every seed),
    "extra_rewards", "exploratory", "attribution", "curves" or "sweep" (the first seeds); an
    arm's part is the function that names it (``ARMS``, ``sweep_arms``, ``attribution_arms``,
    ``exploratory_arms``). ValueError for an arm ``preset`` has not."""
    kind, _, name = task
    if kind in ("world", "curve"):
        return {"world": "worlds", "curve": "curves"}[kind]
    if kind == "reward":
        return "core" if name in ("rm", "am") else "extra_rewards"
    if kind == "curation" or name in ARMS:
        return "core"
    for part, arms in (("sweep", sweep_arms), ("attribution", attribution_arms),
                       ("exploratory", exploratory_arms)):  # fmt: skip
        if name in arms(preset):
            return part
    raise ValueError(f"{name}: not an arm of this preset")


def part_seconds(seconds: dict[Task, float], preset: Preset) -> dict[str, float]:
    """Task wall seconds summed by ``part_of`` (with --jobs N, N tasks run at a time)."""
    parts = {}
    for task, value in seconds.items():
        part = part_of(task, preset)
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


# ---------------------------------------------------------------- worlds


def world_stage(out: Path, preset: Preset, index: int) -> dict:
    """World ``index``: its data (``prepare_data``), its SFT policy and the SFT policy's
    responses to its PPO prompts (the pool D_R is curated from). Every generation of the world
    (D_R's SFT responses, PPO rollouts, evaluation) gets the data's budget, above the longest
    demonstration of every family, so the budget never decides a verdict (unless
    ``--ppo max_new_tokens=N`` chose one)."""
    home = out / f"world{index}"
    data = prepare_data(home, preset, world_seed(preset, index))
    budget = preset.ppo["max_new_tokens"] or data["budget"]["budget"]
    sft, sft_losses = stages.train_sft_policy(
        data["indexed"] / "sft", home / "sft", hidden=preset.hidden, layers=preset.layers,
        heads=preset.heads, steps=preset.sft_steps, lr=preset.sft_lr,
        batch_size=preset.sft_batch, max_length=preset.max_length, seed=world_seed(preset, index),
    )  # fmt: skip
    sft_responses = stages.generate_responses(sft, data["raw"] / "ppo_prompts.jsonl",
                                              home / "sft_responses.jsonl", budget, seed=0)  # fmt: skip
    return {**data, "sft": sft, "sft_responses": sft_responses, "sft_losses": sft_losses,
            "max_new_tokens": budget}  # fmt: skip


def prepare_data(out: Path, preset: Preset, seed: int) -> dict:
    """World seed ``seed``'s records (``world.world_records``: who sees which family), checked
    disjoint, its BPE tokenizer and indexed files under ``out``."""
    raw, indexed = out / "data", out / "data" / "indexed"
    indexed.mkdir(parents=True)
    records = world.world_records(world.WorldSizes(
        sft_per_task=preset.sft_per_task, pref_train_per_task=preset.pref_train_per_task,
        pref_test_per_task=preset.pref_test_per_task, ppo_prompts=preset.ppo_prompts,
        main_test_per_task=preset.main_test_per_task,
        forget_test_per_task=preset.forget_test_per_task,
        minor_test_per_task=preset.minor_test_per_task,
    ), seed=seed)  # fmt: skip
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
    summary = {"world_seed": seed, **{name: len(rows) for name, rows in records.items()}}
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


def reward_stage(out: Path, preset: Preset, home: dict, seed: int, name: str) -> Path:
    """Train reward model ``name`` of ``seed`` on its world's preference data from its world's
    SFT policy, and score the world's held-out pairs; its checkpoint."""
    loss, epochs, margin = reward_models(preset, seed)[name]
    run_dir = out / "reward" / name / f"seed{seed}"
    checkpoint = stages.train_reward_model(
        loss=loss, sft=home["sft"], train_prefix=home["indexed"] / "pref_train", out=run_dir,
        epochs=epochs, lr=preset.reward_lr, global_batch_size=preset.reward_batch,
        seed=seed, margin=margin,
    )  # fmt: skip
    stages.score_pairs(checkpoint, home["raw"] / "pref_test.jsonl", home["tokenizer"],
                       run_dir / "pairs.jsonl")  # fmt: skip
    return checkpoint


# ---------------------------------------------------------------- curation and arms


def curation_stage(out: Path, preset: Preset, home: dict, am: Path, seed: int) -> dict:
    """D_R prefixes by name: "main" (top-k by the AM in each of c clusters), "gold" (the same
    clusters' top-k by the gold utility: the ceiling of selection), "random" (as many records
    drawn uniformly); on the attribution seeds "strat" (as many records, top by the AM within
    each task family, every minor skill guaranteed ``top_k``: ``stages.stratified_rehearsal``);
    on the exploratory or attribution seeds "sft" (as many SFT demonstrations drawn uniformly
    from every family: the positive control); on the sweep seeds (c, k) of Fig. 6. Each set's
    records are described in ``rehearsal/seed<S>/d_r.jsonl`` (``stages.describe_rehearsal``)."""
    work = out / "rehearsal" / f"seed{seed}"
    work.mkdir(parents=True)
    tokenizer = home["tokenizer"]
    scored = stages.score_responses(am, home["sft_responses"], tokenizer, work / "scored.jsonl")
    c, k = preset.clusters, preset.top_k
    build = dict(tokenizer=tokenizer, seed=seed)
    sets = {"main": stages.build_rehearsal(scored, prefix=work / "d_r", clusters=c, top_k=k,
                                           **build)}  # fmt: skip
    gold = stages.gold_scored(scored, work / "gold_scored.jsonl")
    sets["gold"] = stages.build_rehearsal(gold, prefix=work / "gold", clusters=c, top_k=k, **build)
    sets["random"] = stages.build_random_rehearsal(scored, tokenizer, work / "random", c * k, seed)
    if runs_attribution(preset, seed):
        sets["strat"] = stages.stratified_rehearsal(scored, tokenizer, work / "strat", c * k,
                                                    k, seed)  # fmt: skip
    if runs_exploratory(preset, seed) or runs_attribution(preset, seed):
        sets["sft"] = stages.build_random_rehearsal(home["raw"] / "sft.jsonl", tokenizer,
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


def sweep_arms(preset: Preset) -> dict:
    """Fig. 6's cluster sweep: AM-PPO-SR on a D_R of each other cluster count of
    ``sweep_clusters``, at the preset's top-k and at the top-k that keeps the D_R's size."""
    c, k = preset.clusters, preset.top_k
    arms = {}
    for count in preset.sweep_clusters:
        if count != c:
            for top_k in (k, max(1, c * k // count)):
                arms[sweep_arm(count, top_k)] = ("am", {"rehearsal": (count, top_k)})
    return arms


def arms_of(preset: Preset, seed: int) -> dict:
    """The arms ``seed`` runs: the core, the exploratory ones on the first
    ``exploratory_seeds``, the attribution ones on the first ``attribution_seeds`` and the
    sweep on the first ``sweep_seeds`` (the hacking curves are tasks of their own)."""
    arms = dict(ARMS)
    if runs_exploratory(preset, seed):
        arms.update(exploratory_arms(preset))
    if runs_attribution(preset, seed):
        arms.update(attribution_arms(preset))
    if runs_sweep(preset, seed):
        arms.update(sweep_arms(preset))
    return arms


def run_arm(out, preset, home, reward, reward_name, rehearsal, arm, options, seed) -> None:
    run_dir = out / "ppo" / arm / f"seed{seed}"
    reward_kind = "am" if reward_name.startswith("am") else "rm"
    which = options.get("rehearsal")
    rehearsal_set = rehearsal[which] if which is not None else None
    clusters = rehearsal["main"] if which == "main" else None
    algorithm = options.get("algorithm", "ppo")
    policy = home["sft"]
    if algorithm != "none":
        policy = stages.train_policy(
            out=run_dir, sft=home["sft"], reward=reward, reward_kind=reward_kind,
            prompts=home["indexed"] / "ppo_prompts",
            settings={**preset.ppo, "max_new_tokens": home["max_new_tokens"],
                      **options.get("ppo", {})},
            seed=seed, rehearsal=rehearsal_set, clusters=clusters, algorithm=algorithm,
            normalization=options.get("normalization", "none"),
        )  # fmt: skip
        write_jsonl(run_dir / "training.jsonl", stages.training_curve(run_dir))
    judge(out, preset, home, policy, reward, reward_kind, run_dir, seed)
    for step_dir in run_dir.glob("step_*"):  # the arm is judged; its weights are not needed
        shutil.rmtree(step_dir)


def judge(out, preset, home, policy, reward, reward_kind, run_dir, seed) -> None:
    """Judge ``policy`` against SFT on the world's main and forget sets (``run_dir/eval``) and
    write the gold judgments (``run_dir/judgments.jsonl``)."""
    judgments = stages.evaluate_policy(
        policy=policy, sft=home["sft"], judge=reward, judge_kind=reward_kind,
        main_test=home["raw"] / "main_test.jsonl", forget_test=home["raw"] / "forget_test.jsonl",
        out=run_dir / "eval", max_new_tokens=home["max_new_tokens"], seed=1000 + seed,
        tie_margin=preset.tie_margin, eos_id=home["eos_id"],
    )  # fmt: skip
    write_jsonl(run_dir / "judgments.jsonl", judgments)


def run_curve(out, preset, home, reward, reward_name, run, seed) -> None:
    """One PPO run of ``curve_steps[-1]`` steps (the arms' shared settings otherwise), saved at
    every step of ``curve_steps`` and judged there: arm ``<reward>_ppo_step<N>`` is its policy
    after N steps (its training curve, whole, is that of the last step's arm)."""
    run_dir = out / "ppo" / run / f"seed{seed}"
    steps = preset.curve_steps
    stages.train_policy(
        out=run_dir, sft=home["sft"], reward=reward, reward_kind=reward_name,
        prompts=home["indexed"] / "ppo_prompts",
        settings={**preset.ppo, "max_new_tokens": home["max_new_tokens"], "steps": steps[-1]},
        seed=seed, save_at=steps,
    )  # fmt: skip
    curve = stages.training_curve(run_dir)
    for step in steps:
        arm_dir = out / "ppo" / curve_arm(reward_name, step) / f"seed{seed}"
        policy = run_dir / f"step_{step:07d}"
        if not policy.is_dir():
            raise SystemExit(f"{run_dir}: no checkpoint of step {step}")
        judge(out, preset, home, policy, reward, reward_name, arm_dir, seed)
        write_jsonl(arm_dir / "training.jsonl", [row for row in curve if row["step"] <= step])
    for step_dir in run_dir.glob("step_*"):
        shutil.rmtree(step_dir)


# ---------------------------------------------------------------- results
