"""The study's claims, declared before any run, and how each is decided.

Every claim is a paired comparison of per-seed values (same seed, two settings: the seed fixes
the reward models' init and data order, k-means, PPO and evaluation sampling), in the paper's
own direction. A claim is one of:

- **superiority**: ``better - worse > 0``; two-sided paired t-test of the mean difference
  against 0;
- **non-inferiority** (the paper says "keeps"): ``better - worse > -margin``; the same test
  against ``-margin`` (the margin is part of the claim, stated here).

The claims of one family are corrected together by Holm's step-down method (familywise error
5 %): a claim is *reproduced* when its Holm-adjusted p-value is below 0.05 and the difference
lies on the paper's side of the null, *contradicted* when it is below 0.05 on the other side,
*inconclusive* otherwise. The raw 95 % t-interval is reported beside it, with the number of
seeds an interval would need to exclude the null at the observed mean and spread.

Families: ``paper`` (the paper's claims), ``margin`` (Table 1 per AM margin m), and
``exploratory`` (not the paper's claims: reported, corrected among themselves, never counted
for or against the paper).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_rlhf.study.presets import TABLE1_MARGINS

ALPHA = 0.05
ACCURACY_NI_MARGIN = 1.0
"""Points of ranking accuracy the AM may lose to the RM and still "keep" its accuracy."""


@dataclass(frozen=True)
class Claim:
    family: str
    text: str
    """The claim in the paper's direction."""
    values: Callable[[dict], tuple[list[float], list[float]]]
    """results.json -> (better, worse) per-seed values, oriented so that better > worse."""
    margin: float = 0.0
    """0: superiority; > 0: non-inferiority, better - worse > -margin."""
    units: str = ""
    digits: int = 2


def _t1(model: str, metric: str, lower_is_better: bool = False):
    def get(results: dict) -> list[float]:
        values = results["reward_models"][model][metric]["per_seed"]
        return [-v for v in values] if lower_is_better else list(values)

    return get


def _net(arm: str, set_name: str):
    return lambda results: list(results["table2"][arm][set_name]["per_seed"])


def _arm(arm: str, set_name: str, key: str):
    return lambda results: list(results["arms"][arm][set_name][key]["per_seed"])


def _pair(better, worse):
    return lambda results: (better(results), worse(results))


def _zero(values):
    return lambda results: [0.0] * len(values(results))


