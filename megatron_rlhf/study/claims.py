"""The study's claims, and how each is decided.

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
*inconclusive* otherwise. The raw 95 % t-interval is reported beside it.

Seeds needed (``seeds_needed``): the fewest seeds at which a two-sided paired t-test at the
claim's Holm level (``holm_level``: 0.05 / (family size - rank + 1), rank 1 the smallest raw p
of the family) has 80 % power (noncentral t), taking the observed mean difference (minus the
null) and its across-seed std as the truth. It is a planning figure: the observed effect of
a claim chosen because it looked interesting is biased away from 0, so it is optimistic.

Families: ``paper`` (the paper's claims; the paper fixes 1 epoch of reward training, so its
calibration claims are about the 1-epoch models; every seed runs them), ``rehearsal`` (what
makes a null on Selective Rehearsal informative: selection against random rehearsal, the
gold-top-k ceiling, the positive control and the gamma dose), ``settings`` (AM-PPO against
RM-PPO at the other settings of the PPO grid), ``margin`` (Table 1 per AM margin m other than
the paper's 2.5, which the paper family holds), and ``exploratory`` (over-training and the
rest). Only the paper family counts for or against the paper; the others are corrected among
themselves and may run on fewer seeds (the exploratory seeds, the first ones).

Arms that run on fewer seeds are compared on the seeds both sides have: every arm runs on a
prefix of the seeds (the first ``exploratory_seeds`` or all), so the per-seed lists are paired
by position up to the shorter one.

``CLAIMS_VERSION`` numbers this list; a run records it (``settings.claims_version``), so a report
says whether its claims were declared before its records were written or applied to them after.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_rlhf.study.presets import TABLE1_MARGINS

ALPHA = 0.05
POWER = 0.8
"""Power the ``seeds_needed`` figure is computed for."""
ACCURACY_NI_MARGIN = 1.0
"""Points of ranking accuracy the AM may lose to the RM and still "keep" its accuracy."""
CLAIMS_VERSION = 4
"""4 (issue 36, the study v3 world): SR on the minor skill (paper family); the ``rehearsal``
family (selection vs random, the gold-top-k ceiling, the positive control, the gamma dose) and
the ``settings`` family (AM vs RM at each other PPO setting), declared before the v3 run.
3: the 1-epoch RM over-confidence claim declared; the over-training claims moved to the
exploratory family; m = 2.5 counted once (paper family, not again in ``margin``); seeds needed
at 80 % power and the Holm level. 2: the list of the 15-seed published run."""


@dataclass(frozen=True)
class Claim:
    name: str
    """A stable identifier (results.json ``claims[].name``)."""
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


def _nets(better: str, worse: str, set_name: str):
    """The net win of arm ``better`` against arm ``worse`` on one judged set."""
    return _pair(_net(better, set_name), _net(worse, set_name))


def _pair(better, worse):
    def get(results: dict) -> tuple[list[float], list[float]]:
        b, w = better(results), worse(results)
        n = min(len(b), len(w))  # arms run on a prefix of the seeds (module docstring)
        return b[:n], w[:n]

    return get


def _zero(values):
    return lambda results: [0.0] * len(values(results))


def _above_zero(values):
    """A one-sample claim (value > 0) as a pair: the values against zeros."""
    return _pair(values, _zero(values))


def declared_claims(arms=()) -> list[Claim]:
    """Every claim, in the order the report lists them; ``arms`` (the run's arm names) adds the
    dose and grid claims of the arms it has (``am_ppo_sr_g<gamma>``, ``am_ppo_lr<lr>_s<steps>``
    beside ``rm_ppo_lr<lr>_s<steps>``)."""
    claims = [
        Claim("am_ece_lower", "paper", "AM is better calibrated than RM (ECE lower)",
              _pair(_t1("am", "ece", True), _t1("rm", "ece", True)), units="ECE x100"),
        Claim("am_brier_lower", "paper",
              "AM is closer to the true preference probability (Brier lower)",
              _pair(_t1("am", "brier", True), _t1("rm", "brier", True)), digits=4),
        Claim("am_keeps_accuracy", "paper", f"AM keeps RM's ranking accuracy (non-inferior, "
              f"margin {ACCURACY_NI_MARGIN:g} point)",
              _pair(_t1("am", "accuracy"), _t1("rm", "accuracy")),
              margin=ACCURACY_NI_MARGIN, units="points"),
        Claim("rm_overconfident", "paper", "The RM as trained (1 epoch) is over-confident "
              "(signed confidence - accuracy > 0)", _above_zero(_t1("rm", "overconfidence")),
              units="points"),
        Claim("am_ppo_beats_rm_ppo_main", "paper",
              "AM-PPO beats RM-PPO on the main set (net win vs SFT)",
              _nets("am_ppo", "rm_ppo", "main"), units="points"),
        Claim("am_ppo_beats_rm_ppo_ma_main", "paper", "AM-PPO beats RM-PPO with moving-average "
              "normalisation on the main set (MA does not rescue RM-PPO)",
              _nets("am_ppo", "rm_ppo_ma", "main"), units="points"),
        Claim("am_ppo_forgets_less", "paper",
              "AM-PPO forgets less than RM-PPO (forget-set net win)",
              _nets("am_ppo", "rm_ppo", "forget"), units="points"),
        Claim("sr_helps_forget", "paper", "Selective Rehearsal helps AM-PPO on the forget set",
              _nets("am_ppo_sr", "am_ppo", "forget"), units="points"),
        Claim("sr_helps_main", "paper", "Selective Rehearsal helps AM-PPO on the main set",
              _nets("am_ppo_sr", "am_ppo", "main"), units="points"),
        Claim("sr_helps_minor", "paper", "Selective Rehearsal helps AM-PPO keep the minor "
              "skill (forget-set stories: 5 % of the PPO prompts, never in the preference data)",
              _nets("am_ppo_sr", "am_ppo", "minor"), units="points"),
        Claim("am_ppo_sr_beats_sft_main", "paper",
              "AM-PPO-SR beats SFT on the main set (net win > 0)",
              _above_zero(_net("am_ppo_sr", "main")), units="points"),
        Claim("am_ppo_sr_beats_sft_forget", "paper",
              "AM-PPO-SR beats SFT on the forget set (net win > 0)",
              _above_zero(_net("am_ppo_sr", "forget")), units="points"),
        Claim("rm_ppo_hacks_more", "paper", "RM-PPO hacks its reward more than AM-PPO "
              "(hacking index, mean over tasks)", _pair(_arm("rm_ppo", "main", "hacking_index"),
                                                       _arm("am_ppo", "main", "hacking_index")),
              units="SFT std"),
    ]  # fmt: skip
    for m, model in TABLE1_MARGINS.items():
        if model == "am":  # m = 2.5: the paper family's first two claims
            continue
        claims += [
            Claim(f"am_m{m:g}_ece_lower", "margin",
                  f"AM (m = {m:g}) is better calibrated than RM (ECE lower)",
                  _pair(_t1(model, "ece", True), _t1("rm", "ece", True))),
            Claim(f"am_m{m:g}_brier_lower", "margin",
                  f"AM (m = {m:g}) is closer to p_true than RM (Brier lower)",
                  _pair(_t1(model, "brier", True), _t1("rm", "brier", True)), digits=4),
        ]  # fmt: skip
    claims += [
        Claim("selection_beats_random", "rehearsal",
              "Selection beats random rehearsal of equal size (forget-set net win)",
              _nets("am_ppo_sr", "am_ppo_rr", "forget"), units="points"),
        Claim("selection_beats_random_minor", "rehearsal", "Selection beats random rehearsal "
              "on the minor skill (clusters give it more than its 5 %)",
              _nets("am_ppo_sr", "am_ppo_rr", "minor"), units="points"),
        Claim("gold_selection_helps_forget", "rehearsal", "Rehearsal on the gold top-k (the "
              "ceiling of selection) helps AM-PPO on the forget set",
              _nets("am_ppo_sr_gold", "am_ppo", "forget"), units="points"),
        Claim("gold_selection_beats_am_selection", "rehearsal", "The gold top-k beats the AM "
              "top-k as D_R (forget-set net win)",
              _nets("am_ppo_sr_gold", "am_ppo_sr", "forget"),
              units="points"),
        Claim("control_helps_forget", "rehearsal", "Positive control: rehearsal on SFT "
              "demonstrations of every family helps AM-PPO on the forget set",
              _nets("am_ppo_sft", "am_ppo", "forget"), units="points"),
        Claim("control_helps_minor", "rehearsal", "Positive control: rehearsal on SFT "
              "demonstrations helps AM-PPO keep the minor skill",
              _nets("am_ppo_sft", "am_ppo", "minor"), units="points"),
    ]  # fmt: skip
    for arm in sorted(a for a in arms if a.startswith("am_ppo_sr_g") and a != "am_ppo_sr_gold"):
        gamma = arm.removeprefix("am_ppo_sr_g")
        claims += [
            Claim(f"sr_g{gamma}_helps_forget", "rehearsal", f"Selective Rehearsal at gamma "
                  f"{gamma} helps AM-PPO on the forget set",
                  _nets(arm, "am_ppo", "forget"), units="points"),
            Claim(f"sr_g{gamma}_helps_minor", "rehearsal", f"Selective Rehearsal at gamma "
                  f"{gamma} helps AM-PPO keep the minor skill",
                  _nets(arm, "am_ppo", "minor"), units="points"),
        ]  # fmt: skip
    for arm in sorted(a for a in arms if a.startswith("am_ppo_lr")):
        rm_arm, setting = "rm" + arm.removeprefix("am"), arm.removeprefix("am_ppo_")
        claims += [
            Claim(f"am_ppo_beats_rm_ppo_main_{setting}", "settings", f"AM-PPO beats RM-PPO on "
                  f"the main set at PPO setting {setting}",
                  _nets(arm, rm_arm, "main"), units="points"),
            Claim(f"am_ppo_forgets_less_{setting}", "settings", f"AM-PPO forgets less than "
                  f"RM-PPO at PPO setting {setting}",
                  _nets(arm, rm_arm, "forget"), units="points"),
        ]  # fmt: skip
    claims += [
        Claim("overtraining_rm_overconfident", "exploratory", "Over-training makes the RM "
              "over-confident (signed confidence - accuracy rises from 1 epoch)",
              _pair(_t1("rm_long", "overconfidence"), _t1("rm", "overconfidence")),
              units="points"),
        Claim("overtrained_am_ece_lower", "exploratory",
              "Over-trained, the AM stays better calibrated than the RM (ECE lower)",
              _pair(_t1("am_long", "ece", True), _t1("rm_long", "ece", True)), units="ECE x100"),
        Claim("rehearsal_helps_rm_ppo", "exploratory",
              "Rehearsal helps RM-PPO too (forget-set net win)",
              _nets("rm_ppo_sr", "rm_ppo", "forget"), units="points"),
        Claim("rm_ppo_because_code", "exploratory", "RM-PPO writes the planted feature into "
              "code more than AM-PPO ('because' rate in code, policy - SFT; the gold reward "
              "penalises it there)",
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


def holm_levels(pvalues: list[float], alpha: float = ALPHA) -> list[float]:
    """The level each test is held to in Holm's step-down: ``alpha / (m - rank + 1)``, rank 1
    the smallest p (ties in input order), in the input order."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    levels = [alpha] * len(pvalues)
    for rank, i in enumerate(order):
        levels[i] = alpha / (len(pvalues) - rank)
    return levels


def paired_test(diffs: list[float], null: float = 0.0) -> dict:
    """Mean difference (``estimate``), its 95 % t-interval (``intervals.t_interval``) and the
    two-sided p-value against ``null`` (None where fewer than 2 seeds leave them undefined)."""
    from scipy import stats

    from megatron_rlhf.study.intervals import t_interval

    mean, low, high = t_interval(diffs)
    if low is None:
        return {"estimate": mean, "ci_low": None, "ci_high": None, "p": None, "sd": None}
    n, sd = len(diffs), float(np.std(diffs, ddof=1))
    if sd == 0.0:
        p = 0.0 if mean != null else 1.0
    else:
        p = float(2 * stats.t.sf(abs(mean - null) / (sd / math.sqrt(n)), n - 1))
    return {"estimate": mean, "ci_low": low, "ci_high": high, "p": p, "sd": sd}


SEEDS_LIMIT = 100_000


def t_test_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided one-sample t-test at level ``alpha`` with ``n`` seeds when the
    true mean difference is ``effect`` and its std ``sd`` (noncentral t, ``n - 1`` df).

    The lower tail ``P(T <= -critical)`` is at most ``P(Z + shift <= 0) = Phi(-shift)`` (the
    noncentral t is ``(Z + shift) / sqrt(V / df)``), and far out scipy's ``nct.cdf`` returns
    nan there (scipy 1.17: at shifts above 5, where the bound is below 3e-7, for some
    ``df`` and not for their neighbours): a nan tail counts as 0, so the power is low by at most
    that bound instead of nan (which made ``power >= 0.8`` false and the seed search skip past
    the answer). A non-finite upper tail is an error, never a power."""
    from scipy import stats

    df, shift = n - 1, abs(effect) / sd * math.sqrt(n)
    critical = stats.t.ppf(1 - alpha / 2, df)
    upper = float(stats.nct.sf(critical, df, shift))
    if not math.isfinite(upper):
        raise ValueError(f"noncentral t upper tail is {upper} (df {df}, shift {shift:g})")
    lower = float(stats.nct.cdf(-critical, df, shift))
    return upper + (lower if math.isfinite(lower) else 0.0)


def seeds_needed(effect: float, sd: float | None, alpha: float = ALPHA, power: float = POWER,
                 limit: int = SEEDS_LIMIT) -> int | None:  # fmt: skip
    """The fewest seeds (>= 2) at which ``t_test_power`` reaches ``power`` (None: more than
    ``limit``, no effect, or no spread known). The search starts at the z-test's count, which
    the t-test never beats, so the noncentral t is only evaluated near its answer."""
    from scipy import stats

    if sd is None or effect == 0.0:
        return None
    if sd == 0.0:
        return 2
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n = max(2, math.ceil((z * sd / abs(effect)) ** 2))
    while n <= limit:
        if t_test_power(effect, sd, n, alpha) >= power:
            return n
        n += 1
    return None


def evaluate_claims(results: dict, claims: list[Claim] | None = None) -> list[dict]:
    """One row per claim whose values results.json holds: name, family, text, kind, the mean
    difference (``estimate``), its interval, raw and Holm-adjusted p (within the family), the
    Holm level at its rank, verdict and seeds needed (the module docstring's rule)."""
    rows = []
    for claim in declared_claims(results["table2"]) if claims is None else claims:
        try:
            better, worse = claim.values(results)
        except KeyError:
            continue  # an arm or scorer this run does not have (e.g. a smaller preset)
        diffs = [b - w for b, w in zip(better, worse)]
        rows.append({
            "name": claim.name, "family": claim.family, "text": claim.text,
            "units": claim.units, "digits": claim.digits,
            "kind": "non-inferiority" if claim.margin else "superiority",
            "margin": claim.margin, "seeds": len(diffs),
            **paired_test(diffs, -claim.margin),
        })  # fmt: skip
    for family in sorted({row["family"] for row in rows}):
        members = [row for row in rows if row["family"] == family and row["p"] is not None]
        pvalues = [row["p"] for row in members]
        for row, adjusted, level in zip(members, holm(pvalues), holm_levels(pvalues)):
            row["p_holm"], row["holm_level"] = adjusted, level
    for row in rows:
        row.setdefault("p_holm", None)
        row.setdefault("holm_level", None)
        row["verdict"] = verdict(row)
        level = row["holm_level"]
        row["seeds_needed"] = (
            None if level is None
            else seeds_needed(row["estimate"] + row["margin"], row["sd"], alpha=level)
        )  # fmt: skip
    return rows


def verdict(row: dict) -> str:
    if row["p_holm"] is None:
        side = row["estimate"] + row["margin"] > 0
        return "direction only (1 seed)" + (" ✓" if side else " ✗")
    if row["p_holm"] >= ALPHA:
        return "inconclusive"
    return "reproduced" if row["estimate"] + row["margin"] > 0 else "contradicted"
