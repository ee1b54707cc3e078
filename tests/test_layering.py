"""No import cycles between the modules of ``megatron_rlhf``.

Every ``import`` is read with ``ast``, at module level and inside functions alike: an import
moved into a function still ties the two modules together, it only hides the cycle until run
time. An import of a package (``from megatron_rlhf.distributed import destroy``) is an edge to
the package's ``__init__``; the parent packages a submodule import loads on the way are not.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "megatron_rlhf"


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
