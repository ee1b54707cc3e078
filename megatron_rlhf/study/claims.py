"""The study's claims, and how each is decided.

Every claim compares two settings on the same seeds (the seed fixes the reward models' init and
data order, k-means, PPO and evaluation sampling; seeds are nested in worlds, each with its own
SFT data, preference data and held-out sets), in the paper's own direction. A claim is one of:

- **superiority**: ``better - worse > 0``;
- **non-inferiority** (the paper says "keeps"): ``better - worse > -margin`` (the margin is
  part of the claim, stated here).

**The interval counts the held-out draw** (audit III, 3.6 and 3.8). Every seed of a world is
judged on the same prompts and scores the same pairs, so a test over seeds alone treats that
one draw as fixed, and its verdict holds only for those items. Each claim's estimate is the
mean over seeds of the per-seed difference (a net win, a utility part, a Table 1 metric); its
standard error adds the held-out items' variance to the seeds' (``intervals.py``): se² =
sd(per-seed differences)² / seeds + the variance of the estimate over ``intervals.RESAMPLES``
resamples of each world's held-out items with replacement, the seeds fixed (for Table 1 one
pair draw serves both models and every seed of the world, ECE bins fixed from the full set).
The test is a two-sided t with seeds - 1 df on (estimate + margin) / se, the 95 % interval
estimate ± t_0.975 · se; a row gives both terms (``se_seeds``, ``se_items``). A row's
``resamples`` says what it resampled: the hacking slope resamples seeds only (its per-seed
value is a regression over four checkpoints, each a nonlinear function of the prompts), so its
se is the seeds' t-test's. Each row also keeps the seeds-only paired t-test
(``p_seeds_only``, ``ci_seeds_only``, ``sd_seeds_only``) for comparison.

The claims of one family are corrected together by Holm's step-down method (familywise error
5 %): a claim is *reproduced* when its Holm-adjusted p-value is below 0.05 and the difference
lies on the paper's side of the null, *contradicted* when it is below 0.05 on the other side,
*inconclusive* otherwise. With one seed only the direction is reported.

Seeds needed (``seeds_needed``): the fewest seeds at which a two-sided t-test at the claim's
Holm level (``holm_level``: 0.05 / (family size - rank + 1), rank 1 the smallest raw p of the
family) has 80 % power (noncentral t), taking the observed difference (minus the null) as the
truth and ``sd`` = se · sqrt(seeds) as the per-seed std (so the held-out items' share of the
noise counts, at today's held-out set sizes). A planning figure: the observed effect of a claim
chosen because it looked interesting is biased away from 0, so it is optimistic.

Families (only ``paper`` counts for or against the paper; each is corrected on its own):

- ``paper``: Table 1 (1-epoch RM and AM), AM-PPO against RM-PPO, forgetting on the minor skills
  (the primary forget endpoint: the forget prompts of ``world.MINOR_TASKS`` pooled, families PPO
  sees at 5 % each and the reward models never saw), Selective Rehearsal, and hacking measured
  the paper's way (gold gained per unit of training reward gained along the PPO run);
- ``minor_split``: the minor-skill loss split into the skill (form + band utility) and the
  planted feature's transfer ("because" utility), the two declared endpoints;
- ``transfer``: the forget prompts of the preference families (main-family transfer: what
  claims v4 called the forget set);
- ``rehearsal``: at gamma 0.01 on every seed: selection against random rehearsal, the gold
  top-k ceiling;
- ``attribution``: at gamma 0.1, where rehearsal acts, on the seeds those arms ran: random and
  family-stratified D_R, SFT demonstrations (positive control), no rehearsal at a KL-matched
  beta, and gamma 1;
- ``exploratory``: the rest.

Dropped from the claims (still in results.json, descriptive): the margin family and the
over-training claims (3 seeds: a t with 2 df under Holm passes only huge effects, and reaching
power costs about 12 task-min), and the PPO-settings grid (not run in v4; v3 answered it).

Arms that run on fewer seeds are compared on the seeds both sides have.

``CLAIMS_VERSION`` numbers this list; a run records it (``settings.claims_version``), so a report
says whether its claims were declared before its records were written or applied to them after.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05
POWER = 0.8
"""Power the ``seeds_needed`` figure is computed for."""
ACCURACY_NI_MARGIN = 1.0
"""Points of ranking accuracy the AM may lose to the RM and still "keep" its accuracy."""
CLAIMS_VERSION = 5
"""5 (issue 50, study v4): verdicts from intervals that resample seeds and held-out items within
worlds; the pooled minor skills as the primary forget endpoint, split into skill and hack
transfer (``minor_split``); main-family transfer its own family; hacking as the slope of gold on
training-reward gain along the run; the ``attribution`` family at gamma 0.1; the margin,
over-training and settings claims dropped (descriptive only).
4 (issue 36, the study v3 world): SR on the minor skill (paper family); the ``rehearsal``
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
    """The claim in the paper's direction, saying what is measured."""
    comparison: Callable
    """``stats.Evidence`` -> ``stats.Comparison``, oriented so that better > worse (KeyError:
    an arm or a value this run does not have, and the claim is skipped)."""
    margin: float = 0.0
    """0: superiority; > 0: non-inferiority, better - worse > -margin."""
    units: str = ""
    digits: int = 2


