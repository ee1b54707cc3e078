"""The PPO trainer's seam (issue 47, items 1-2), read from the source, no model run.

- ``PPOTrainer.fit`` and the step module (ppo/step.py) name no mode: no placement, staleness,
  rollout-engine or algorithm word; ``fit`` is at most 20 lines.
- Each mode is branched on (an ``if`` / conditional expression testing its key) in at most two
  modules under ppo/: the one that chooses it at build time and the one that implements it.
  The checks that refuse a combination of settings (ppo/checks.py, the sections of
  ppo/config.py) are not branches of a run and are not counted.
- No module under ppo/ is over 350 lines.
- The stages take their config sections and typed inputs (issue 47, "stages take sections"):
  ``score``, ``compute_advantages`` and ``ppo_update`` each at most 6 parameters, and no
  function under ppo/ has a ``pad_id`` with a default (the pad id is the tokenizer's).
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


STAGES = {"scoring.py": "score", "advantages.py": "compute_advantages", "update.py": "ppo_update"}
"""The stage functions and their modules."""


def parameters(function: ast.FunctionDef) -> list[str]:
    args = function.args
    every = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
    return [arg.arg for arg in every if arg is not None]


@pytest.mark.parametrize("module, name", sorted(STAGES.items()))
def test_stages_take_at_most_six_parameters(module, name):
    tree = ast.parse((PPO / module).read_text())
    function = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    assert len(parameters(function)) <= 6, parameters(function)


def pad_id_defaults(tree: ast.AST) -> list[str]:
    """The functions of ``tree`` whose ``pad_id`` parameter has a default."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        args = node.args
        positional = args.posonlyargs + args.args
        with_default = positional[len(positional) - len(args.defaults) :]
        with_default += [a for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        if any(arg.arg == "pad_id" for arg in with_default):
            found.append(getattr(node, "name", "lambda"))
    return found


def test_no_pad_id_default_under_ppo():
    found = {
        path.name: names
        for path in sorted(PPO.glob("*.py"))
        if (names := pad_id_defaults(ast.parse(path.read_text())))
    }
    assert found == {}


def test_the_pad_id_scan_sees_a_default():
    source = "def f(x, pad_id: int = 3):\n    pass\ndef g(x, *, pad_id=3):\n    pass\n"
    assert pad_id_defaults(ast.parse(source)) == ["f", "g"]
