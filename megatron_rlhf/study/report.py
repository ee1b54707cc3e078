"""``DIR/report.md`` and the PNGs of a study, from results.json and the raw records.

Each of the paper's claims is checked on paired per-seed differences (same seed, two settings):
the 95 % t-interval of the difference decides "reproduced" (it excludes 0 in the paper's
direction), "contradicted" (it excludes 0 the other way) or "inconclusive" (it holds 0).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from megatron_rlhf.study.stages import load_records
from megatron_rlhf.study.stats import t_interval
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
}  # fmt: skip


def fmt(cell: dict, digits: int = 2) -> str:
    """``mean [low, high]`` (the t-interval across seeds) or just the mean with one seed."""
    if cell["ci_low"] is None:
        return f"{cell['mean']:.{digits}f}"
    return f"{cell['mean']:.{digits}f} [{cell['ci_low']:.{digits}f}, {cell['ci_high']:.{digits}f}]"


def paired_claim(better: list[float], worse: list[float], digits: int = 2) -> tuple[str, str]:
    """(verdict, "mean diff [ci]") for the claim ``better > worse`` on paired seeds."""
    diffs = [b - w for b, w in zip(better, worse)]
    mean, low, high = t_interval(diffs)
    if low is None:
        verdict = "direction only (1 seed)" + (" ✓" if mean > 0 else " ✗")
        return verdict, f"{mean:+.{digits}f}"
    verdict = "reproduced" if low > 0 else "contradicted" if high < 0 else "inconclusive"
    return verdict, f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def claims(results: dict) -> list[tuple[str, str, str]]:
    t1, t2, arms = results["table1"], results["table2"], results["arms"]
    rows = []

    def add(text, better, worse, digits=2):
        rows.append((text, *paired_claim(better, worse, digits)))

    neg = lambda values: [-v for v in values]  # noqa: E731  (lower is better)
    add("AM is better calibrated than RM (ECE lower)", neg(t1["am"]["ece"]["per_seed"]),
        neg(t1["rm"]["ece"]["per_seed"]))  # fmt: skip
    add("AM is closer to the true preference probability (Brier lower)",
        neg(t1["am"]["brier"]["per_seed"]), neg(t1["rm"]["brier"]["per_seed"]), 4)  # fmt: skip
    add("AM keeps RM's ranking accuracy (AM - RM accuracy > 0)",
        t1["am"]["accuracy"]["per_seed"], t1["rm"]["accuracy"]["per_seed"])  # fmt: skip
    models = results["reward_models"]
    if "rm_long" in models:
        add("Over-training makes the RM over-confident (ECE rises)",
            models["rm_long"]["ece"]["per_seed"], models["rm"]["ece"]["per_seed"])  # fmt: skip
        if "am_long" in models:
            add("Over-trained, the AM stays better calibrated than the RM",
                neg(models["am_long"]["ece"]["per_seed"]),
                neg(models["rm_long"]["ece"]["per_seed"]))  # fmt: skip
    nets = {arm: {s: t2[arm][s]["per_seed"] for s in ("main", "forget")} for arm in t2}
    add("AM-PPO beats RM-PPO on the main set (net win vs SFT)", nets["am_ppo"]["main"],
        nets["rm_ppo"]["main"])  # fmt: skip
    add("AM-PPO forgets less than RM-PPO (forget-set net win)", nets["am_ppo"]["forget"],
        nets["rm_ppo"]["forget"])  # fmt: skip
    add("Selective Rehearsal helps AM-PPO on the forget set", nets["am_ppo_sr"]["forget"],
        nets["am_ppo"]["forget"])  # fmt: skip
    add("Selective Rehearsal helps AM-PPO on the main set", nets["am_ppo_sr"]["main"],
        nets["am_ppo"]["main"])  # fmt: skip
    add("Selection beats random rehearsal (forget-set net win)", nets["am_ppo_sr"]["forget"],
        nets["am_ppo_rr"]["forget"])  # fmt: skip
    add("RM-PPO hacks its reward more than AM-PPO (hacking index)",
        arms["rm_ppo"]["main"]["hacking_index"]["per_seed"],
        arms["am_ppo"]["main"]["hacking_index"]["per_seed"])  # fmt: skip
    add("Moving-average normalisation helps RM-PPO (main net win)", nets["rm_ppo_ma"]["main"],
        nets["rm_ppo"]["main"])  # fmt: skip
    add("Rehearsal helps RM-PPO too (forget-set net win, the missing ablation)",
        nets["rm_ppo_sr"]["forget"], nets["rm_ppo"]["forget"])  # fmt: skip
    return rows


def table1_md(results: dict) -> list[str]:
    lines = ["| scorer | accuracy % ↑ | ECE ↓ | Brier vs p_true ↓ | paper accuracy (HH; prop.) "
             "| paper ECE (HH; prop.) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for model, row in results["reward_models"].items():
        paper = PAPER_TABLE1.get(model)
        cells = [f"{model}", fmt(row["accuracy"]), fmt(row["ece"]), fmt(row["brier"], 4)]
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
    lines = ["| task | " + " | ".join(f"{m} mean | {m} std" for m in models) + " |",
             "|---|" + "---|---|" * len(models)]  # fmt: skip
    for task in tasks:
        cells = []
        for model in models:
            stats = results["per_task"][model][task]
            cells += [fmt(stats["mean"]), fmt(stats["std"])]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return lines


def table2_md(results: dict, arms: list[str]) -> list[str]:
    lines = ["| arm | main win / tie / lose % | main net win % [95 % CI] | forget win / tie / "
             "lose % | forget net win % [95 % CI] | hacking index (main) | paper main W/L/T; "
             "forget W/L/T |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in arms:
        row, extras = results["table2"][arm], results["arms"][arm]
        cells = [ARM_LABELS.get(arm, arm)]
        for set_name in ("main", "forget"):
            cell = row[set_name]
            cells.append(f"{cell['win']:.1f} / {cell['tie']:.1f} / {cell['lose']:.1f}")
            cells.append(fmt({"mean": cell["net_win"], **cell}, 1))
        cells.append(fmt(extras["main"]["hacking_index"]))
        paper = PAPER_TABLE2.get(arm)
        cells.append("; ".join(" / ".join(f"{v:.1f}" for v in paper[i:i + 3]) for i in (0, 3))
                     if paper else "-")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
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
        row, gold = results["table2"][arm], results["arms"][arm]["main"]["gold_gain"]
        lines.append(f"| {c} | {k} | {c * k} | {fmt({'mean': row['main']['net_win'], **row['main']}, 1)} | "
                     f"{fmt(gold, 3)} | {fmt({'mean': row['forget']['net_win'], **row['forget']}, 1)} |")  # fmt: skip
    spread = results["table2"]["am_ppo_sr"]["main"]["per_seed"]
    gold_spread = results["arms"]["am_ppo_sr"]["main"]["gold_gain"]["per_seed"]
    if len(spread) > 1:
        lines += ["", f"Seed-to-seed spread of AM-PPO-SR (c={c0}, k={k0}): main net win std "
                  f"{np.std(spread, ddof=1):.1f} points, gold gain std "
                  f"{np.std(gold_spread, ddof=1):.3f} over {len(spread)} seeds."]  # fmt: skip
    return lines


def verdict_summary(checked: list[tuple[str, str, str]]) -> list[str]:
    """One line per verdict: which claims reproduced, which the study contradicts."""
    lines = []
    for verdict in ("reproduced", "contradicted", "inconclusive"):
        texts = [text for text, v, _ in checked if v == verdict]
        if texts:
            lines.append(f"- **{verdict.capitalize()}** ({len(texts)}): " + "; ".join(texts) + ".")
    return lines


def run_time(settings: dict) -> list[str]:
    if "cpu_seconds" not in settings:
        return []
    jobs = settings.get("jobs", 1)
    processes = "one process" if jobs == 1 else f"{jobs} worker processes for the per-seed stages"
    return [f"Run: {settings['seconds'] / 60:.1f} min wall, {settings['cpu_seconds'] / 60:.1f} "
            f"min CPU ({processes}, one torch thread each: the CPU time is about what an idle "
            "machine takes).", ""]  # fmt: skip


def write_report(out: Path, results: dict) -> None:
    settings = results["settings"]
    write_plots(out, results)
    main_arms = [a for a in ("rm_ppo", "rm_ppo_ma", "am_ppo", "am_ppo_sr", "rm_ppo_sr",
                             "rejection_sampling", "am_ppo_rr") if a in results["table2"]]  # fmt: skip
    data = settings["data"]
    checked = claims(results)
    lines = [
        f"# Study: the paper's claims measured (preset `{settings['preset']}`, "
        f"{settings['seeds']} seeds)",
        "",
        "A text world with a known gold reward (`megatron_rlhf/study/world.py`): four PPO task "
        "families (qa, code, chat, advice) and a forget family (story: in the SFT data, never a "
        "PPO prompt). Preferences are Bradley-Terry draws on the gold reward with task-dependent "
        "noise; PPO arms are judged by the gold reward, not by a learned model. Tiny BLOOMs "
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
        "Paired per-seed differences, 95 % t-interval (units: accuracy/net win in points, ECE "
        "×100, Brier, hacking index in SFT-std units).",
        "",
        "| claim (paper's direction) | verdict | difference [95 % CI] |",
        "|---|---|---|",
        *[f"| {text} | {verdict} | {diff} |" for text, verdict, diff in checked],
        "",
        *verdict_summary(checked),
        "",
        "## Table 1 / Fig. 2: reward vs advantage model on held-out pairs",
        "",
        *table1_md(results),
        "",
        "`rm_long`/`am_long`: the same models trained for "
        f"{settings['long_epochs']:g} epochs instead of {settings['reward_epochs']:g}; "
        "`am_m<m>`: the AM with margin m (Table 1's AM uses m = 2.5).",
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
        "index: the arm's training-reward gain minus its gold gain over SFT, each in units of "
        "the SFT responses' std (positive: the training reward rose more than the truth). "
        f"Same β = {settings['ppo']['kl_coef']}, actor lr {settings['ppo']['actor_lr']}, "
        f"{settings['ppo']['steps']} steps × {settings['ppo']['prompts_per_step']} prompts for "
        "every arm. The paper's judge is GPT-4 and its ties are ~75 %: its numbers are beside "
        "ours for direction only.",
        "",
        *table2_md(results, main_arms),
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
        "- Rejection sampling: best of "
        f"{settings['ppo']['rejection_samples']} samples per prompt by the AM, kept if its "
        "advantage ≥ 0 (τ = 0), then one NLL step per batch.",
        "- The PPO checkpoints are deleted after judging (only the records are kept).",
        "",
    ]
    with atomic_output(out / "report.md") as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")


# ---------------------------------------------------------------- plots


def write_plots(out: Path, results: dict) -> None:
    from megatron_rlhf.reward.calibration import per_task_stats, reliability_curve
    from megatron_rlhf.reward.plots import plot_calibration, plot_task_stats

    pairs, _ = load_records(out)
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
    """Net win vs SFT per arm with the 95 % t-interval across seeds, main and forget."""
    arms = [a for a in results["table2"] if not a.startswith("am_ppo_sr_c")]
    fig, axes = _figure(2, (11.0, 4.0))
    for ax, set_name in zip(axes, ("main", "forget")):
        cells = [results["table2"][a][set_name] for a in arms]
        errors = np.array([_error(c) for c in cells]).T
        ax.bar(range(len(arms)), [c["net_win"] for c in cells], yerr=errors, capsize=4)
        ax.set_xticks(range(len(arms)), arms, rotation=30, ha="right")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(f"{set_name} set: net win over SFT (gold judge), %")
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