def _t1(better: str, worse: str | None, metric: str, lower_is_better: bool = False):
    return lambda ev: ev.pair_metric(better, worse, metric, lower_is_better)


def _nets(better: str, worse: str | None, set_name: str):
    """The net win vs SFT of arm ``better`` minus arm ``worse``'s (None: minus 0) per prompt."""
    return lambda ev: ev.items(better, worse, set_name, "net_win")


def _sft_wins(arm: str, set_name: str):
    """SFT's net win against ``arm`` (the arm's net win, negated): > 0 where SFT is better."""
    return lambda ev: ev.items(arm, None, set_name, "net_win").negated()


def _utility(better: str, worse: str | None, set_name: str, part: str, negate: bool = False):
    def get(ev):
        comparison = ev.items(better, worse, set_name, f"utility_{part}")
        return comparison.negated() if negate else comparison

    return get


def minor_text() -> str:
    from megatron_rlhf.study.world import MINOR_TASKS

    return f"minor skills ({', '.join(MINOR_TASKS)} pooled; forget-set prompts)"


TRANSFER = "main-family transfer (forget-set prompts of the preference families)"
MAIN = "main set"


def declared_claims(arms=()) -> list[Claim]:
    """Every claim, in the order the report lists them (``arms`` is kept for callers that
    pass the run's arm names; every claim is declared, a missing arm skips it)."""
    minor = minor_text()
    net = "net win vs SFT"
    claims = [
        Claim("am_ece_lower", "paper", "AM is better calibrated than RM (ECE lower; 1 epoch, "
              "held-out pairs)", _t1("am", "rm", "ece", True), units="ECE x100"),
        Claim("am_brier_lower", "paper",
              "AM is closer to the true preference probability (Brier lower; held-out pairs)",
              _t1("am", "rm", "brier", True), digits=4),
        Claim("am_keeps_accuracy", "paper", f"AM keeps RM's ranking accuracy on held-out pairs "
              f"(non-inferior, margin {ACCURACY_NI_MARGIN:g} point)",
              _t1("am", "rm", "accuracy"), margin=ACCURACY_NI_MARGIN, units="points"),
        Claim("rm_overconfident", "paper", "The RM as trained (1 epoch) is over-confident on "
              "held-out pairs (signed confidence - accuracy > 0)",
              _t1("rm", None, "overconfidence"), units="points"),
        Claim("am_ppo_beats_rm_ppo_main", "paper", f"AM-PPO beats RM-PPO on the {MAIN} ({net})",
              _nets("am_ppo", "rm_ppo", "main"), units="points"),
        Claim("am_ppo_beats_rm_ppo_ma_main", "paper", "AM-PPO beats RM-PPO with moving-average "
              f"normalisation on the {MAIN} ({net}; MA does not rescue RM-PPO)",
              _nets("am_ppo", "rm_ppo_ma", "main"), units="points"),
        Claim("rm_ppo_loses_minor", "paper", f"RM-PPO loses the {minor} to SFT (SFT's net win "
              "against RM-PPO > 0)", _sft_wins("rm_ppo", "minor"), units="points"),
        Claim("am_ppo_forgets_less", "paper", f"AM-PPO forgets less than RM-PPO on the {minor} "
              f"({net})", _nets("am_ppo", "rm_ppo", "minor"), units="points"),
        Claim("sr_helps_minor", "paper", f"Selective Rehearsal helps AM-PPO keep the {minor} "
              f"({net})", _nets("am_ppo_sr", "am_ppo", "minor"), units="points"),
        Claim("sr_helps_main", "paper", f"Selective Rehearsal helps AM-PPO on the {MAIN} "
              f"({net})", _nets("am_ppo_sr", "am_ppo", "main"), units="points"),
        Claim("am_ppo_sr_beats_sft_main", "paper",
              f"AM-PPO-SR beats SFT on the {MAIN} ({net} > 0)",
              _nets("am_ppo_sr", None, "main"), units="points"),
        Claim("rm_ppo_hacks_more", "paper", "RM-PPO hacks its reward more than AM-PPO: less "
              "gold gained per unit of training reward gained (slope through the origin of gold "
              "on training-reward gain, both in SFT-std units, main set, over the judged checkpoints of "
              "one run per reward and seed)",
              lambda ev: ev.seeds(("hacking_slope", "am"), ("hacking_slope", "rm")),
              units="gold SFT-std per training SFT-std", digits=3),
    ]  # fmt: skip
    util = "utility per prompt, policy - SFT"
    claims += [
        Claim("rm_ppo_loses_skill", "minor_split", f"RM-PPO loses skill on the {minor} (form + "
              f"band {util} < 0)", _utility("rm_ppo", None, "minor", "skill", negate=True),
              units="utility", digits=3),
        Claim("rm_ppo_hack_transfer", "minor_split", f"RM-PPO's planted feature leaks into the "
              f"{minor} and costs gold there ('because' {util} < 0)",
              _utility("rm_ppo", None, "minor", "because", negate=True), units="utility",
              digits=3),
        Claim("am_vs_rm_skill", "minor_split", f"AM-PPO keeps more skill than RM-PPO on the "
              f"{minor} (form + band {util})", _utility("am_ppo", "rm_ppo", "minor", "skill"),
              units="utility", digits=3),
        Claim("am_vs_rm_because", "minor_split", f"AM-PPO transfers less of the planted feature "
              f"than RM-PPO to the {minor} ('because' {util})",
              _utility("am_ppo", "rm_ppo", "minor", "because"), units="utility", digits=3),
        Claim("sr_vs_am_skill", "minor_split", f"Selective Rehearsal keeps more skill than "
              f"AM-PPO on the {minor} (form + band {util})",
              _utility("am_ppo_sr", "am_ppo", "minor", "skill"), units="utility", digits=3),
        Claim("sr_vs_am_because", "minor_split", f"Selective Rehearsal transfers less of the "
              f"planted feature than AM-PPO to the {minor} ('because' {util})",
              _utility("am_ppo_sr", "am_ppo", "minor", "because"), units="utility", digits=3),
        Claim("am_ppo_beats_rm_ppo_transfer", "transfer", f"AM-PPO beats RM-PPO on the "
              f"{TRANSFER} ({net})", _nets("am_ppo", "rm_ppo", "transfer"), units="points"),
        Claim("sr_helps_transfer", "transfer", f"Selective Rehearsal helps AM-PPO on the "
              f"{TRANSFER} ({net})", _nets("am_ppo_sr", "am_ppo", "transfer"), units="points"),
        Claim("selection_beats_random", "rehearsal", f"At gamma 0.01, AM selection beats random "
              f"rehearsal of equal size on the {minor} ({net})",
              _nets("am_ppo_sr", "am_ppo_rr", "minor"), units="points"),
        Claim("selection_beats_random_main", "rehearsal", f"At gamma 0.01, AM selection beats "
              f"random rehearsal of equal size on the {MAIN} ({net})",
              _nets("am_ppo_sr", "am_ppo_rr", "main"), units="points"),
        Claim("gold_selection_helps_minor", "rehearsal", "At gamma 0.01, rehearsal on the gold "
              f"top-k (the ceiling of selection) helps AM-PPO on the {minor} ({net})",
              _nets("am_ppo_sr_gold", "am_ppo", "minor"), units="points"),
        Claim("gold_selection_beats_am_selection", "rehearsal", "At gamma 0.01, the gold top-k "
              f"beats the AM top-k as D_R on the {minor} ({net})",
              _nets("am_ppo_sr_gold", "am_ppo_sr", "minor"), units="points"),
    ]  # fmt: skip
    g01 = "At gamma 0.1,"
    claims += [
        Claim("sr_g0.1_helps_minor", "attribution", f"{g01} Selective Rehearsal helps AM-PPO "
              f"keep the {minor} ({net})", _nets("am_ppo_sr_g0.1", "am_ppo", "minor"),
              units="points"),
        Claim("sr_g0.1_beats_random_g0.1", "attribution", f"{g01} AM selection beats random "
              f"rehearsal of equal size on the {minor} ({net})",
              _nets("am_ppo_sr_g0.1", "am_ppo_rr_g0.1", "minor"), units="points"),
        Claim("strat_g0.1_beats_sr_g0.1", "attribution", f"{g01} a family-stratified D_R "
              f"(every minor skill guaranteed) beats AM selection on the {minor} ({net}: "
              "rehearsing what was forgotten does more than AM selection)",
              _nets("am_ppo_strat_g0.1", "am_ppo_sr_g0.1", "minor"), units="points"),
        Claim("control_g0.1_helps_minor", "attribution", f"{g01} positive control: rehearsal on "
              f"SFT demonstrations of every family helps AM-PPO keep the {minor} ({net})",
              _nets("am_ppo_sft_g0.1", "am_ppo", "minor"), units="points"),
        Claim("sr_g0.1_beats_anchor", "attribution", f"{g01} Selective Rehearsal beats "
              "AM-PPO without rehearsal held closer to SFT by a 10x KL coefficient (am_ppo_kl, "
              f"beta 0.2: anchoring alone) on the {minor} ({net}: more than anchoring to SFT)",
              _nets("am_ppo_sr_g0.1", "am_ppo_kl", "minor"), units="points"),
        Claim("strat_g0.1_beats_anchor", "attribution", f"{g01} the family-stratified D_R "
              f"beats the 10x-KL anchor (am_ppo_kl) on the {minor} ({net})",
              _nets("am_ppo_strat_g0.1", "am_ppo_kl", "minor"), units="points"),
        Claim("sr_g1_helps_minor", "attribution", "At gamma 1, Selective Rehearsal helps AM-PPO "
              f"keep the {minor} ({net})", _nets("am_ppo_sr_g1", "am_ppo", "minor"),
              units="points"),
        Claim("sr_g0.1_helps_main", "attribution", f"{g01} Selective Rehearsal helps AM-PPO on "
              f"the {MAIN} ({net})", _nets("am_ppo_sr_g0.1", "am_ppo", "main"),
              units="points"),
        Claim("rehearsal_helps_rm_ppo", "exploratory", f"Selective Rehearsal helps RM-PPO keep "
              f"the {minor} ({net})", _nets("rm_ppo_sr", "rm_ppo", "minor"), units="points"),
        Claim("rm_ppo_because_code", "exploratory", "RM-PPO writes the planted feature into "
              "code more than AM-PPO ('because' rate in code on the main set, policy - SFT; "
              "the gold reward penalises it there)",
              lambda ev: ev.items("rm_ppo", "am_ppo", "main", "because_rate", task="code"),
              units="points"),
        Claim("control_helps_minor", "exploratory", "At gamma 0.01, positive control: "
              f"rehearsal on SFT demonstrations helps AM-PPO keep the {minor} ({net})",
              _nets("am_ppo_sft", "am_ppo", "minor"), units="points"),
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


def claim_test(comparison, margin: float = 0.0) -> dict:
    """The test of one comparison (module docstring): estimate, se, sd (= se · sqrt(seeds)),
    p, 95 % interval, seeds, worlds, what was resampled, and the seeds-only paired t-test
    beside it (``p_seeds_only``, ``ci_seeds_only``, ``sd_seeds_only``)."""
    from megatron_rlhf.study.intervals import bootstrap_decision, crossed_interval

    diffs = comparison.differences()
    seeds_only = paired_test(diffs, -margin)
    row = {"seeds": len(diffs), "worlds": comparison.worlds, "resamples": comparison.resamples,
           "p_seeds_only": seeds_only["p"], "sd_seeds_only": seeds_only["sd"],
           "ci_seeds_only": (None if seeds_only["ci_low"] is None
                             else [seeds_only["ci_low"], seeds_only["ci_high"]])}  # fmt: skip
    if comparison.blocks:
        test = crossed_interval(list(comparison.blocks), -margin)
        se = test["se"]
        row.update(se_seeds=test["se_seeds"], se_items=test["se_items"])
    else:
        sd = seeds_only["sd"]
        se = None if sd is None else sd / math.sqrt(len(diffs))
        test = {"estimate": seeds_only["estimate"], "se": se,
                **bootstrap_decision(seeds_only["estimate"], se or 0.0, len(diffs), -margin)}  # fmt: skip
    sd = None if se is None or test["p"] is None else se * math.sqrt(len(diffs))
    return {**row, "estimate": test["estimate"], "se": se if test["p"] is not None else None,
            "sd": sd, "ci_low": test["ci_low"], "ci_high": test["ci_high"], "p": test["p"]}  # fmt: skip


def evaluate_claims(evidence, arms=(), claims: list[Claim] | None = None) -> list[dict]:
    """One row per claim whose arms and values ``evidence`` (``stats.Evidence``) holds: name,
    family, text, kind, ``claim_test``'s figures, Holm-adjusted p (within the family), the Holm
    level at its rank, verdict and seeds needed (the module docstring's rule)."""
    rows = []
    for claim in declared_claims(arms) if claims is None else claims:
        try:
            comparison = claim.comparison(evidence)
        except KeyError:
            continue  # an arm, scorer or value this run does not have (e.g. a smaller preset)
        rows.append({
            "name": claim.name, "family": claim.family, "text": claim.text,
            "units": claim.units, "digits": claim.digits,
            "kind": "non-inferiority" if claim.margin else "superiority",
            "margin": claim.margin, **claim_test(comparison, claim.margin),
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
        sd = row["sd"]
        row["seeds_needed"] = (
            None if level is None or sd is None or not math.isfinite(sd)
            else seeds_needed(row["estimate"] + row["margin"], sd, alpha=level)
        )  # fmt: skip
    return rows


def verdict(row: dict) -> str:
    if row["p_holm"] is None:
        side = row["estimate"] + row["margin"] > 0
        return "direction only (1 seed)" + (" ✓" if side else " ✗")
    if row["p_holm"] >= ALPHA:
        return "inconclusive"
    return "reproduced" if row["estimate"] + row["margin"] > 0 else "contradicted"
