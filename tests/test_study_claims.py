"""The README's study section says only what the published results.json supports: every row of
its claims table (verdict, difference with its interval, Holm p) is the row of
``docs/paper_study/results.json``'s ``claims`` of that name, the table lists every claim of the
families it shows, and the counts of the paper family's verdicts above the bullets are the
results' counts. In-process: it reads two files."""

from __future__ import annotations

import json
import re
from collections import Counter

from torchrun_util import REPO

SECTION = "## The paper's claims, measured"
ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<family>[^|]+) \| (?P<verdict>[^|]+) \| "
                 r"(?P<difference>[^|]+) \| (?P<p_holm>[^|]+) \|$")  # fmt: skip
COUNT = re.compile(r"^- \*\*(?P<verdict>[A-Z][a-z]+) \((?P<count>\d+)\)\.\*\*", re.MULTILINE)
TOTAL = re.compile(r"Of the paper's (\d+) claims, after Holm:")


def study_section(readme: str) -> str:
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    return readme[start : end if end >= 0 else None]


def _p(value: float) -> str:
    """Holm p as the table shows it (report.md's rule)."""
    return f"{value:.3f}" if value >= 0.001 else "<0.001"


def _difference(row: dict) -> str:
    digits = row["digits"]
    text = (f"{row['estimate']:+.{digits}f} [{row['ci_low']:+.{digits}f}, "
            f"{row['ci_high']:+.{digits}f}]")  # fmt: skip
    return f"{text} {row['units']}" if row["units"] else text


def disagreements(section: str, results: dict) -> list[str]:
    """Every way the README's study section says more or other than ``results``: [] if none."""
    claims = {row["name"]: row for row in results["claims"]}
    rows = [m.groupdict() for m in map(ROW.match, section.splitlines()) if m]
    problems = [] if rows else ["no claims table in the README's study section"]
    names = [row["name"] for row in rows]
    problems += [f"{n}: listed twice" for n, k in Counter(names).items() if k > 1]
    for row in rows:
        name = row["name"]
        if name not in claims:
            problems.append(f"{name}: not a claim of results.json")
            continue
        want = claims[name]
        expected = {"family": want["family"], "verdict": want["verdict"],
                    "difference": _difference(want), "p_holm": _p(want["p_holm"])}  # fmt: skip
        for key, value in expected.items():
            if row[key].strip() != value:
                problems.append(f"{name}: README {key} {row[key].strip()!r}, results {value!r}")
    shown = {row["family"].strip() for row in rows}
    missing = [n for n, r in claims.items() if r["family"] in shown and n not in names]
    problems += [f"{n}: a claim of a family the table shows, left out" for n in missing]
    paper = Counter(r["verdict"] for r in claims.values() if r["family"] == "paper")
    counted = {m["verdict"].lower(): int(m["count"]) for m in COUNT.finditer(section)}
    if counted != dict(paper):
        problems.append(f"verdict counts: README {counted}, results {dict(paper)}")
    total = TOTAL.search(section)
    if total is None or int(total.group(1)) != sum(paper.values()):
        problems.append(f"'Of the paper's N claims': README {total and total.group(1)}, "
                        f"results {sum(paper.values())}")  # fmt: skip
    return problems


def _published() -> tuple[str, dict]:
    readme = (REPO / "README.md").read_text()
    results = json.loads((REPO / "docs" / "paper_study" / "results.json").read_text())
    return study_section(readme), results


def test_readme_claims_table_is_what_results_json_says():
    section, results = _published()
    assert disagreements(section, results) == []
    shown = {m["name"] for m in map(ROW.match, section.splitlines()) if m}
    families = {r["family"] for r in results["claims"] if r["name"] in shown}
    # the families the README discusses
    assert {"paper", "minor_split", "transfer", "rehearsal", "attribution"} <= families


def test_an_edited_verdict_number_or_omission_is_caught():
    """The check fails on a README that says more than the results: a verdict flipped, a
    difference moved, a claim dropped, a count raised."""
    section, results = _published()
    lines = section.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("| `sr_g0.1_helps_minor`"))
    row = ROW.match(lines[at]).groupdict()
    flipped = "reproduced" if row["verdict"].strip() != "reproduced" else "inconclusive"
    edits = {
        "verdict": lines[at].replace(f"| {row['verdict']} |", f"| {flipped} |"),
        "difference": lines[at].replace(row["difference"], "+9.99 [+9.00, +9.99] points"),
        "dropped": "",
    }
    for what, line in edits.items():
        edited = "\n".join(lines[:at] + [line] + lines[at + 1 :])
        problems = disagreements(edited, results)
        assert len(problems) == 1 and row["name"] in problems[0], (what, problems)
    raised = re.sub(r"\*\*Reproduced \((\d+)\)", lambda m: f"**Reproduced ({int(m[1]) + 1})",
                    section)  # fmt: skip
    assert [p for p in disagreements(raised, results) if p.startswith("verdict counts")]
    assert disagreements("## The paper's claims, measured\n", results)[0].startswith("no claims")