def declared_claims() -> list[Claim]:
    """Every claim, in the order the report lists them."""
    claims = [
        Claim("paper", "AM is better calibrated than RM (ECE lower)",
              _pair(_t1("am", "ece", True), _t1("rm", "ece", True)), units="ECE x100"),
        Claim("paper", "AM is closer to the true preference probability (Brier lower)",
              _pair(_t1("am", "brier", True), _t1("rm", "brier", True)), digits=4),
        Claim("paper", f"AM keeps RM's ranking accuracy (non-inferior, margin "
              f"{ACCURACY_NI_MARGIN:g} point)", _pair(_t1("am", "accuracy"), _t1("rm", "accuracy")),
              margin=ACCURACY_NI_MARGIN, units="points"),
        Claim("paper", "Over-training makes the RM over-confident (signed confidence - "
              "accuracy rises)", _pair(_t1("rm_long", "overconfidence"),
                                       _t1("rm", "overconfidence")), units="points"),
        Claim("paper", "Over-trained, the AM stays better calibrated than the RM (ECE lower)",
              _pair(_t1("am_long", "ece", True), _t1("rm_long", "ece", True))),
        Claim("paper", "AM-PPO beats RM-PPO on the main set (net win vs SFT)",
              _pair(_net("am_ppo", "main"), _net("rm_ppo", "main")), units="points"),
        Claim("paper", "AM-PPO beats RM-PPO with moving-average normalisation on the main set "
              "(MA does not rescue RM-PPO)",
              _pair(_net("am_ppo", "main"), _net("rm_ppo_ma", "main")), units="points"),
        Claim("paper", "AM-PPO forgets less than RM-PPO (forget-set net win)",
              _pair(_net("am_ppo", "forget"), _net("rm_ppo", "forget")), units="points"),
        Claim("paper", "Selective Rehearsal helps AM-PPO on the forget set",
              _pair(_net("am_ppo_sr", "forget"), _net("am_ppo", "forget")), units="points"),
        Claim("paper", "Selective Rehearsal helps AM-PPO on the main set",
              _pair(_net("am_ppo_sr", "main"), _net("am_ppo", "main")), units="points"),
        Claim("paper", "AM-PPO-SR beats SFT on the main set (net win > 0)",
              _pair(_net("am_ppo_sr", "main"), _zero(_net("am_ppo_sr", "main"))),
              units="points"),
        Claim("paper", "AM-PPO-SR beats SFT on the forget set (net win > 0)",
              _pair(_net("am_ppo_sr", "forget"), _zero(_net("am_ppo_sr", "forget"))),
              units="points"),
        Claim("paper", "RM-PPO hacks its reward more than AM-PPO (hacking index, mean over "
              "tasks)", _pair(_arm("rm_ppo", "main", "hacking_index"),
                              _arm("am_ppo", "main", "hacking_index")), units="SFT std"),
    ]  # fmt: skip
    for m, model in TABLE1_MARGINS.items():
        claims += [
            Claim("margin", f"AM (m = {m:g}) is better calibrated than RM (ECE lower)",
                  _pair(_t1(model, "ece", True), _t1("rm", "ece", True))),
            Claim("margin", f"AM (m = {m:g}) is closer to p_true than RM (Brier lower)",
                  _pair(_t1(model, "brier", True), _t1("rm", "brier", True)), digits=4),
        ]  # fmt: skip
    claims += [
        Claim("exploratory", "Selection beats random rehearsal (forget-set net win)",
              _pair(_net("am_ppo_sr", "forget"), _net("am_ppo_rr", "forget")), units="points"),
        Claim("exploratory", "Rehearsal helps RM-PPO too (forget-set net win)",
              _pair(_net("rm_ppo_sr", "forget"), _net("rm_ppo", "forget")), units="points"),
        Claim("exploratory", "RM-PPO writes the planted feature into code more than AM-PPO "
              "('because' rate in code, policy - SFT; the gold reward penalises it there)",
              _pair(_arm("rm_ppo", "main", "because_code"), _arm("am_ppo", "main", "because_code")),
              units="points"),
    ]  # fmt: skip
    return claims


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (monotone, capped at 1), in the input order."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [1.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def paired_test(diffs: list[float], null: float = 0.0) -> dict:
    """Mean difference, its 95 % t-interval (``stats.t_interval``) and the two-sided p-value
    against ``null`` (None where fewer than 2 seeds leave them undefined)."""
    from scipy import stats

    from megatron_rlhf.study.stats import t_interval

    mean, low, high = t_interval(diffs)
    if low is None:
        return {"mean": mean, "ci_low": None, "ci_high": None, "p": None, "sd": None}
    n, sd = len(diffs), float(np.std(diffs, ddof=1))
    if sd == 0.0:
        p = 0.0 if mean != null else 1.0
    else:
        p = float(2 * stats.t.sf(abs(mean - null) / (sd / math.sqrt(n)), n - 1))
    return {"mean": mean, "ci_low": low, "ci_high": high, "p": p, "sd": sd}


def seeds_needed(effect: float, sd: float | None, limit: int = 1000) -> int | None:
    """Seeds for a 95 % t-interval of half-width below |effect| at this spread (None: more
    than ``limit``, or no effect)."""
    from scipy import stats

    if sd is None or effect == 0.0:
        return None
    if sd == 0.0:
        return 2
    for n in range(2, limit + 1):
        if stats.t.ppf(1 - ALPHA / 2, n - 1) * sd / math.sqrt(n) < abs(effect):
            return n
    return None


def evaluate_claims(results: dict, claims: list[Claim] | None = None) -> list[dict]:
    """One row per claim whose values results.json holds: text, family, kind, mean difference,
    interval, raw and Holm-adjusted p (within the family), verdict and seeds needed."""
    rows = []
    for claim in declared_claims() if claims is None else claims:
        try:
            better, worse = claim.values(results)
        except KeyError:
            continue  # an arm or scorer this run does not have (e.g. a smaller preset)
        diffs = [b - w for b, w in zip(better, worse)]
        test = paired_test(diffs, -claim.margin)
        rows.append({
            "family": claim.family, "text": claim.text, "units": claim.units,
            "digits": claim.digits,
            "kind": "non-inferiority" if claim.margin else "superiority",
            "margin": claim.margin, "seeds": len(diffs), **test,
            "seeds_needed": seeds_needed(test["mean"] + claim.margin, test["sd"]),
        })  # fmt: skip
    for family in {row["family"] for row in rows}:
        members = [row for row in rows if row["family"] == family and row["p"] is not None]
        for row, adjusted in zip(members, holm([row["p"] for row in members])):
            row["p_holm"] = adjusted
    for row in rows:
        row.setdefault("p_holm", None)
        row["verdict"] = verdict(row)
    return rows


def verdict(row: dict) -> str:
    if row["p_holm"] is None:
        side = row["mean"] + row["margin"] > 0
        return "direction only (1 seed)" + (" ✓" if side else " ✗")
    if row["p_holm"] >= ALPHA:
        return "inconclusive"
    return "reproduced" if row["mean"] + row["margin"] > 0 else "contradicted"
