"""``DIR/report.md`` and the PNGs of a study, from results.json and the raw records.

The claims, their families and the decision rule are declared in ``study/claims.py``: per-seed
differences in the paper's direction, each claim's interval resampling seeds and held-out items
within worlds (``study/intervals.py``), Holm-corrected within each family; results.json's
``claims`` holds every row the report shows. The report is a function of results.json alone
(and the held-out pairs for two figures): a recompute from the records archive gives the same
report.md byte for byte.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from megatron_rlhf.study.claims import ACCURACY_NI_MARGIN, ALPHA, CLAIMS_VERSION, POWER
from megatron_rlhf.study.presets import TABLE1_MARGINS
from megatron_rlhf.utils import atomic_output

PAPER_TABLE1 = {  # Table 1: accuracy, ECE (HH-RLHF; proprietary)
    "rm": {"accuracy": (69.25, 74.75), "ece": (4.70, 5.35)},
    "am": {"accuracy": (69.43, 75.28), "ece": (3.48, 3.83)},
}
PAPER_TABLE2 = {  # Table 2: main win, lose, tie; forget win, lose, tie (GPT-4 judge)
    "rm_ppo": (12.72, 12.62, 74.66, 16.87, 29.28, 53.84),
    "am_ppo": (14.87, 10.38, 74.74, 9.70, 8.44, 81.86),
    "am_ppo_sr": (15.78, 9.77, 74.45, 10.30, 7.95, 81.75),
}
ARM_LABELS = {
    "rm_ppo": "RM-PPO", "rm_ppo_ma": "RM-PPO w/ MA", "am_ppo": "AM-PPO",
    "am_ppo_sr": "AM-PPO-SR", "rm_ppo_sr": "RM-PPO-SR (ablation)",
    "rejection_sampling": "Rejection sampling (AM, Eqs. 3-4)",
    "am_ppo_rr": "AM-PPO + random rehearsal (control)",
    "am_ppo_sr_gold": "AM-PPO + gold top-k rehearsal (ceiling)",
    "am_ppo_sft": "AM-PPO + SFT-demonstration rehearsal (positive control)",
    "null": "Null arm (0 PPO steps: SFT vs itself)",
}  # fmt: skip
CORE_ARMS = ("rm_ppo", "rm_ppo_ma", "am_ppo", "am_ppo_sr", "am_ppo_rr", "am_ppo_sr_gold")
"""Every seed runs them (``run.ARMS``, the null arm apart)."""
EXPLORATORY_ARMS = ("rm_ppo_sr", "rejection_sampling", "am_ppo_sft")
"""``run.exploratory_arms`` besides the PPO grid."""
REHEARSAL_LABELS = {
    "main": "AM top-k (AM-PPO-SR's D_R)", "gold": "gold top-k (ceiling)",
    "random": "random, same size", "strat": "family-stratified (every minor skill)",
    "sft": "SFT demonstrations (positive control)",
}  # fmt: skip
KIND_LABELS = {
    "sr": "AM-PPO-SR", "rr": "AM-PPO + random rehearsal",
    "strat": "AM-PPO + family-stratified rehearsal",
    "sft": "AM-PPO + SFT-demonstration rehearsal (positive control)",
}  # fmt: skip
KIND_DR = {"sr": "main", "rr": "random", "strat": "strat", "sft": "sft"}
"""Which D_R (``results["rehearsal"]``) an attribution arm rehearses."""
ARM_DR = {"am_ppo_sr": "main", "rm_ppo_sr": "main", "am_ppo_rr": "random",
          "am_ppo_sr_gold": "gold", "am_ppo_sft": "sft"}  # fmt: skip
ATTRIBUTION_ARM = re.compile(r"am_ppo_(sr|rr|strat|sft)_g(\d[\d.e+-]*)")
ANCHOR_ARM = re.compile(r"am_ppo_kl(\d[\d.e+-]*)?")
CURVE_ARM = re.compile(r"(rm|am)_ppo_step(\d+)")
SWEEP_ARM = re.compile(r"am_ppo_sr_c(\d+)_k(\d+)")
GRID_ARM = re.compile(r"(rm|am)_ppo_(lr[\d.e+-]+(_s\d+)?|s\d+)")
CROSSED = "⟨low, high⟩"


# ---------------------------------------------------------------- cells


def fmt(cell: dict, digits: int = 2) -> str:
    """``mean [low, high]`` (the t-interval across seeds) or just the mean with one seed."""
    if cell["ci_low"] is None:
        return f"{cell['mean']:.{digits}f}"
    return f"{cell['mean']:.{digits}f} [{cell['ci_low']:.{digits}f}, {cell['ci_high']:.{digits}f}]"


def _signed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value >= 0.001 else "<0.001"


def _net_cell(results: dict, arm: str, set_name: str, crossed: bool = True) -> str:
    """A net win: ``mean [seed t-interval] ⟨seeds and prompts resampled⟩`` (what exists)."""
    cell = results["table2"].get(arm, {}).get(set_name)
    if cell is None:
        return "-"
    text = f"{cell['net_win']:+.1f}"
    if cell.get("ci_low") is not None:
        text += f" [{cell['ci_low']:+.1f}, {cell['ci_high']:+.1f}]"
    if crossed and cell.get("ci_low_crossed") is not None:
        text += f" ⟨{cell['ci_low_crossed']:+.1f}, {cell['ci_high_crossed']:+.1f}⟩"
    return text


def _mean(results: dict, arm: str, set_name: str, key: str, digits: int = 3) -> str:
    cell = results["arms"].get(arm, {}).get(set_name, {}).get(key)
    return "-" if cell is None else f"{cell['mean']:+.{digits}f}"


def _seeds(results: dict, arm: str) -> int:
    return len(results["table2"][arm]["main"]["per_seed"])


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _kl(results: dict, arm: str) -> str:
    cell = (results.get("kl_to_sft") or {}).get(arm)
    return "-" if cell is None else fmt(cell, 2)


def _anchor_beta(arm: str, settings: dict) -> float | None:
    match = ANCHOR_ARM.fullmatch(arm)
    if match is None:
        return None
    if match[1]:
        return float(match[1])
    coefs = settings.get("kl_matched_coefs") or ()
    return float(coefs[0]) if len(coefs) == 1 else None


def arm_label(arm: str, settings: dict | None = None) -> str:
    """The arm's name in the tables (its results.json name where there is no label)."""
    if arm in ARM_LABELS:
        return ARM_LABELS[arm]
    if match := ATTRIBUTION_ARM.fullmatch(arm):
        return f"{KIND_LABELS[match[1]]}, γ {match[2]}"
    if ANCHOR_ARM.fullmatch(arm):
        beta = _anchor_beta(arm, settings or {})
        return "AM-PPO, " + ("raised β" if beta is None else f"β {beta:g}") + " (anchoring)"
    if match := CURVE_ARM.fullmatch(arm):
        return f"{match[1].upper()}-PPO at step {match[2]} (curve)"
    return arm


def _label(results: dict, arm: str) -> str:
    return arm_label(arm, results.get("settings"))


