"""``DIR/report.md`` and the PNGs of a study, from results.json and the raw records.

The claims, their families, margins and the decision rule are declared in
``study/claims.py``: paired per-seed differences in the paper's direction, Holm-corrected
within each family; results.json's ``claims`` holds every row the report shows.
"""

from __future__ import annotations

import math
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
REHEARSAL_LABELS = {
    "main": "AM top-k (AM-PPO-SR's D_R)", "gold": "gold top-k (ceiling)",
    "random": "random, same size", "sft": "SFT demonstrations (positive control)",
}  # fmt: skip


def fmt(cell: dict, digits: int = 2) -> str:
    """``mean [low, high]`` (the t-interval across seeds) or just the mean with one seed."""
    if cell["ci_low"] is None:
        return f"{cell['mean']:.{digits}f}"
    return f"{cell['mean']:.{digits}f} [{cell['ci_low']:.{digits}f}, {cell['ci_high']:.{digits}f}]"


def _signed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}" if value >= 0.001 else "<0.001"


def claims_md(rows: list[dict], family: str) -> list[str]:
    lines = ["| claim (paper's direction) | verdict | difference [95 % CI] | p | p (Holm) | "
             "Holm level | seeds needed |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        if row["family"] != family:
            continue
        digits = row["digits"]
        interval = _signed(row["estimate"], digits)
        if row["ci_low"] is not None:
            interval += f" [{row['ci_low']:+.{digits}f}, {row['ci_high']:+.{digits}f}]"
        if row["units"]:
            interval += f" {row['units']}"
        needed = row["seeds_needed"]
        needed = "-" if row["holm_level"] is None else "> 100000" if needed is None else needed
        level = "-" if row["holm_level"] is None else f"{row['holm_level']:.4f}"
        lines.append(f"| {row['text']} | {row['verdict']} | {interval} | {_p(row['p'])} | "
                     f"{_p(row['p_holm'])} | {level} | {needed} |")  # fmt: skip
    return lines


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


def calibration_md(results: dict) -> list[str]:
    """The AM's confidence cap per margin and the ECE noise floor of the test set."""
    floor, caps = results["ece_noise_floor"], results["am_confidence_cap"]
    lines = [
        f"ECE noise floor: a perfectly calibrated scorer on these held-out pairs (its score gap "
        f"logit(p_true), labels redrawn from p_true) gets ECE {floor['mean']:.2f} on average "
        f"(95 % of draws in [{floor['low']:.2f}, {floor['high']:.2f}]); an ECE in that range "
        "cannot be told from perfect calibration here.",
        "",
        "The AM's confidence cap: Eq. 6 per pair, even for a label that never varies, is "
        "minimised at a_c = -a_r = m/3, so the AM's score gap is at most 2m/3 and its "
        "confidence at most σ(2m/3) (`stats.confidence_cap`). Pairs whose true confidence "
        "max(p, 1 - p) exceeds the cap can only be under-called by the AM:",
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
    lines = ["| scorer | accuracy % ↑ | ECE ↓ | over-confidence (signed) | Brier vs p_true ↓ | "
             "paper accuracy (HH; prop.) | paper ECE (HH; prop.) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for model, row in results["reward_models"].items():
        paper = PAPER_TABLE1.get(model)
        cells = [f"{model}", fmt(row["accuracy"]), fmt(row["ece"]), fmt(row["overconfidence"]),
                 fmt(row["brier"], 4)]  # fmt: skip
        cells += [", ".join(f"{v:.2f}" for v in paper[k]) if paper else "-"
                  for k in ("accuracy", "ece")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    oracle = results["oracle_accuracy"]
    lines += ["", "Oracle accuracy (ranking by the gold reward, in expectation over the labels' "
              f"noise; the held-out pairs are the same for every seed): {oracle['mean']:.2f} %."]  # fmt: skip
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


def table2_md(results: dict, arms: list[str]) -> list[str]:
    lines = ["| arm | seeds | main win / tie / lose % | main net win % [95 % CI] | forget win / "
             "tie / lose % | forget net win % [95 % CI] | minor skill (forget stories) net "
             "win % | hacking index (main) | cut by the budget % (policy main / forget; SFT "
             "main / forget) | paper main W/L/T; forget W/L/T |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        row, extras = results["table2"][arm], results["arms"][arm]
        cells = [ARM_LABELS.get(arm, arm), str(len(row["main"]["per_seed"]))]
        for set_name in ("main", "forget"):
            cell = row[set_name]
            cells.append(f"{cell['win']:.1f} / {cell['tie']:.1f} / {cell['lose']:.1f}")
            cells.append(_net_cell(results, arm, set_name))
        cells.append(_net_cell(results, arm, "minor"))
        cells.append(fmt(extras["main"]["hacking_index"]))
        cells.append(truncation_cell(extras))
        paper = PAPER_TABLE2.get(arm)
        cells.append("; ".join(" / ".join(f"{v:.1f}" for v in paper[i:i + 3]) for i in (0, 3))
                     if paper else "-")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
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
        lines.append(f"| {ARM_LABELS.get(arm, arm)} | " + " | ".join(cells) + " |")
    return lines


def composition_md(results: dict, arms: list[str]) -> list[str]:
    """Per arm and set: the gold gain over SFT in task-scale units split into its terms, and
    the net win split by which term changed (``stats.gold_composition``)."""
    first = results["arms"][arms[0]]["main"]
    if "utility_gain" not in first:
        return ["(These records carry no planted-feature flag: no composition.)"]
    split = "utility_form" in first
    parts = ["form", "topic"] if split else ["form_topic"]
    names = {"form": "form", "topic": "topic", "form_topic": "form + topic"}
    lines = [
        "| arm | set | gold gain (scale units) [95 % CI] | "
        + " | ".join(names[p] for p in parts)
        + " | band | 'because' | net win % | because only | band only | form/topic only | "
        "several |",
        "|---|---|---|" + "---|" * (len(parts) + 7),
    ]
    for arm in arms:
        for set_name in [s for s in ("main", "forget", "minor") if s in results["arms"][arm]]:
            cell = results["arms"][arm][set_name]
            terms = [f"{cell[f'utility_{p}']['mean']:+.3f}" for p in (*parts, "band", "because")]
            flips = [f"{cell[f'net_win_{k}']['mean']:+.1f}"
                     for k in ("because", "band", "form_topic", "mixed")]  # fmt: skip
            net = results["table2"][arm][set_name]["net_win"]
            lines.append(f"| {ARM_LABELS.get(arm, arm)} | {set_name} | "
                         f"{fmt(cell['utility_gain'], 3)} | " + " | ".join(terms)
                         + f" | {net:+.1f} | " + " | ".join(flips) + " |")  # fmt: skip
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


def _net_cell(results: dict, arm: str, set_name: str) -> str:
    cell = results["table2"][arm].get(set_name)
    return "-" if cell is None else fmt({"mean": cell["net_win"], **cell}, 1)


def rehearsal_md(results: dict) -> list[str]:
    """What each D_R is made of (``stats.rehearsal_table``), seed means."""
    table = results.get("rehearsal") or {}
    if not table:
        return ["(These records carry no D_R records.)"]
    from megatron_rlhf.study.world import TASK_SPECS

    names = [n for n in REHEARSAL_LABELS if n in table] + sorted(
        n for n in table if n not in REHEARSAL_LABELS)  # fmt: skip
    lines = ["| D_R | seeds | size | gold utility | well formed % | on topic % | 'because' % | "
             "in band % | " + " | ".join(f"{t} %" for t in TASK_SPECS) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(TASK_SPECS)]  # fmt: skip
    for name in names:
        row = table[name]
        cells = [
            REHEARSAL_LABELS.get(name, name),
            str(len(row["size"]["per_seed"])),
            f"{row['size']['mean']:.0f}",
            fmt(row["utility"], 2),
        ]
        cells += [f"{row[key]['mean']:.1f}" for key in ("form", "topic", "because", "in_band")]
        cells += [f"{row[f'share_{t}']['mean']:.1f}" for t in TASK_SPECS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def arms_net_md(results: dict, arms: list[str]) -> list[str]:
    """Net win over SFT on the three sets, and the gold gain's parts on the forget set."""
    lines = ["| arm | seeds | main net win % | forget net win % | minor skill net win % | "
             "forget: form / topic / band / 'because' (scale units) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        if arm not in results["table2"]:
            continue
        forget = results["arms"][arm]["forget"]
        parts = " / ".join(f"{forget[f'utility_{p}']['mean']:+.3f}" if f"utility_{p}" in forget
                           else "-" for p in ("form", "topic", "band", "because"))  # fmt: skip
        lines.append(f"| {ARM_LABELS.get(arm, arm)} | "
                     f"{len(results['table2'][arm]['main']['per_seed'])} | "
                     + " | ".join(_net_cell(results, arm, s) for s in ("main", "forget", "minor"))
                     + f" | {parts} |")  # fmt: skip
    return lines


def grid_md(results: dict, settings: dict) -> list[str]:
    """RM-PPO and AM-PPO at every PPO setting the run has, the frozen one first."""
    ppo = settings["ppo"]
    rows = [(f"lr {ppo['actor_lr']:g}, {ppo['steps']} steps (frozen)", "rm_ppo", "am_ppo")]
    for arm in sorted(a for a in results["table2"] if a.startswith("am_ppo_lr")):
        setting = arm.removeprefix("am_ppo_")
        rows.append((setting, "rm" + arm.removeprefix("am"), arm))
    lines = ["| PPO setting | seeds | RM-PPO main | AM-PPO main | RM-PPO forget | AM-PPO forget |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for label, rm, am in rows:
        if rm not in results["table2"]:
            continue
        seeds = len(results["table2"][am]["main"]["per_seed"])
        lines.append(f"| {label} | {seeds} | " + " | ".join(
            _net_cell(results, arm, s) for s in ("main", "forget") for arm in (rm, am)) + " |")  # fmt: skip
    return lines


def sweep_rows(results: dict) -> list[tuple[int, int, str]]:
    rows = []
    for arm in results["table2"]:
        if arm.startswith("am_ppo_sr_c"):
            c, k = arm.removeprefix("am_ppo_sr_c").split("_k")
            rows.append((int(c), int(k), arm))
    return sorted(rows)


def sweep_md(results: dict, settings: dict) -> list[str]:
    c0, k0 = settings["clusters"], settings["top_k"]
    rows = sorted(sweep_rows(results) + [(c0, k0, "am_ppo_sr")])
    lines = [
        "| c | k | c·k | main net win % | main gold gain | forget net win % |",
        "|---:|---:|---:|---|---|---|",
    ]
    for c, k, arm in rows:
        gold = results["arms"][arm]["main"]["gold_gain"]
        lines.append(f"| {c} | {k} | {c * k} | {_net_cell(results, arm, 'main')} | "
                     f"{fmt(gold, 3)} | {_net_cell(results, arm, 'forget')} |")  # fmt: skip
    spread = results["table2"]["am_ppo_sr"]["main"]["per_seed"]
    gold_spread = results["arms"]["am_ppo_sr"]["main"]["gold_gain"]["per_seed"]
    counts = sorted({len(results["table2"][arm]["main"]["per_seed"]) for _, _, arm in rows})
    if len(counts) > 1:
        lines += ["", f"Seeds per row: {', '.join(map(str, counts))} (the sweep runs on the "
                  "first seeds only). Intervals of rows over different seeds overlapping is "
                  "not a test that the counts are equivalent; no claim about c is made here."]  # fmt: skip
    if len(spread) > 1:
        lines += ["", f"Seed-to-seed spread of AM-PPO-SR (c={c0}, k={k0}): main net win std "
                  f"{np.std(spread, ddof=1):.1f} points, gold gain std "
                  f"{np.std(gold_spread, ddof=1):.3f} over {len(spread)} seeds."]  # fmt: skip
    return lines


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
    if any(cell["ci_low"] is None for cell in cells.values()):
        return []
    above = [ARM_LABELS.get(arm, arm) for arm, cell in cells.items() if cell["ci_low"] > 0]
    return ["", f"Main-set net win over SFT with its 95 % interval above 0 (unadjusted): "
            f"{len(above)} of {len(cells)} trained arms ({', '.join(above) or 'none'}). "
            "Beating SFT is evidence for rehearsal only where the arms without it do not."]  # fmt: skip


def run_time(settings: dict) -> list[str]:
    if "cpu_seconds" not in settings:
        return []
    jobs = settings.get("jobs", 1)
    processes = "one process" if jobs == 1 else f"{jobs} worker processes for the per-seed stages"
    return [f"Run: {settings['seconds'] / 60:.1f} min wall, {settings['cpu_seconds'] / 60:.1f} "
            f"min CPU ({processes}, one torch thread each: the CPU time is about what an idle "
            "machine takes)." + _parts(settings) + _started(settings), ""]  # fmt: skip


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


def _parts(settings: dict) -> str:
    """The run's task time by part (``run.part_seconds``), where the run recorded it."""
    parts = settings.get("part_seconds")
    if not parts:
        return ""
    names = {"core": "core (every seed)", "extra_rewards": "over-trained and margin reward "
             "models", "exploratory": "exploratory arms", "sweep": "Fig. 6 sweep"}  # fmt: skip
    cells = [f"{names.get(k, k)} {v / 60:.1f}" for k, v in parts.items()]
    return (
        " Task minutes by part (summed over the worker processes, which run "
        f"{settings.get('jobs', 1)} at a time): " + ", ".join(cells) + "."
    )


def write_report(out: Path, results: dict, pairs: dict) -> None:
    """report.md and the PNGs in ``out`` from ``results`` and the held-out ``pairs``
    (``pairs[model][seed]``, the reliability and per-task figures' records)."""
    settings = results["settings"]
    write_plots(out, results, pairs)
    main_arms = [a for a in ("rm_ppo", "rm_ppo_ma", "am_ppo", "am_ppo_sr", "am_ppo_rr",
                             "am_ppo_sr_gold", "am_ppo_sft", "rm_ppo_sr", "rejection_sampling",
                             "null")
                 if a in results["table2"]]  # fmt: skip
    rehearsal_arms = ["am_ppo", "am_ppo_sr", "am_ppo_rr", "am_ppo_sr_gold", "am_ppo_sft"]
    rehearsal_arms += sorted(a for a in results["table2"]
                             if a.startswith("am_ppo_sr_g") and a != "am_ppo_sr_gold")  # fmt: skip
    data = settings["data"]
    checked = results["claims"]
    budget = data.get("generation_budget")
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
        (
            f"Every seed runs the core (Table 1's RM and AM, the arms on every seed below); the "
            f"first {settings['exploratory_seeds']} also run the exploratory part (over-trained "
            "and margin-sweep reward models, the positive control, the γ dose, the PPO-settings "
            "grid, RM-PPO-SR, rejection sampling); each table gives its seeds."
            if "exploratory_seeds" in settings
            else ""
        ),
        "",
        "A text world with a known gold reward (`megatron_rlhf/study/world.py`): five task "
        "families (qa, code, chat, advice, story). The SFT data holds all five alike; the "
        "preference data only qa, code, chat and advice, a quarter of its responses ill formed "
        "(shuffled words or another family's template) and two in five off topic, so the "
        "reward models learn form and topic; the PPO prompt pool is skewed (qa 35 %, code "
        "30 %, chat 15 %, advice 15 %) and holds the *minor skill*, story, at 5 %: PPO "
        "optimises stories against reward models that never saw one. The main set is held-out "
        "prompts of the four preference families; the forget set is the paper's 'SFT test "
        "data' (§4.1): held-out prompts of all five families alike, so it shares every skill "
        "with the PPO prompt pool D_R is drawn from (§3.2), weighted unlike it; its stories "
        "are reported apart as the minor skill. Preferences are Bradley-Terry draws on the "
        "gold reward with task-dependent noise; PPO arms are judged by the gold reward, not by "
        "a learned model. Tiny BLOOMs "
        f"(hidden {settings['hidden']}, {settings['layers']} layers) trained on CPU: the point "
        "is the *direction and size of the differences* with their intervals, not the levels.",
        "",
        *run_time(settings),
        "Intervals: `mean [low, high]` is a 95 % Student-t interval across seeds; within-seed "
        "bootstrap intervals (over pairs / prompts) are in results.json (`reward_bootstrap`, "
        "`arms.*.net_win_bootstrap`).",
        "",
        "## Data",
        "",
        f"Records: {', '.join(f'{k} {v}' for k, v in data.items() if isinstance(v, int))}. "
        f"Held-out prompts found in any training set (SFT, preference train/test, PPO): "
        f"main {data['held_out_overlap']['main_test']}, forget "
        f"{data['held_out_overlap']['forget_test']} (checked by the study before any training).",
        "",
        "## Claims",
        "",
        claims_provenance(settings),
        "",
        "Paired per-seed differences in the paper's direction with their 95 % t-interval "
        "(a one-sample claim such as 'beats SFT' compares with 0); p: two-sided paired "
        "t-test against 0 (non-inferiority: against -margin, here the AM may lose "
        f"{ACCURACY_NI_MARGIN:g} accuracy point); p (Holm): Holm-corrected within the family. "
        f"Reproduced / contradicted: Holm p < {ALPHA:g} on the paper's / the other side; "
        f"inconclusive otherwise. Holm level: the level the claim is held to at its rank in "
        f"its family, {ALPHA:g} / (family size - rank + 1), rank 1 the smallest p. Seeds "
        f"needed: the fewest seeds at which a paired t-test at the Holm level has "
        f"{POWER:.0%} power (noncentral t) if the observed mean difference and its "
        "across-seed std were the truth; a planning figure, optimistic for an effect read "
        "off the same records. Every row is in results.json (`claims`). The intervals are "
        "over seeds with one world, one SFT policy and one held-out draw: they do not "
        "cover a different draw of those.",
        "",
        *claims_md(checked, "paper"),
        "",
        *verdict_summary(checked),
        *beats_sft_md(results, main_arms),
        "",
        "Exploratory (not the paper's claims, which are about 1-epoch reward models and PPO "
        "arms; the over-training claims are here; Holm within this family):",
        "",
        *claims_md(checked, "exploratory"),
        "",
        "## Selective Rehearsal: what D_R holds, the ceiling, the control and the dose",
        "",
        f"D_R of the main arm: c = {settings['clusters']} k-means clusters of the PPO prompts' "
        f"embeddings, the top k = {settings['top_k']} SFT responses of each by the AM. The "
        "gold top-k takes the same clusters' top k by the gold utility (the best any "
        "selection can do); the random D_R draws as many of the same responses uniformly; "
        "the positive control rehearses as many SFT demonstrations drawn uniformly from all "
        "five families (the paper's 'other important data sources'). What each holds, read "
        "off its records by the world's rules (seed means; in the records archive per seed):",
        "",
        *rehearsal_md(results),
        "",
        f"The arms (γ = {settings['ppo']['rehearsal_gamma']:g} unless the name gives "
        "another; the gold gain's parts on the forget set in units of each task's scale):",
        "",
        *arms_net_md(results, rehearsal_arms),
        "",
        "Claims of this family (Holm within it; AM-PPO-SR vs random and the gold top-k run "
        "on every seed, the control and the dose on the exploratory seeds):",
        "",
        *claims_md(checked, "rehearsal"),
        "",
        "## AM-PPO vs RM-PPO across PPO settings",
        "",
        "The frozen setting runs on every seed; the others (lr and steps crossed) on the "
        "exploratory seeds. Net win % over SFT:",
        "",
        *grid_md(results, settings),
        "",
        *claims_md(checked, "settings"),
        "",
        "## Table 1 / Fig. 2: reward vs advantage model on held-out pairs",
        "",
        *table1_md(results),
        "",
        "`rm_long`/`am_long`: the same models trained for "
        f"{settings['long_epochs']:g} epochs instead of {settings['reward_epochs']:g}; "
        "`am_m<m>`: the AM with margin m (Table 1's AM uses m = 2.5). Over-confidence: "
        "mean(confidence − correct) ×100, the ECE's terms with their sign (> 0: "
        "over-confident).",
        "",
        *calibration_md(results),
        "",
        "Table 1 per margin m other than 2.5 (m = 2.5 is the paper family's; Holm within this "
        "family):",
        "",
        *claims_md(checked, "margin"),
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
        f"Tie: |g(policy) − g(SFT)| ≤ {settings['tie_margin']} × the task's gold scale. Hacking "
        "index: per task, the arm's training-reward gain minus its gold gain over SFT, each "
        "in units of the task's SFT responses' std (positive: the training reward rose more "
        "than the truth), averaged over tasks. Every arm's critic starts from the SFT trunk "
        "with a fresh value head. The null arm (0 PPO steps) must tie everywhere. "
        f"Same β = {settings['ppo']['kl_coef']}, actor lr {settings['ppo']['actor_lr']}, "
        f"{settings['ppo']['steps']} steps × {settings['ppo']['prompts_per_step']} prompts for "
        "every arm but the PPO-grid arms, whose names give their lr and steps (the full "
        "preset's lr and steps were chosen on development seeds 100-101 in the previous world "
        "and frozen: `Preset.ppo` in `megatron_rlhf/study/presets.py`; its seed count was fixed "
        "before this run from a development run, seeds 100-105, by the power rule beside the "
        "full preset there). "
        "The paper's judge is GPT-4 and its ties are ~75 %: its numbers are beside "
        "ours for direction only.",
        "",
        *table2_md(results, main_arms),
        "",
        (
            f"Generation budget: {budget['budget']} new tokens for PPO, D_R's SFT responses and "
            "evaluation, above the longest SFT demonstration of every family (tokens, EOS "
            "included: " + ", ".join(f"{k} {v}" for k, v in budget["longest"].items()) + ")."
            if budget
            else ""
        ),
        "",
        "Reward hacking per task (main set): hacking index (training-reward gain minus gold "
        "gain, in SFT-std units of the task) and the change in the share of responses with the "
        "planted feature 'because' (policy − SFT, points; the gold reward rewards it in qa and "
        "penalises it in code, so a rise in code is hacking the learned reward):",
        "",
        *hacking_md(results, main_arms),
        "",
        "What the gold gain is made of: the policy's mean gold reward minus SFT's in units "
        "of each task's scale, split exactly into the gold reward's terms (form, topic, "
        "0.5 × in band, w_t × 'because'), seed means; and the net win split by which term "
        "changed between the policy's and SFT's response to a prompt (one term only, or "
        "several; the columns sum to the net win). " + composition_note(results, main_arms),
        "",
        *composition_md(results, main_arms),
        "",
        "![net win](net_win.png)",
        "",
        "## Fig. 6: cluster count of Selective Rehearsal",
        "",
        *sweep_md(results, settings),
        "",
        "![cluster sweep](cluster_sweep.png)",
        "",
        "## Notes",
        "",
        "- D_R is curated by the seed's AM from one set of SFT responses to the PPO prompts; "
        "RM-PPO-SR rehearses the same D_R, so it differs from AM-PPO-SR only in the reward.",
        "- The random-rehearsal control draws a D_R of the same size uniformly from the same "
        "responses (one cluster, random scores).",
        "- The positive control's D_R is SFT demonstrations (the training data of the SFT "
        "policy), drawn uniformly from all five families, as many as the main D_R.",
        "- Rejection sampling: best of "
        f"{settings['ppo']['rejection_samples']} samples per prompt by the AM, kept if its "
        "advantage ≥ 0 (τ = 0), then one NLL step per batch.",
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
    plot_sweep(out / "cluster_sweep.png", results)


def _figure(cols: int, size):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="tight")
    return fig, fig.subplots(1, cols)


def _save(fig, path: Path) -> None:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def _error(cell: dict, key: str = "net_win") -> list[float]:
    if cell["ci_low"] is None:
        return [0.0, 0.0]
    return [cell[key] - cell["ci_low"], cell["ci_high"] - cell[key]]


def plot_net_win(path: Path, results: dict) -> None:
    """Net win vs SFT per arm with the 95 % t-interval across seeds, one panel per judged set
    (main, forget, and the forget set's minor skill where the records have it)."""
    arms = [a for a in results["table2"] if not a.startswith("am_ppo_sr_c")]
    sets = [s for s in ("main", "forget", "minor") if s in results["table2"][arms[0]]]
    fig, axes = _figure(len(sets), (max(11.0, 0.45 * len(arms) * len(sets)), 4.5))
    for ax, set_name in zip(axes, sets):
        cells = [results["table2"][a][set_name] for a in arms]
        errors = np.array([_error(c) for c in cells]).T
        ax.bar(range(len(arms)), [c["net_win"] for c in cells], yerr=errors, capsize=4)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        ax.axhline(0.0, color="black", linewidth=0.8)
        title = "minor skill (forget-set stories)" if set_name == "minor" else f"{set_name} set"
        ax.set_title(f"{title}: net win over SFT (gold judge), %")
        ax.grid(axis="y", alpha=0.3)
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
