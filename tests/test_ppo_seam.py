"""The PPO trainer's seam (issue 47, items 1-2), read from the source, no model run.

- ``PPOTrainer.fit`` and the step module (ppo/step.py) name no mode: no placement, staleness,
  rollout-engine or algorithm word; ``fit`` is at most 20 lines.
- Each mode is branched on (an ``if`` / conditional expression testing its key) in at most two
  modules under ppo/: the one that chooses it at build time and the one that implements it.
  The checks that refuse a combination of settings (ppo/checks.py, the sections of
  ppo/config.py) are not branches of a run and are not counted.
- No module under ppo/ is over 350 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PPO = Path(__file__).resolve().parents[1] / "megatron_rlhf" / "ppo"

MODE_WORDS = (
    "placement", "disaggregated", "colocated", "link", "trains", "training_group",
    "staleness", "max_staleness", "rollout.engine", "vllm", "rejection_sampling", "packing",
    "isinstance",
)  # fmt: skip
"""What would say that a mode is being asked about (the step module holds both steps, so
``RejectionStep`` is allowed; ``async.value_targets``' V-trace cap is a setting of the
advantages, not a mode)."""

MODES = {
    "placement": ("placement.", "is_rollout_rank", "DisaggregatedRollout"),
    "staleness": ("max_staleness",),
    "rollout engine": ("rollout.engine", ".engine=="),
    "step": ("algorithm", "rejection_sampling"),
}
"""Each mode and what a test of it reads."""

REFUSALS = ("checks.py", "config.py")


def code_of(node: ast.AST) -> str:
    """``node``'s code without docstrings or comments (``ast.unparse`` drops comments)."""
    node = ast.parse(ast.unparse(node))
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                body[0] = ast.Pass()
    return ast.unparse(node)


def trainer_fit() -> ast.FunctionDef:
    tree = ast.parse((PPO / "train.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer")
    return next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "fit")


@pytest.mark.parametrize("where", ["PPOTrainer.fit", "ppo/step.py"])
def test_fit_and_the_step_name_no_mode(where):
    node = trainer_fit() if where == "PPOTrainer.fit" else ast.parse((PPO / "step.py").read_text())
    code = code_of(node)
    assert [word for word in MODE_WORDS if word in code] == []


def test_fit_is_one_screen():
    fit = trainer_fit()
    assert fit.end_lineno - fit.lineno + 1 <= 20


def branched_modules() -> dict[str, list[str]]:
    """{mode: the ppo/ modules with a branch whose test reads it}."""
    found: dict[str, set[str]] = {mode: set() for mode in MODES}
    for path in sorted(PPO.glob("*.py")):
        if path.name in REFUSALS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else []
            tests += node.ifs if isinstance(node, ast.comprehension) else []
            tests += [node.subject] if isinstance(node, ast.Match) else []
            for test in tests:
                text = ast.unparse(test).replace(" ", "")
                for mode, marks in MODES.items():
                    if any(mark in text for mark in marks):
                        found[mode].add(path.name)
    return {mode: sorted(names) for mode, names in found.items()}


def test_each_mode_is_branched_on_in_at_most_two_modules():
    """Today: placement in setup.py (its layouts) and roles.py (its roles and side); staleness
    in roles.py (the correction) and staleness.py (the queue); the engine in setup.py only (what
    vLLM cannot run; its choice is generation/rollout_engines.py's); the step in setup.py and
    roles.py."""
    modules = branched_modules()
    assert {mode: names for mode, names in modules.items() if len(names) > 2} == {}
    assert "roles.py" in modules["placement"] and "roles.py" in modules["step"]


def test_the_check_sees_a_branch():
    """The scan finds what it looks for: a branch on the placement in a made-up module."""
    source = "if config.placement.mode == 'disaggregated':\n    pass\n"
    test = ast.parse(source).body[0].test
    assert any(mark in ast.unparse(test).replace(" ", "") for mark in MODES["placement"])


def test_no_ppo_module_is_over_350_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PPO.glob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > 350} == {}