def arm_groups(results: dict) -> dict[str, list[str]]:
    """The arms of the run by part: core (with the exploratory and any unknown arm: Table 2),
    attribution, curve, sweep, grid; the null arm last of Table 2."""
    arms = list(results["table2"])
    groups = {"table2": [], "attribution": [], "curve": [], "sweep": [], "grid": []}
    for arm in arms:
        if ATTRIBUTION_ARM.fullmatch(arm) or ANCHOR_ARM.fullmatch(arm):
            groups["attribution"].append(arm)
        elif CURVE_ARM.fullmatch(arm):
            groups["curve"].append(arm)
        elif SWEEP_ARM.fullmatch(arm):
            groups["sweep"].append(arm)
        elif GRID_ARM.fullmatch(arm):
            groups["grid"].append(arm)
    grouped = {a for group in groups.values() for a in group}
    known = [a for a in (*CORE_ARMS, *EXPLORATORY_ARMS) if a in results["table2"]]
    rest = sorted(a for a in arms if a not in grouped and a not in known and a != "null")
    groups["table2"] = known + rest + (["null"] if "null" in results["table2"] else [])
    order = {"sr": 0, "rr": 1, "strat": 2, "sft": 3}

    def attribution_key(arm: str):
        if match := ATTRIBUTION_ARM.fullmatch(arm):
            return (0, float(match[2]), order[match[1]], arm)
        return (1, 0.0, 0, arm)

    groups["attribution"].sort(key=attribution_key)
    groups["curve"].sort(key=lambda a: (a[:2] != "rm", int(CURVE_ARM.fullmatch(a)[2])))
    return groups


def minor_sets(results: dict, arm: str = "am_ppo") -> list[str]:
    """The per-skill minor sets (``minor_<skill>``) the arm's Table 2 row has, in world order."""
    from megatron_rlhf.study.world import MINOR_TASKS

    row = results["table2"].get(arm) or next(iter(results["table2"].values()))
    return [f"minor_{t}" for t in MINOR_TASKS if f"minor_{t}" in row]


# ---------------------------------------------------------------- claims


