"""No import cycles between the modules of ``megatron_rlhf``, and its packages in one order.

Every ``import`` is read with ``ast``, at module level and inside functions alike: an import
moved into a function still ties the two modules together, it only hides the cycle until run
time. An import of a package (``from megatron_rlhf.distributed import destroy``) is an edge to
the package's ``__init__``; the parent packages a submodule import loads on the way are not.

The same edges lifted to packages must follow :data:`LAYERS`: a package imports only packages
on lower lines, so the package graph has no cycle either. ``python tests/test_layering.py``
prints that graph, layer by layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_rlhf"

LAYERS = (
    ("utils", "megatron_rlhf"),
    ("runtime", "config", "distributed"),
    ("models", "data", "planning"),
    ("checkpoint", "rehearsal"),
    ("generation", "training"),
    ("reward",),
    ("ppo",),
    ("study", "planner"),
    ("demo",),
    ("cli",),
    ("__main__",),
)
"""The package order, bottom first; a package imports only packages on lower lines. A name is a
package or a top-level module of ``megatron_rlhf``; ``megatron_rlhf`` is its ``__init__`` (which
also serves ``kernels/`` as ``megatron_rlhf.kernels``). ``planning`` is the pure cost model that
training/ checks memory with, ``planner`` the planner's command-line tools that build models.
``runtime``: locks and process helpers; ``config``: the config-file loader."""


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def imported_modules(module: str, path: Path, modules: set[str]) -> dict[str, int]:
    """The package's modules that ``module`` imports, each with the line of its first import."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # a name inside a module: that module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.setdefault(name, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    files = module_files()
    return {module: imported_modules(module, path, set(files)) for module, path in files.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return sorted(found)


def describe(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    edges = [
        f"  {source} -> {target} (line {line})"
        for source in component
        for target, line in graph[source].items()
        if target in component
    ]
    return "\n".join([" <-> ".join(component), *edges])


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)


def test_the_graph_sees_every_import():
    graph = import_graph()
    report = graph["megatron_rlhf.study.report"]
    assert "megatron_rlhf.reward.plots" in report  # inside write_plots
    dist = graph["megatron_rlhf.checkpoint.dist"]
    assert {"megatron_rlhf.checkpoint.manifest", "megatron_rlhf.checkpoint.safe_pickle"} <= set(
        dist
    )
    assert cycles({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == [["a", "b", "c"]]


def unit_of(module: str) -> str:
    """The :data:`LAYERS` name ``module`` belongs to: the longest that is a prefix of it."""
    name = module.removeprefix(PACKAGE + ".") if module != PACKAGE else PACKAGE
    names = [unit for layer in LAYERS for unit in layer]
    matches = [u for u in names if name == u or name.startswith(u + ".")]
    return max(matches, key=len) if matches else name.split(".")[0]


def package_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """The module graph lifted to packages: ``{package: {imported package: first import}}``."""
    packages: dict[str, dict[str, str]] = {}
    for source, targets in graph.items():
        edges = packages.setdefault(unit_of(source), {})
        for target, line in targets.items():
            if unit_of(target) != unit_of(source):
                edges.setdefault(unit_of(target), f"{source}:{line} imports {target}")
    return packages


def upward_edges(packages: dict[str, dict[str, str]]) -> list[str]:
    """Every import of a package on the same or a higher line of :data:`LAYERS`."""
    layer = {unit: index for index, names in enumerate(LAYERS) for unit in names}
    return [
        f"{source} (layer {layer[source]}) -> {target} (layer {layer[target]}): {why}"
        for source, targets in sorted(packages.items())
        for target, why in sorted(targets.items())
        if source in layer and target in layer and layer[target] >= layer[source]
    ]


def test_every_package_has_a_place_in_the_order():
    declared = {unit for layer in LAYERS for unit in layer}
    assert len(declared) == sum(len(layer) for layer in LAYERS), "a name is on two lines"
    found = set(package_graph(import_graph()))
    assert not found - declared, (
        f"add {sorted(found - declared)} to LAYERS, on the lowest line above every package it "
        "imports"
    )
    assert not declared - found, f"{sorted(declared - found)} in LAYERS no longer exist"


def test_packages_import_only_lower_layers():
    packages = package_graph(import_graph())
    found = cycles(packages)
    assert not found, "package import cycles: " + "; ".join(" <-> ".join(c) for c in found)
    wrong = upward_edges(packages)
    assert not wrong, "imports against the package order (LAYERS):\n" + "\n".join(wrong)


def test_the_package_check_sees_a_cycle_and_an_upward_edge():
    graph = {
        "megatron_rlhf.utils": {},
        "megatron_rlhf.training.loop": {"megatron_rlhf.ppo.config": 12, "megatron_rlhf.utils": 3},
        "megatron_rlhf.ppo.config": {"megatron_rlhf.training.config": 8},
        "megatron_rlhf.training.config": {},
        "megatron_rlhf.planner.cli": {"megatron_rlhf.planning.memory": 5},
        "megatron_rlhf.planning.memory": {},
    }
    packages = package_graph(graph)
    assert packages["planner"] == {
        "planning": "megatron_rlhf.planner.cli:5 imports megatron_rlhf.planning.memory"
    }
    assert cycles(packages) == [["ppo", "training"]]
    assert upward_edges(packages) == [
        "training (layer 4) -> ppo (layer 6): "
        "megatron_rlhf.training.loop:12 imports megatron_rlhf.ppo.config"
    ]


def test_the_planner_cli_sits_above_training_and_planning_holds_no_tools():
    """The planner's tools build models and write a train-ppo config: they sit above training
    and ppo, in their own top-level package; ``planning`` (the pure cost model training/ checks
    memory with) is a bottom-layer package with no package of tools inside it."""
    layer = {unit: index for index, names in enumerate(LAYERS) for unit in names}
    assert layer["planner"] > max(layer["training"], layer["ppo"]), LAYERS
    assert layer["planning"] < layer["training"], LAYERS
    planning = REPO / PACKAGE / "planning"
    nested = [path.parent.name for path in planning.glob("*/__init__.py")]
    assert not nested, f"planning/ holds packages {nested}: tools go to {PACKAGE}/planner/"
    assert not [unit for unit in layer if unit.startswith("planning.")], LAYERS


@pytest.mark.launch  # launches Python
def test_config_schemas_import_without_torch():
    """A command's config (and the planner that writes a train-ppo config) loads in
    milliseconds: the schemas import neither torch nor megatron-core."""
    import subprocess
    import sys

    schemas = ["ppo.config", "reward.config", "training.config", "planner.cli"]
    code = "import sys\n" + "".join(f"import {PACKAGE}.{name}\n" for name in schemas)
    code += "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


if __name__ == "__main__":
    packages = package_graph(import_graph())
    for index, layer in enumerate(LAYERS):
        for unit in layer:
            print(f"{index} {unit:<15} -> {', '.join(sorted(packages.get(unit, {}))) or '-'}")
