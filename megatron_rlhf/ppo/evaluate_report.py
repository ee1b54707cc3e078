"""eval-policy's verdicts and report: win/tie/lose per prompt, the per-set summary, the
Markdown table in the paper's Table 2 layout and the output files (no model, no torch.distributed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rlhf.utils import InputError, atomic_output, write_json

if TYPE_CHECKING:
    import torch

SET_NAMES = ("main", "forget")
VERDICT_NAMES = {1: "win", 0: "tie", -1: "lose"}


def verdicts(
    policy_scores: torch.Tensor,  # (B,)
    sft_scores: torch.Tensor,  # (B,)
    identical: torch.Tensor,  # (B,) bool: the two responses are the same tokens
    tie_margin: float,
) -> torch.Tensor:
    """+1 win, 0 tie, -1 lose per prompt from ``d = s_policy - s_sft`` (in float64): win if
    ``d > tie_margin``, lose if ``d < -tie_margin``, and a tie for identical responses. (B,)"""
    import torch

    diff = policy_scores.double() - sft_scores.double()
    verdict = (diff > tie_margin).long() - (diff < -tie_margin).long()
    return torch.where(identical, 0, verdict)


def summarize(
    verdict: torch.Tensor,  # (B,) +1 / 0 / -1
    policy_scores: torch.Tensor,  # (B,)
    sft_scores: torch.Tensor,  # (B,)
) -> dict:
    """Counts and rates of one prompt set (Table 2 reports the rates in percent)."""
    count = verdict.numel()
    wins, ties, loses = (int((verdict == v).sum()) for v in (1, 0, -1))
    return {
        "num_prompts": count,
        "win": wins,
        "tie": ties,
        "lose": loses,
        "win_rate": wins / count,
        "tie_rate": ties / count,
        "lose_rate": loses / count,
        "net_win_rate": (wins - loses) / count,
        "mean_score_policy": float(policy_scores.double().mean()),
        "mean_score_sft": float(sft_scores.double().mean()),
    }


def sample_records(prompt_sets: dict, policy_out: dict, sft_out: dict, tokenizer, margin) -> list:
    """One JSON-ready record per prompt of this rank: both responses, scores and the verdict."""
    import torch

    records = []
    for name, policy_batches in policy_out.items():
        for policy_exp, sft_exp in zip(policy_batches, sft_out[name]):
            policy_ids, sft_ids = _responses(policy_exp), _responses(sft_exp)
            identical = torch.tensor([a == b for a, b in zip(policy_ids, sft_ids)])
            verdict = verdicts(policy_exp.scores, sft_exp.scores, identical, margin)
            for row, index in enumerate(policy_exp.prompt_index.tolist()):
                record = {"set": name, "index": index, **prompt_sets[name][index][0]}
                for who, ids, exp in (
                    ("policy", policy_ids, policy_exp),
                    ("sft", sft_ids, sft_exp),
                ):
                    if tokenizer is not None:
                        record[f"{who}_response"] = tokenizer.decode(
                            ids[row], skip_special_tokens=True
                        )
                    record[f"{who}_response_token_ids"] = ids[row]
                    record[f"{who}_score"] = float(exp.scores[row])
                record["score_diff"] = record["policy_score"] - record["sft_score"]
                record["verdict"] = VERDICT_NAMES[int(verdict[row])]
                records.append(record)
    return records


def _responses(experience) -> list[list[int]]:
    mask = experience.response_mask.bool()  # (B, N)
    return [experience.responses[row][mask[row]].tolist() for row in range(mask.shape[0])]


def check_finite(samples: list[dict]) -> None:
    """Raise on every rank alike (all hold the gathered samples)."""
    for sample in samples:
        if not all(math.isfinite(sample[f"{who}_score"]) for who in ("policy", "sft")):
            raise InputError(
                f"--{sample['set']} prompt {sample['index']}: the judge gave a non-finite score "
                f"(policy {sample['policy_score']}, SFT {sample['sft_score']}); check the judge "
                "or the score function"
            )


def summarize_samples(samples: list[dict]) -> dict:
    import torch

    verdict = torch.tensor(
        [{v: k for k, v in VERDICT_NAMES.items()}[s["verdict"]] for s in samples]
    )
    policy = torch.tensor([s["policy_score"] for s in samples], dtype=torch.float64)
    sft = torch.tensor([s["sft_score"] for s in samples], dtype=torch.float64)
    return summarize(verdict, policy, sft)


def markdown_report(report: dict, label: str) -> str:
    """Per-set table, then the row in the paper's Table 2 layout (percent)."""
    settings, sets = report["settings"], report["sets"]
    lines = [
        f"# Policy vs SFT: `{label}`",
        "",
        f"- judge: `{settings['judge']}` ({settings['judge_kind']}), tie margin "
        f"{settings['tie_margin']:g}",
        f"- SFT: `{settings['sft']}`; decoding: "
        + ("greedy" if settings["greedy"] else
           f"temperature {settings['temperature']:g}, top-p {settings['top_p']:g}")
        + f", max {settings['max_new_tokens']} new tokens, seed {settings['seed']}",
        "",
        "| set | prompts | Win % ↑ | Lose % ↓ | Tie % | Net win % ↑ | mean score policy "
        "| mean score SFT |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for name, row in sets.items():
        lines.append(
            f"| {name} | {row['num_prompts']} | {100 * row['win_rate']:.2f} | "
            f"{100 * row['lose_rate']:.2f} | {100 * row['tie_rate']:.2f} | "
            f"{100 * row['net_win_rate']:.2f} | {row['mean_score_policy']:.4f} | "
            f"{row['mean_score_sft']:.4f} |"
        )
    header, rule, cells = ["Model"], ["---"], [label]
    for name in sets:
        header += [f"{name.capitalize()} Win ↑", f"{name.capitalize()} Lose ↓",
                   f"{name.capitalize()} Tie"]  # fmt: skip
        rule += ["---:"] * 3
        cells += [f"{100 * sets[name][key]:.2f}" for key in ("win_rate", "lose_rate", "tie_rate")]
    lines += [
        "",
        "Table 2 layout (over the SFT model, percent):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(rule) + "|",
        "| " + " | ".join(cells) + " |",
        "",
    ]
    return "\n".join(lines)


def summary_fields(report: dict) -> dict:
    """The one-line summary: which judge scored, then per set win/tie/lose and the net win rate
    in percent of the set's prompts (the units of eval_policy.md and the demo's table)."""
    settings = report["settings"]
    fields = {"judge": settings["judge"], "judge_kind": settings["judge_kind"]}
    for name, row in report["sets"].items():
        rates = (100 * row[key] for key in ("win_rate", "tie_rate", "lose_rate"))
        fields[f"{name}_win_tie_lose_pct"] = "/".join(f"{rate:.1f}" for rate in rates)
        fields[f"{name}_net_win_pct"] = f"{100 * row['net_win_rate']:+.1f}"
    return fields


OUTPUT_FILES = ("eval_policy_samples.jsonl", "eval_policy.md", "eval_policy.json")


def write_outputs(out: Path, report: dict, samples: list[dict], label: str) -> None:
    from megatron_rlhf.utils import write_jsonl

    write_jsonl(out / OUTPUT_FILES[0], samples)
    with atomic_output(out / OUTPUT_FILES[1]) as tmp:
        tmp.write_text(markdown_report(report, label), encoding="utf-8")
    write_json(out / OUTPUT_FILES[2], report)