def claims_md(rows: list[dict], family: str) -> list[str]:
    """The claims of ``family``: the first five columns are the README's claims table's
    (``| `name` | family | verdict | difference [95 % CI] | p (Holm) |``, the same text)."""
    lines = ["| claim | family | verdict | difference [95 % CI] | p (Holm) | p | p (seeds only) | "
             "Holm level | seeds needed | resampled | claim (paper's direction) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    shown = 0
    for row in rows:
        if row["family"] != family:
            continue
        shown += 1
        digits = row["digits"]
        interval = _signed(row["estimate"], digits)
        if row["ci_low"] is not None:
            interval += f" [{row['ci_low']:+.{digits}f}, {row['ci_high']:+.{digits}f}]"
        if row["units"]:
            interval += f" {row['units']}"
        needed = row["seeds_needed"]
        needed = "-" if row["holm_level"] is None else "> 100000" if needed is None else needed
        level = "-" if row["holm_level"] is None else f"{row['holm_level']:.4f}"
        resampled = {"seeds": "seeds", None: "-"}.get(row.get("resamples"), "seeds + items")
        lines.append(f"| `{row['name']}` | {row['family']} | {row['verdict']} | {interval} | "
                     f"{_p(row['p_holm'])} | {_p(row['p'])} | {_p(row.get('p_seeds_only'))} | "
                     f"{level} | {needed} | {resampled} | {row['text']} |")  # fmt: skip
    return lines if shown else [f"(No claim of the `{family}` family: this run lacks its arms.)"]


def claims_provenance(settings: dict) -> str:
    """Whether this run's records were written under the claim list the report applies."""
    version = settings.get("claims_version")
    if version == CLAIMS_VERSION:
        return (
            f"Declared in `megatron_rlhf/study/claims.py` (claim list version {version}) "
            "before this run's records were written."
        )
    written = "an earlier list" if version is None else f"list version {version}"
    return (
        f"Applied after the fact: this run's records were written under {written}, and "
        f"`megatron_rlhf/study/claims.py` (list version {CLAIMS_VERSION}, its "
        "`CLAIMS_VERSION` says what changed) was revised after they were read, so these "
        "verdicts are a re-analysis, not pre-declared."
    )


def claims_rule(results: dict) -> str:
    """How every claims table below is read."""
    intervals = results.get("intervals") or {}
    resamples = intervals.get("resamples", "the")
    return (
        "Each row compares two settings on the seeds both ran, in the paper's direction (a "
        "one-sample claim such as 'beats SFT' compares with 0). Difference: the mean over seeds "
        "of the per-seed difference, with its 95 % interval estimate ± t(0.975, seeds − 1) · se, "
        "se² the seeds' variance (the per-seed differences' sd², over seeds) plus the held-out "
        f"items' (the estimate's variance over {resamples} resamples of each world's judged "
        "prompts, or for Table 1 its scored pairs, one draw per world shared by both models and "
        "every seed of it, with replacement, the seeds fixed; `resampled`: seeds + items). The "
        "hacking claim resamples seeds only (its "
        "per-seed value is a slope fitted over the curve's checkpoints). p: two-sided t with "
        "seeds − 1 df on (difference + margin) / se (non-inferiority: the AM may lose "
        f"{ACCURACY_NI_MARGIN:g} accuracy point); p (seeds only): the paired t-test over seeds "
        "alone, which treats the one held-out draw per world as fixed, beside it for comparison; "
        f"p (Holm): Holm-corrected within the family. Reproduced / contradicted: Holm p < "
        f"{ALPHA:g} on the paper's / the other side; inconclusive otherwise. Holm level: the "
        f"level the claim is held to at its rank in its family, {ALPHA:g} / (family size − "
        "rank + 1), rank 1 the smallest p. Seeds needed: the fewest seeds at which a t-test at "
        f"the Holm level has {POWER:.0%} power (noncentral t) if the observed difference were "
        "the truth and its per-seed sd were se · √seeds (so the held-out items' share of the "
        "noise counts, at this run's held-out set sizes); a planning figure, optimistic for an "
        "effect read off the same records. Every row is in results.json (`claims`, with the "
        "seeds-only interval `ci_seeds_only`)."
    )


def verdict_summary(rows: list[dict]) -> list[str]:
    """One line per verdict of the paper's claims (Holm-corrected)."""
    lines = []
    for verdict in ("reproduced", "contradicted", "inconclusive"):
        texts = [r["text"] for r in rows if r["family"] == "paper" and r["verdict"] == verdict]
        if texts:
            lines.append(f"- **{verdict.capitalize()}** ({len(texts)}): " + "; ".join(texts) + ".")
    return lines


def beats_sft_md(results: dict, arms: list[str]) -> list[str]:
    """Which arms beat SFT on the main set (95 % interval above 0): whether "AM-PPO-SR beats
    SFT" says anything about rehearsal."""
    cells = {arm: results["table2"][arm]["main"] for arm in arms if arm != "null"}
    if not cells or any(cell.get("ci_low_crossed") is None for cell in cells.values()):
        return []
    above = [_label(results, arm) for arm, cell in cells.items() if cell["ci_low_crossed"] > 0]
    return ["", f"Main-set net win over SFT with its 95 % interval (seeds and prompts "
            f"resampled) above 0 (unadjusted): {len(above)} of {len(cells)} trained arms of "
            f"Table 2 ({', '.join(above) or 'none'}). Beating SFT is evidence for rehearsal "
            "only where the arms without it do not."]  # fmt: skip


# ---------------------------------------------------------------- the world and the run


def world_md(settings: dict) -> list[str]:
    """The world, read off ``study/world.py``'s constants."""
    from megatron_rlhf.study import world

    specs = world.TASK_SPECS
    pref, minor = world.PREFERENCE_TASKS, world.MINOR_TASKS
    shares = ", ".join(f"{t} {100 * s:g} %" for t, s in world.PPO_SHARES.items())
    broken = 100 * world.PREFERENCE_STYLE.p_broken
    off_topic = 100 * (1 - world.PREFERENCE_STYLE.p_topic)
    weights = ", ".join(f"{t} {specs[t].because_weight:+g}" for t in specs)
    bands = ", ".join(f"{t} {specs[t].band[0]}-{specs[t].band[1]}" for t in specs)
    return [
        f"A text world with a known gold reward (`megatron_rlhf/study/world.py`): "
        f"{len(specs)} task families, the preference families {', '.join(pref)} and the "
        f"*minor skills* {', '.join(minor)}. The SFT data holds all {len(specs)} alike; the "
        f"preference data only the preference families, {broken:g} % of its responses ill "
        f"formed (shuffled words or another family's template) and {off_topic:g} % off topic, "
        "so the reward models learn form and topic and never see a minor skill; the PPO "
        f"prompt pool is skewed ({shares}): PPO optimises the minor skills against reward "
        "models that never saw one. Gold reward per family: offset + scale × (form + topic + "
        f"{world.BAND_WEIGHT:g} × in band + w × 'because'); 'because' weights w: {weights}; "
        f"length bands (words): {bands}. So a policy that learns 'because' from qa and the "
        "preference families' lengths loses gold on the minor skills (the *hack's transfer* "
        "and the *skill*, split below).",
        "",
        "Judged sets (every seed of a world on the same prompts): **main**, held-out prompts "
        "of the preference families; **forget**, the paper's 'SFT test data' (§4.1), held-out "
        "prompts of every family; **minor**, the forget prompts of the minor skills pooled "
        "(the *primary forget endpoint*), and per skill `minor_<skill>`; **transfer**, the "
        "forget prompts of the preference families (main-family transfer). Preferences are "
        "Bradley-Terry draws on the gold reward with family-dependent noise; PPO arms are "
        "judged by the gold reward, not by a learned model. Tiny BLOOMs (hidden "
        f"{settings['hidden']}, {settings['layers']} layers) trained on CPU: the point is the "
        "*direction and size of the differences* with their intervals, not the levels.",
    ]


def seeds_md(settings: dict) -> list[str]:
    """Which seeds run which part, and the worlds they are nested in."""
    seeds = settings["seeds"]
    worlds = settings.get("worlds")
    lines = []
    if isinstance(worlds, dict):
        by_world: dict[int, list[int]] = {}
        for seed, w in sorted(worlds["seed_world"].items(), key=lambda kv: int(kv[0])):
            by_world.setdefault(int(w), []).append(int(seed))
        cells = [f"world {w} (world seed {worlds['world_seeds'][w]}): seeds "
                 f"{', '.join(map(str, by_world.get(w, [])))}"
                 for w in range(worlds["count"])]  # fmt: skip
        lines.append(
            f"Seeds are nested in {worlds['count']} world(s), each its own SFT data, preference "
            "data, held-out sets, tokenizer and SFT policy; a seed fixes the reward models' "
            "init and data order, k-means, PPO and evaluation sampling: " + "; ".join(cells) + "."
        )
    parts = [("attribution_seeds", "the attribution arms (γ " +
              f"{settings.get('attribution_gamma', '-')})"),
             ("curve_seeds", "the hacking curves"),
             ("extra_reward_seeds", "the over-trained and margin reward models"),
             ("exploratory_seeds", "the exploratory arms"),
             ("sweep_seeds", "the Fig. 6 sweep")]  # fmt: skip
    cells = []
    for key, what in parts:
        if key not in settings:
            continue
        count = min(settings[key], seeds)
        if key == "sweep_seeds" and not settings.get("sweep_clusters"):
            count = 0
        cells.append(f"{what}: {'every seed' if count == seeds else f'first {count}'}"
                     if count else f"{what}: not run")  # fmt: skip
    if cells:
        lines += ["", "Every seed runs the core (Table 1's RM and AM, Table 2's core arms); "
                  + "; ".join(cells) + ". Each table gives its seeds."]  # fmt: skip
    return lines


def run_time(settings: dict) -> list[str]:
    if "seconds" not in settings:
        return []
    jobs = settings.get("jobs", 1)
    processes = "one process" if jobs == 1 else f"{jobs} worker processes for the tasks"
    cpu = settings.get("cpu_seconds")
    cpu = "" if cpu is None else f", {cpu / 60:.1f} min CPU"
    return [f"Run: {settings['seconds'] / 60:.1f} min wall{cpu} ({processes}, one torch thread "
            "each)." + _parts(settings) + _started(settings) + _resumed(settings), ""]  # fmt: skip


def _started(settings: dict) -> str:
    """When the run started and from which commit (``run.code_provenance``), where recorded."""
    if "started_utc" not in settings:
        return ""
    commit = settings.get("git_commit")
    if commit is None:
        code = f"no commit recorded ({settings.get('git', 'not a git checkout')})"
    else:
        changes = "with uncommitted changes" if settings.get("git_dirty") else "clean"
        code = f"commit {commit[:12]}, {changes}"
    return f" Started {settings['started_utc']} from {code}."


def _resumed(settings: dict) -> str:
    resumed = settings.get("resumed_utc") or []
    return f" Resumed (`--resume`) at {', '.join(resumed)}." if resumed else ""


def _parts(settings: dict) -> str:
    """The run's task time by part (``run.part_seconds``), where the run recorded it."""
    parts = settings.get("part_seconds")
    if not parts:
        return ""
    names = {"worlds": "worlds (data, SFT)", "core": "core (every seed)",
             "extra_rewards": "over-trained and margin reward models",
             "exploratory": "exploratory arms", "attribution": "attribution arms",
             "curves": "hacking curves", "sweep": "Fig. 6 sweep"}  # fmt: skip
    cells = [f"{names.get(k, k)} {v / 60:.1f}" for k, v in parts.items()]
    return (
        " Task minutes by part (summed over the worker processes, which run "
        f"{settings.get('jobs', 1)} at a time): " + ", ".join(cells) + "."
    )


def _listed(value) -> list:
    """A per-world setting as a list (a run before worlds recorded one)."""
    return value if isinstance(value, list) else [value]


def data_md(settings: dict) -> list[str]:
    """Per world: record counts, the minor skills' forget prompts, held-out overlap, the
    preference test's Bayes accuracy, the generation budget and SFT's loss."""
    from megatron_rlhf.study.world import MINOR_TASKS

    data = _listed(settings["data"])
    losses = settings.get("sft_losses") or [None] * len(data)
    if not isinstance(settings["data"], list):  # a run before worlds: one world's losses
        losses = [losses]
    counts = ("sft", "pref_train", "pref_test", "ppo_prompts", "main_test", "forget_test")
    lines = ["| world | world seed | " + " | ".join(counts) + " | of which minor skills "
             "(PPO; forget) | held-out prompts in a training set (main; forget) | Bayes "
             "accuracy, preference test % | generation budget (tokens) | SFT loss first → "
             "last |", "|---|---|" + "---:|" * len(counts) + "---|---|---:|---:|---|"]  # fmt: skip
    for index, (summary, loss) in enumerate(zip(data, losses)):
        families = summary.get("families", {})
        minor = "; ".join(", ".join(f"{t} {families.get(name, {}).get(t, 0)}" for t in MINOR_TASKS)
                          for name in ("ppo_prompts", "forget_test"))  # fmt: skip
        overlap = summary.get("held_out_overlap", {})
        budget = (summary.get("generation_budget") or {}).get("budget", "-")
        oracle = summary.get("oracle_accuracy_pref_test")
        loss = f"{loss[0]:.2f} → {loss[-1]:.2f}" if loss else "-"
        lines.append(
            f"| {index} | {summary.get('world_seed', '-')} | "
            + " | ".join(str(summary.get(k, "-")) for k in counts)
            + f" | {minor} | {overlap.get('main_test', '-')}; {overlap.get('forget_test', '-')} | "
            + ("-" if oracle is None else f"{oracle:.1f}")
            + f" | {budget} | {loss} |"
        )
    longest = [(i, (s.get("generation_budget") or {}).get("longest")) for i, s in enumerate(data)]
    longest = [(i, row) for i, row in longest if row]
    lines += ["", "Held-out overlap is checked by the study before any training (a run with "
              "any stops). The generation budget serves PPO, D_R's SFT responses and "
              "evaluation alike, above the longest SFT demonstration of every family (tokens, "
              "EOS included): " + "; ".join(
                  f"world {i}: " + ", ".join(f"{k} {v}" for k, v in row.items())
                  for i, row in longest) + "." if longest else ""]  # fmt: skip
    return lines


# ---------------------------------------------------------------- Table 1, Fig. 4


def calibration_md(results: dict) -> list[str]:
    """The AM's confidence cap per margin and the ECE noise floor of the test set."""
    floor, caps = results["ece_noise_floor"], results["am_confidence_cap"]
    worlds = results.get("worlds", 1)
    where = "world 0's" if worlds > 1 else "these"
    lines = [
        f"ECE noise floor: a perfectly calibrated scorer on {where} held-out pairs (its score "
        f"gap logit(p_true), labels redrawn from p_true) gets ECE {floor['mean']:.2f} on average "
        f"(95 % of draws in [{floor['low']:.2f}, {floor['high']:.2f}]); an ECE in that range "
        "cannot be told from perfect calibration here.",
        "",
        "The AM's confidence cap: Eq. 6 per pair, even for a label that never varies, is "
        "minimised at a_c = -a_r = m/3, so the AM's score gap is at most 2m/3 and its "
        "confidence at most σ(2m/3) (`stats.confidence_cap`). Pairs whose true confidence "
        f"max(p, 1 - p) exceeds the cap ({where} held-out pairs) can only be under-called by "
        "the AM:",
        "",
        "| m | cap σ(2m/3) | held-out pairs above the cap % | highest AM confidence (any seed) |",
        "|---:|---:|---:|---:|",
    ]
    for m, model in TABLE1_MARGINS.items():
        cap, seen = caps[f"{m:g}"], results["max_confidence"].get(model)
        seen = f"{max(seen['per_seed']):.3f}" if seen else "-"
        lines.append(f"| {m:g} | {cap['cap']:.3f} | {cap['pairs_above']:.1f} | {seen} |")
    return lines


def table1_md(results: dict) -> list[str]:
    lines = ["| scorer | seeds | accuracy % ↑ | ECE ↓ | over-confidence (signed) | Brier vs "
             "p_true ↓ | paper accuracy (HH; prop.) | paper ECE (HH; prop.) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, row in results["reward_models"].items():
        paper = PAPER_TABLE1.get(model)
        cells = [model if model in ("rm", "am") else f"{model} (descriptive)",
                 str(len(row["accuracy"]["per_seed"])), fmt(row["accuracy"]), fmt(row["ece"]),
                 fmt(row["overconfidence"]), fmt(row["brier"], 4)]  # fmt: skip
        cells += [", ".join(f"{v:.2f}" for v in paper[k]) if paper else "-"
                  for k in ("accuracy", "ece")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    oracle = results["oracle_accuracy"]
    lines += ["", "Oracle accuracy (ranking by the gold reward, in expectation over the labels' "
              f"noise; per seed on its world's held-out pairs, mean over seeds): "
              f"{oracle['mean']:.2f} %."]  # fmt: skip
    extra = [m for m in results["reward_models"] if m not in ("rm", "am")]
    if extra:
        lines += ["", "Rows marked descriptive (`rm_long`/`am_long`: over-trained; "
                  "`am_m<m>`: the AM with margin m, Table 1's AM uses m = 2.5) carry no claim "
                  "(claims v5 dropped them: a few seeds under Holm pass only huge effects)."]  # fmt: skip
    return lines


def per_task_md(results: dict) -> list[str]:
    models = [m for m in ("rm", "am", "rm_long", "am_long") if m in results["per_task"]]
    tasks = sorted(results["per_task"][models[0]])
    lines = ["| task | " + " | ".join(f"{m} mean | {m} std | {m} std / scale" for m in models)
             + " |", "|---|" + "---|---|---|" * len(models)]  # fmt: skip
    for task in tasks:
        cells = []
        for model in models:
            stats = results["per_task"][model][task]
            cells += [fmt(stats["mean"]), fmt(stats["std"]), fmt(stats["std_scaled"])]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------- Table 2


def table2_md(results: dict, arms: list[str]) -> list[str]:
    """Main and minor (primary forget endpoint) outcome rates and net wins, transfer, KL."""
    lines = ["| arm | seeds | main win / tie / lose % | main net win % | minor win / tie / "
             "lose % | **minor net win %** (primary forget endpoint) | transfer net win % | "
             "KL to SFT | paper main W/L/T; forget W/L/T |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        row = results["table2"][arm]
        cells = [_label(results, arm), str(_seeds(results, arm))]
        for set_name in ("main", "minor"):
            cell = row.get(set_name)
            cells.append("-" if cell is None else
                         f"{cell['win']:.1f} / {cell['tie']:.1f} / {cell['lose']:.1f}")  # fmt: skip
            cells.append(_net_cell(results, arm, set_name))
        cells += [_net_cell(results, arm, "transfer"), _kl(results, arm)]
        paper = PAPER_TABLE2.get(arm)
        cells.append("; ".join(" / ".join(f"{v:.1f}" for v in paper[i:i + 3]) for i in (0, 3))
                     if paper else "-")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table2_skills_md(results: dict, arms: list[str]) -> list[str]:
    """Per minor skill and the whole forget set (net win), the hacking index, truncation."""
    skills = minor_sets(results, arms[0])
    lines = ["| arm | " + " | ".join(f"{s.removeprefix('minor_')} net win %" for s in skills)
             + " | forget (all families) net win % | hacking index (main; descriptive) | cut "
             "by the budget % (policy main / forget; SFT main / forget) |",
             "|---|" + "---|" * (len(skills) + 3)]  # fmt: skip
    for arm in arms:
        cells = [_net_cell(results, arm, s) for s in (*skills, "forget")]
        cells += [fmt(results["arms"][arm]["main"]["hacking_index"]),
                  truncation_cell(results["arms"][arm])]  # fmt: skip
        lines.append(f"| {_label(results, arm)} | " + " | ".join(cells) + " |")
    return lines


def truncation_cell(extras: dict) -> str:
    """Seed-mean share of responses cut by the generation budget, policy then SFT."""
    if "truncated_policy" not in extras["main"]:
        return "-"
    cells = [f"{extras[s][f'truncated_{who}']['mean']:.1f}" for who in ("policy", "sft")
             for s in ("main", "forget")]  # fmt: skip
    return f"{cells[0]} / {cells[1]}; {cells[2]} / {cells[3]}"


def hacking_md(results: dict, arms: list[str]) -> list[str]:
    """Per task on the main set: the hacking index and the planted feature's rate change."""
    tasks = sorted(key.removeprefix("hacking_") for key in results["arms"][arms[0]]["main"]
                   if key.startswith("hacking_") and key != "hacking_index")  # fmt: skip
    if not tasks:
        return []
    lines = ["| arm | " + " | ".join(f"{t}: hacking / 'because' Δ%" for t in tasks) + " |",
             "|---|" + "---|" * len(tasks)]  # fmt: skip
    for arm in arms:
        main = results["arms"][arm]["main"]
        cells = [f"{main[f'hacking_{t}']['mean']:+.2f} / "
                 + (f"{main[f'because_{t}']['mean']:+.1f}" if f"because_{t}" in main else "-")
                 for t in tasks]  # fmt: skip
        lines.append(f"| {_label(results, arm)} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------- hacking along the run


def curves_md(results: dict) -> list[str]:
    """The hacking curves: per checkpoint, gold and training-reward gains (SFT-std units), KL,
    and the main net win of the checkpoint's arm; then the slopes."""
    curves = results.get("hacking_curves") or {}
    if not curves:
        return ["(This run has no hacking curves.)"]
    rewards = sorted(curves, key=lambda r: r != "rm")
    steps = sorted({int(s) for curve in curves.values() for s in curve})
    head = []
    for reward in rewards:
        name = f"{reward.upper()}-PPO"
        head += [f"{name} gold gain", f"{name} training-reward gain", f"{name} KL to SFT",
                 f"{name} main net win %"]  # fmt: skip
    lines = ["| PPO step | " + " | ".join(head) + " |", "|---:|" + "---|" * len(head)]
    for step in steps:
        cells = []
        for reward in rewards:
            point = curves[reward].get(str(step))
            if point is None:
                cells += ["-"] * 4
                continue
            cells += [fmt(point["gold_gain_z"]), fmt(point["train_gain_z"]),
                      fmt(point["kl"]) if "kl" in point else "-",
                      _net_cell(results, f"{reward}_ppo_step{step}", "main") if step else "0"]  # fmt: skip
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    slopes = results.get("hacking_slopes") or {}
    if slopes:
        cells = [f"{reward.upper()}-PPO {fmt(slopes[reward], 3)} ("
                 + _count(len(slopes[reward]["per_seed"]), "seed") + ")"
                 for reward in rewards if reward in slopes]  # fmt: skip
        lines += ["", "Gold gained per unit of training reward gained (least-squares slope "
                  "through the origin over the checkpoints, per seed; mean [seed t-interval]): "
                  + "; ".join(cells) + ". A lower slope is more hacking: the claim "
                  "`rm_ppo_hacks_more` (paper family) tests AM's minus RM's."]  # fmt: skip
    return lines


# ---------------------------------------------------------------- composition


def composition_md(results: dict, arms: list[str], set_name: str = "main") -> list[str]:
    """Per arm on ``set_name``: the gold gain over SFT in task-scale units split into its terms
    (the skill = form + band, topic, 'because'), and the net win split by which term changed
    (``stats.gold_composition``)."""
    first = results["arms"][arms[0]].get(set_name, {})
    if "utility_gain" not in first:
        return ["(These records carry no planted-feature flag: no composition.)"]
    split = "utility_form" in first
    parts = ["skill", "form", "band", "topic"] if split else ["form_topic", "band"]
    names = {"skill": "**skill** (form + band)", "form": "form", "topic": "topic",
             "band": "band", "form_topic": "form + topic"}  # fmt: skip
    lines = [
        "| arm | seeds | gold gain (scale units) [95 % CI] | "
        + " | ".join(names[p] for p in parts)
        + " | **'because'** (hack transfer) | net win % | because only | band only | "
        "form/topic only | several |",
        "|---|---|---|" + "---|" * (len(parts) + 6),
    ]
    for arm in arms:
        cell = results["arms"][arm].get(set_name)
        if cell is None:
            continue
        terms = [f"{cell[f'utility_{p}']['mean']:+.3f}" for p in (*parts, "because")]
        flips = [f"{cell[f'net_win_{k}']['mean']:+.1f}"
                 for k in ("because", "band", "form_topic", "mixed")]  # fmt: skip
        net = results["table2"][arm][set_name]["net_win"]
        lines.append(f"| {_label(results, arm)} | {_seeds(results, arm)} | "
                     f"{fmt(cell['utility_gain'], 3)} | " + " | ".join(terms)
                     + f" | {net:+.1f} | " + " | ".join(flips) + " |")  # fmt: skip
    return lines


def skills_split_md(results: dict, arms: list[str]) -> list[str]:
    """Per minor skill: the skill (form + band) and 'because' utility, policy - SFT."""
    skills = minor_sets(results, arms[0])
    if not skills or "utility_skill" not in results["arms"][arms[0]].get(skills[0], {}):
        return []
    lines = ["| arm | " + " | ".join(f"{s.removeprefix('minor_')}: skill / 'because'"
                                     for s in skills) + " |",
             "|---|" + "---|" * len(skills)]  # fmt: skip
    for arm in arms:
        cells = [f"{_mean(results, arm, s, 'utility_skill')} / "
                 f"{_mean(results, arm, s, 'utility_because')}" for s in skills]  # fmt: skip
        lines.append(f"| {_label(results, arm)} | " + " | ".join(cells) + " |")
    return lines


def composition_note(results: dict, arms: list[str]) -> str:
    first = results["arms"][arms[0]]["main"]
    if "utility_form" in first:
        return ("Form and topic are recorded per response (`form_*`, `topic_*`, `in_band_*`, "
                "`because_*` in every judgment record).")  # fmt: skip
    return (
        "These records do not carry form and topic per response (only the planted feature "
        "and the gold reward): form + topic and the band are read off the gold reward "
        "(`stats.response_parts`), and form and topic cannot be told apart (a response "
        "with form + topic = 1 has either). A run with today's code records both."
    )


# ---------------------------------------------------------------- rehearsal, attribution


def _minor_share(row: dict) -> float:
    from megatron_rlhf.study.world import MINOR_TASKS

    return sum(row[f"share_{t}"]["mean"] for t in MINOR_TASKS if f"share_{t}" in row)


def rehearsal_md(results: dict) -> list[str]:
    """What each D_R is made of (``stats.rehearsal_table``), seed means."""
    table = results.get("rehearsal") or {}
    if not table:
        return ["(These records carry no D_R records.)"]
    from megatron_rlhf.study.world import TASK_SPECS

    names = [n for n in REHEARSAL_LABELS if n in table] + sorted(
        n for n in table if n not in REHEARSAL_LABELS)  # fmt: skip
    tasks = [t for t in TASK_SPECS if f"share_{t}" in table[names[0]]]
    lines = ["| D_R | seeds | size | gold utility | well formed % | on topic % | 'because' % | "
             "in band % | minor skills % | " + " | ".join(f"{t} %" for t in tasks) + " |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(tasks)]  # fmt: skip
    for name in names:
        row = table[name]
        cells = [
            REHEARSAL_LABELS.get(name, name),
            str(len(row["size"]["per_seed"])),
            f"{row['size']['mean']:.0f}",
            fmt(row["utility"], 2),
        ]
        cells += [f"{row[key]['mean']:.1f}" for key in ("form", "topic", "because", "in_band")]
        cells.append(f"{_minor_share(row):.1f}")
        cells += [f"{row[f'share_{t}']['mean']:.1f}" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _dr_cell(results: dict, arm: str) -> str:
    """The arm's D_R: its name, size and minor-skill share (seed means)."""
    match = ATTRIBUTION_ARM.fullmatch(arm)
    name = KIND_DR[match[1]] if match else ARM_DR.get(arm)
    row = (results.get("rehearsal") or {}).get(name)
    if name is None:
        return "none"
    if row is None:
        return name
    return f"{name}: {row['size']['mean']:.0f}, {_minor_share(row):.0f} % minor"


def arms_net_md(results: dict, arms: list[str]) -> list[str]:
    """Net win over SFT on main, minor (and per skill), transfer; the minor set's skill and
    'because' utility; what the D_R holds; the KL to SFT."""
    skills = minor_sets(results)
    lines = ["| arm | seeds | D_R (size, minor-skill share) | KL to SFT | main net win % | "
             "**minor net win %** | " + " | ".join(s.removeprefix("minor_") for s in skills)
             + " | transfer net win % | minor: skill / 'because' (utility) |",
             "|---|---|---|---|---|---|" + "---|" * len(skills) + "---|---|"]  # fmt: skip
    for arm in arms:
        if arm not in results["table2"]:
            continue
        cells = [_label(results, arm), str(_seeds(results, arm)),
                 _dr_cell(results, arm), _kl(results, arm), _net_cell(results, arm, "main"),
                 _net_cell(results, arm, "minor")]  # fmt: skip
        cells += [f"{results['table2'][arm][s]['net_win']:+.1f}" if s in results["table2"][arm]
                  else "-" for s in skills]  # fmt: skip
        cells += [_net_cell(results, arm, "transfer"),
                  f"{_mean(results, arm, 'minor', 'utility_skill')} / "
                  f"{_mean(results, arm, 'minor', 'utility_because')}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def anchoring_md(results: dict, anchors: list[str]) -> list[str]:
    """The anchoring control against SR at the attribution gamma, from the KLs to SFT."""
    settings = results["settings"]
    kl = results.get("kl_to_sft") or {}
    gamma = settings.get("attribution_gamma")
    sr = f"am_ppo_sr_g{gamma:g}" if gamma is not None else None
    if not anchors or sr not in kl or "am_ppo" not in kl:
        return []
    base_beta = settings["ppo"]["kl_coef"]
    sr_kl, am_kl = kl[sr]["mean"], kl["am_ppo"]["mean"]
    cells = ", ".join(f"β {_anchor_beta(a, settings):g} {kl[a]['mean']:.2f}" for a in anchors
                      if a in kl and _anchor_beta(a, settings) is not None)  # fmt: skip
    text = (
        f"The anchoring control: AM-PPO without rehearsal at a larger KL coefficient than the "
        f"shared β {base_beta:g}, to ask whether rehearsal helps the minor skills only by "
        "holding the policy near SFT. The issue asked for the β that matches SR's KL to SFT. "
        f"Mean KL to SFT over the last 5 training steps (seed means): AM-PPO {am_kl:.2f}, "
        f"AM-PPO-SR at γ {gamma:g} {sr_kl:.2f}, anchoring arms {cells or '-'}. "
    )
    if sr_kl > am_kl:
        text += (
            f"SR at γ {gamma:g} is *farther* from SFT than AM-PPO without rehearsal, so no "
            "raised β (which only lowers the KL) matches it; the anchor is held closer to SFT "
            "than SR instead (`kl_matched_coefs` in `megatron_rlhf/study/presets.py`): SR "
            "beating it on the minor skills is more than anchoring, SR losing to it says "
            "anchoring alone would do."
        )
    else:
        text += "SR is closer to SFT than AM-PPO: the anchor nearest SR's KL is its match."
    return [text]


def grid_md(results: dict, settings: dict, grid: list[str]) -> list[str]:
    """RM-PPO and AM-PPO at every PPO setting the run has, the frozen one first."""
    ppo = settings["ppo"]
    rows = [(f"lr {ppo['actor_lr']:g}, {ppo['steps']} steps (frozen)", "rm_ppo", "am_ppo")]
    for arm in sorted(a for a in grid if a.startswith("am_")):
        rows.append((arm.removeprefix("am_ppo_"), "rm" + arm.removeprefix("am"), arm))
    lines = ["| PPO setting | seeds | RM-PPO main | AM-PPO main | RM-PPO minor | AM-PPO minor |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for label, rm, am in rows:
        if rm not in results["table2"] or am not in results["table2"]:
            continue
        lines.append(f"| {label} | {_seeds(results, am)} | " + " | ".join(
            _net_cell(results, arm, s) for s in ("main", "minor") for arm in (rm, am)) + " |")  # fmt: skip
    return lines


def sweep_rows(results: dict) -> list[tuple[int, int, str]]:
    rows = []
    for arm in results["table2"]:
        if match := SWEEP_ARM.fullmatch(arm):
            rows.append((int(match[1]), int(match[2]), arm))
    return sorted(rows)


def sweep_md(results: dict, settings: dict) -> list[str]:
    c0, k0 = settings["clusters"], settings["top_k"]
    rows = sorted(sweep_rows(results) + [(c0, k0, "am_ppo_sr")])
    lines = [
        "| c | k | c·k | seeds | main net win % | main gold gain | minor net win % |",
        "|---:|---:|---:|---:|---|---|---|",
    ]
    for c, k, arm in rows:
        gold = results["arms"][arm]["main"]["gold_gain"]
        lines.append(f"| {c} | {k} | {c * k} | {_seeds(results, arm)} | "
                     f"{_net_cell(results, arm, 'main')} | {fmt(gold, 3)} | "
                     f"{_net_cell(results, arm, 'minor')} |")  # fmt: skip
    spread = results["table2"]["am_ppo_sr"]["main"]["per_seed"]
    gold_spread = results["arms"]["am_ppo_sr"]["main"]["gold_gain"]["per_seed"]
    counts = sorted({_seeds(results, arm) for _, _, arm in rows})
    if len(counts) > 1:
        lines += ["", f"Seeds per row: {', '.join(map(str, counts))} (the sweep runs on the "
                  "first seeds only). Intervals of rows over different seeds overlapping is "
                  "not a test that the counts are equivalent; no claim about c is made here."]  # fmt: skip
    if len(spread) > 1:
        lines += ["", f"Seed-to-seed spread of AM-PPO-SR (c={c0}, k={k0}): main net win std "
                  f"{np.std(spread, ddof=1):.1f} points, gold gain std "
                  f"{np.std(gold_spread, ddof=1):.3f} over {len(spread)} seeds."]  # fmt: skip
    return lines


# ---------------------------------------------------------------- report.md


def intervals_md(results: dict) -> str:
    intervals = results.get("intervals") or {}
    how = (f" ({intervals['resamples']} resamples, numpy seed {intervals['numpy_seed']})"
           if "resamples" in intervals else "")  # fmt: skip
    return (
        "Intervals (95 %): a cell `mean [low, high]` is a Student-t interval across seeds; it "
        "counts the seeds' noise only, since every seed of a world is judged on the same "
        "held-out prompts and scores the same pairs. Net-win cells add ⟨low, high⟩, the "
        "held-out-aware interval: se² is the seeds' variance plus the held-out prompts' (each "
        f"world's prompts resampled with replacement, the seeds fixed, the worlds as strata{how}), "
        "estimate ± t(0.975, seeds − 1) · se. Every claim's verdict is read from the second "
        "kind (the Claims section says how). Within-seed bootstrap intervals (over pairs / "
        "prompts) are in results.json (`reward_bootstrap`, `arms.*.net_win_bootstrap`)."
        + crossed_check(results)
    )


def crossed_check(results: dict) -> str:
    """How much the held-out items add to the seeds' noise in this run: the median and the
    largest ratio of a claim's se to its seeds-only se (never below 1: the items' variance is
    added to the seeds')."""
    rows = [r for r in results["claims"] if r.get("resamples") not in (None, "seeds")
            and r.get("se") and r.get("se_seeds")]  # fmt: skip
    if not rows:
        return ""
    ratios = sorted(r["se"] / r["se_seeds"] for r in rows)
    return (
        f" In this run the held-out items widen a claim's se over its seeds-only se by "
        f"{float(np.median(ratios)):.2f}x (median of {len(rows)} claims that resample items; "
        f"at most {ratios[-1]:.2f}x)."
    )


def write_report(out: Path, results: dict, pairs: dict) -> None:
    """report.md and the PNGs in ``out`` from ``results`` and the held-out ``pairs``
    (``pairs[model][seed]``, the reliability and per-task figures' records)."""
    settings = results["settings"]
    write_plots(out, results, pairs)
    groups = arm_groups(results)
    main_arms = groups["table2"]
    trained = [a for a in main_arms if a != "null"]
    checked = results["claims"]
    rehearsal_arms = [a for a in ("am_ppo", "am_ppo_sr", "am_ppo_rr", "am_ppo_sr_gold",
                                  "am_ppo_sft", "rm_ppo_sr") if a in results["table2"]]  # fmt: skip
    attribution = [a for a in ("am_ppo", "am_ppo_sr") if a in results["table2"]]
    attribution += groups["attribution"]
    anchors = [a for a in groups["attribution"] if ANCHOR_ARM.fullmatch(a)]
    gamma = settings.get("attribution_gamma")
    split_arms = [a for a in ("rm_ppo", "rm_ppo_ma", "am_ppo", "am_ppo_sr")
                  if a in results["table2"]] + groups["attribution"]  # fmt: skip
    from megatron_rlhf.study.world import TASK_SPECS

    lines = [
        f"# Study: the paper's claims measured (preset `{settings['preset']}`, "
        f"{settings['seeds']} seeds"
        + (
            f", {settings['first_seed']} to {settings['first_seed'] + settings['seeds'] - 1}"
            if settings.get("first_seed")
            else ""
        )
        + ")",
        "",
        *seeds_md(settings),
        "",
        *world_md(settings),
        "",
        *run_time(settings),
        intervals_md(results),
        "",
        "## Data",
        "",
        "Per world (records; `families` per set in results.json `settings.data`):",
        "",
        *data_md(settings),
        "",
        "## Claims",
        "",
        claims_provenance(settings),
        "",
        claims_rule(results),
        "",
        "The paper's claims (only this family counts for or against the paper; forgetting is "
        "measured on the minor skills pooled, the primary forget endpoint):",
        "",
        *claims_md(checked, "paper"),
        "",
        *verdict_summary(checked),
        *beats_sft_md(results, trained),
        "",
        "The other families, each Holm-corrected on its own, are in their sections: "
        "`minor_split` (the minor skills: skill vs the hack's transfer), `transfer` (Table 2), "
        "`rehearsal` (Selective Rehearsal at the paper's γ), `attribution` (where rehearsal "
        "acts), `exploratory`. Claims v5 dropped the margin, over-training and PPO-settings "
        "claims (`megatron_rlhf/study/claims.py` says why); their models and arms, where this "
        "run has them, are descriptive rows below.",
        "",
        "## Table 1 / Fig. 2: reward vs advantage model on held-out pairs",
        "",
        *table1_md(results),
        "",
        "Over-confidence: mean(confidence − correct) ×100, the ECE's terms with their sign "
        "(> 0: over-confident).",
        "",
        *calibration_md(results),
        "",
        "![reliability](reliability.png)",
        "",
        "## Fig. 4: score mean and std per task",
        "",
        *per_task_md(results),
        "",
        "![per task](per_task.png)",
        "",
        "## Table 2: policies vs SFT, judged by the gold reward",
        "",
        f"Tie: |g(policy) − g(SFT)| ≤ {settings['tie_margin']} × the task's gold scale. Net "
        "win: win − lose, % of the set's prompts; `mean [seeds' t-interval] "
        f"{CROSSED}` (seeds and prompts resampled). KL to SFT: PPO's mean KL over its last 5 "
        "training steps (seed means [t-interval]). Every arm's critic starts from the SFT trunk "
        "with a fresh value head. The null arm (0 PPO steps) must tie everywhere. Same β = "
        f"{settings['ppo']['kl_coef']}, actor lr {settings['ppo']['actor_lr']}, "
        f"{settings['ppo']['steps']} steps × {settings['ppo']['prompts_per_step']} prompts, "
        f"rehearsal γ = {settings['ppo']['rehearsal_gamma']:g} for every arm unless its name "
        "says otherwise (`Preset.ppo` in `megatron_rlhf/study/presets.py`). The paper's judge "
        "is GPT-4 and its ties are ~75 %: its numbers are beside ours for direction only (its "
        "forget set is all of its SFT test data).",
        "",
        *table2_md(results, main_arms),
        "",
        "Per minor skill (forget-set prompts of each; reported, not claimed), the whole forget "
        "set, the hacking index (per task, training-reward gain minus gold gain over SFT, each "
        "in units of the task's SFT responses' std, averaged over tasks; descriptive: the "
        "paper's measure is the curve below) and the share of responses cut by the generation "
        "budget:",
        "",
        *table2_skills_md(results, main_arms),
        "",
        "Main-family transfer (forget-set prompts of the preference families; Holm within "
        "this family):",
        "",
        *claims_md(checked, "transfer"),
        "",
        "Reward hacking per task (main set, descriptive): hacking index and the change in the "
        "share of responses with the planted feature 'because' (policy − SFT, points; the gold "
        "reward rewards it in qa and penalises it in code, so a rise in code is hacking the "
        "learned reward):",
        "",
        *hacking_md(results, main_arms),
        "",
        "What the main set's gold gain is made of: the policy's mean gold reward minus SFT's "
        "in units of each task's scale, split exactly into the gold reward's terms (skill = "
        "form + band, topic, w_t × 'because'; form + topic + band + 'because' = the gain), "
        "seed means; and the net win split by which term changed between the policy's and "
        "SFT's response to a prompt (one term only, or several; the columns sum to the net "
        "win). " + composition_note(results, main_arms),
        "",
        *composition_md(results, main_arms, "main"),
        "",
        "![net win](net_win.png)",
        "",
        "## Fig. 5: reward hacking along the PPO run",
        "",
        "The paper's measure: one RM-PPO and one AM-PPO run per curve seed, judged on the main "
        "set at each checkpoint; gold gain and training-reward gain over SFT per task in units "
        "of the task's SFT responses' std, averaged over tasks (step 0 is SFT); KL to SFT at "
        "the checkpoint (the training record at or before it); mean [seeds' t-interval].",
        "",
        *curves_md(results),
        "",
        "![hacking](hacking.png)",
        "",
        "## The minor skills: the skill vs the hack's transfer",
        "",
        "The minor set's gold gain over SFT split into its terms (as the main set's above): "
        "the *skill* (form + band: what a forgetting policy loses) and 'because' (the planted "
        "feature learned from the preference families, penalised in every minor skill: the "
        "hack's transfer).",
        "",
        *composition_md(results, split_arms, "minor"),
        "",
        "Per skill (utility per prompt, policy − SFT, seed means):",
        "",
        *skills_split_md(results, split_arms),
        "",
        "Claims of this family (Holm within it):",
        "",
        *claims_md(checked, "minor_split"),
        "",
        "## Selective Rehearsal at the paper's γ: what D_R holds, the ceiling and the control",
        "",
        f"D_R of the main arm: c = {settings['clusters']} k-means clusters of the PPO prompts' "
        f"embeddings, the top k = {settings['top_k']} SFT responses of each by the AM. The "
        "gold top-k takes the same clusters' top k by the gold utility (the best any "
        "selection can do); the random D_R draws as many of the same responses uniformly; the "
        "family-stratified D_R takes as many, top by the AM within each family, every minor "
        "skill guaranteed k (`stages.stratified_rehearsal`); the positive control rehearses as "
        "many SFT demonstrations drawn uniformly from all "
        f"{len(TASK_SPECS)} families (the paper's 'other important data sources'). What each "
        "holds, read off its records by the world's rules (seed means; in the records archive "
        "per seed):",
        "",
        *rehearsal_md(results),
        "",
        f"The arms at γ = {settings['ppo']['rehearsal_gamma']:g} (AM-PPO without rehearsal "
        "first; the minor set's utility split into skill and 'because'):",
        "",
        *arms_net_md(results, rehearsal_arms),
        "",
        "Claims of this family (Holm within it):",
        "",
        *claims_md(checked, "rehearsal"),
        "",
        "## Attribution: where rehearsal acts" + (f" (γ = {gamma:g})" if gamma is not None else ""),
        "",
        *(
            [
                "At a γ where rehearsal moves the minor skills: AM selection, random and "
                "family-stratified D_R of equal size, SFT demonstrations (the positive "
                "control), AM-PPO without rehearsal anchored to SFT by a larger β, and the "
                "rest of the γ dose; AM-PPO and AM-PPO-SR at the paper's γ for reference.",
                "",
                *arms_net_md(results, attribution),
                "",
                *anchoring_md(results, anchors),
                "",
                "Claims of this family (Holm within it):",
                "",
            ]
            if groups["attribution"]
            else ["(This run has no attribution arms.)", ""]
        ),
        *claims_md(checked, "attribution"),
        "",
        "## Exploratory",
        "",
        "Not the paper's claims (Holm within this family):",
        "",
        *claims_md(checked, "exploratory"),
        "",
        *(
            [
                "AM-PPO vs RM-PPO across PPO settings (descriptive; the frozen setting runs on "
                "every seed, the others on the exploratory seeds). Net win % over SFT:",
                "",
                *grid_md(results, settings, groups["grid"]),
                "",
            ]
            if groups["grid"]
            else []
        ),
        *(
            [
                "## Fig. 6: cluster count of Selective Rehearsal",
                "",
                *sweep_md(results, settings),
                "",
                "![cluster sweep](cluster_sweep.png)",
                "",
            ]
            if groups["sweep"]
            else []
        ),
        "## Notes",
        "",
        "- D_R is curated by the seed's AM from one set of SFT responses to its world's PPO "
        "prompts; RM-PPO-SR rehearses the same D_R, so it differs from AM-PPO-SR only in the "
        "reward.",
        "- The random-rehearsal control draws a D_R of the same size uniformly from the same "
        "responses (one cluster, random scores).",
        *(
            [
                "- Rejection sampling: best of "
                f"{settings['ppo']['rejection_samples']} samples per prompt by the AM, kept if "
                "its advantage ≥ 0 (τ = 0), then one NLL step per batch."
            ]
            if "rejection_sampling" in results["table2"]
            else []
        ),
        "- The PPO checkpoints are deleted after judging (only the records are kept).",
        "",
    ]
    with atomic_output(out / "report.md") as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")


# ---------------------------------------------------------------- plots


def write_plots(out: Path, results: dict, pairs: dict) -> None:
    from megatron_rlhf.reward.calibration import per_task_stats, reliability_curve
    from megatron_rlhf.reward.plots import plot_calibration, plot_task_stats

    curves, tasks = {}, {}
    for model in ("rm", "am", "rm_long", "am_long"):
        if model not in pairs:
            continue
        pooled = [p for seed in sorted(pairs[model]) for p in pairs[model][seed]]
        chosen = [p["chosen_score"] for p in pooled]
        rejected = [p["rejected_score"] for p in pooled]
        curves[model] = reliability_curve(chosen, rejected, bins=8)
        tasks[model] = per_task_stats(chosen, rejected, [p["task"] for p in pooled])
    plot_calibration(out / "reliability.png", curves)
    plot_task_stats(out / "per_task.png", tasks)
    plot_net_win(out / "net_win.png", results)
    if results.get("hacking_curves"):
        plot_hacking(out / "hacking.png", results)
    if sweep_rows(results):
        plot_sweep(out / "cluster_sweep.png", results)


def _figure(cols: int, size):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="tight")
    axes = fig.subplots(1, cols)
    return fig, (axes if cols > 1 else [axes])


def _save(fig, path: Path) -> None:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def _error(cell: dict, key: str = "net_win") -> list[float]:
    """Error bar lengths: the crossed interval where there is one, else the seeds' t."""
    low, high = cell.get("ci_low_crossed"), cell.get("ci_high_crossed")
    if low is None:
        low, high = cell["ci_low"], cell["ci_high"]
    if low is None:
        return [0.0, 0.0]
    return [cell[key] - low, high - cell[key]]


def plot_net_win(path: Path, results: dict) -> None:
    """Net win vs SFT per arm (every arm but the curve checkpoints and the sweep) with its 95 %
    interval (seeds and prompts resampled), on the main set and the minor skills pooled."""
    groups = arm_groups(results)
    arms = groups["table2"] + groups["attribution"] + groups["grid"]
    sets = [s for s in ("main", "minor") if s in results["table2"][arms[0]]]
    fig, axes = _figure(len(sets), (max(11.0, 0.45 * len(arms) * len(sets)), 4.5))
    for ax, set_name in zip(axes, sets):
        cells = [results["table2"][a].get(set_name) for a in arms]
        shown = [(a, c) for a, c in zip(arms, cells) if c is not None]
        errors = np.array([_error(c) for _, c in shown]).T
        ax.bar(range(len(shown)), [c["net_win"] for _, c in shown], yerr=errors, capsize=4)
        ax.set_xticks(range(len(shown)), [a for a, _ in shown], rotation=35, ha="right")
        ax.axhline(0.0, color="black", linewidth=0.8)
        title = "minor skills pooled (forget set)" if set_name == "minor" else "main set"
        ax.set_title(f"{title}: net win over SFT (gold judge), %\n95 % interval, seeds and "
                     "prompts resampled within worlds")  # fmt: skip
        ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def plot_hacking(path: Path, results: dict) -> None:
    """Fig. 5: gold and training-reward gain over SFT (SFT-std units, main set) against the PPO
    step, RM-PPO vs AM-PPO, with the seeds' 95 % t-interval; and gold against training gain."""
    curves = results["hacking_curves"]
    fig, axes = _figure(3, (14.0, 4.0))
    colors = {"rm": "tab:red", "am": "tab:blue"}
    for reward in sorted(curves, key=lambda r: r != "rm"):
        steps = sorted(int(s) for s in curves[reward])
        points = [curves[reward][str(s)] for s in steps]
        label = f"{reward.upper()}-PPO"
        for ax, key in zip(axes[:2], ("gold_gain_z", "train_gain_z")):
            means = [p[key]["mean"] for p in points]
            errors = np.array([[0.0, 0.0] if p[key]["ci_low"] is None else
                               [p[key]["mean"] - p[key]["ci_low"],
                                p[key]["ci_high"] - p[key]["mean"]] for p in points]).T  # fmt: skip
            ax.errorbar(steps, means, yerr=errors, marker="o", capsize=4,
                        color=colors.get(reward), label=label)  # fmt: skip
        axes[2].plot([p["train_gain_z"]["mean"] for p in points],
                     [p["gold_gain_z"]["mean"] for p in points], marker="o",
                     color=colors.get(reward), label=label)  # fmt: skip
    titles = ("gold gain over SFT (SFT std)", "training-reward gain over SFT (SFT std)",
              "gold vs training-reward gain")  # fmt: skip
    for ax, title in zip(axes, titles):
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in axes[:2]:
        ax.set_xlabel("PPO step")
    axes[2].set_xlabel("training-reward gain (SFT std)")
    axes[2].set_ylabel("gold gain (SFT std)")
    _save(fig, path)


def plot_sweep(path: Path, results: dict) -> None:
    """Fig. 6: main net win and gold gain against c at fixed k and at fixed c·k; the band is
    AM-PPO-SR's seed spread (mean ± 1 std across seeds)."""
    settings = results["settings"]
    c0, k0 = settings["clusters"], settings["top_k"]
    rows = sweep_rows(results)
    fig, axes = _figure(2, (10.0, 3.8))
    base = results["table2"]["am_ppo_sr"]["main"]
    base_gold = results["arms"]["am_ppo_sr"]["main"]["gold_gain"]
    for ax, key in zip(axes, ("net_win", "gold_gain")):
        for label, keep in (("fixed k", lambda c, k: k == k0),
                            ("fixed c·k", lambda c, k: c * k == c0 * k0)):  # fmt: skip
            points = sorted((c, arm) for c, k, arm in rows if keep(c, k)) + [(c0, "am_ppo_sr")]
            points.sort()
            values = [_sweep_value(results, arm, key) for _, arm in points]
            ax.plot([c for c, _ in points], values, marker="o", label=label)
        per_seed = base["per_seed"] if key == "net_win" else base_gold["per_seed"]
        if len(per_seed) > 1:
            mean, std = float(np.mean(per_seed)), float(np.std(per_seed, ddof=1))
            ax.axhspan(mean - std, mean + std, color="gray", alpha=0.2, label="seed spread")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clusters c")
        ax.set_title("main net win %" if key == "net_win" else "main gold gain over SFT")
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)


def _sweep_value(results: dict, arm: str, key: str) -> float:
    if key == "net_win":
        return results["table2"][arm]["main"]["net_win"]
    value = results["arms"][arm]["main"]["gold_gain"]["mean"]
    return value if math.isfinite(value) else float("nan")
