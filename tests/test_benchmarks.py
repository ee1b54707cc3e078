"""The benchmark scripts stay runnable as the package changes under them.

Benchmarks are measured by hand, not in CI, so a renamed API breaks them silently (a merge once
left ``bench_refill.py`` importing a class that no longer existed). Every script under
``benchmarks/`` must import, and every ``from megatron_rlhf... import name`` in it, at module
level or inside a function, must name something that exists.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def our_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every ``from megatron_rlhf... import name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_rlhf"):
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_imports_and_names_what_exists(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other by name
    name = f"_benchmark_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{path.name}: no main()"
    missing = []
    for line, module_name, attribute in our_imports(path):
        imported = importlib.import_module(module_name)
        if not hasattr(imported, attribute):
            try:  # a submodule: from megatron_rlhf.generation import refill
                importlib.import_module(f"{module_name}.{attribute}")
            except ModuleNotFoundError:
                missing.append(f"{path.name}:{line}: {module_name} has no {attribute}")
    assert not missing, missing
