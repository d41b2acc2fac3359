"""The import graph of src/fmha: the core never imports the tools, and nothing imports in a cycle.

Every import counts, at module level or inside a function: a function-level import still ties the
two modules together.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "fmha"
TOOLS = ("fmha.tools", "fmha.__main__")  # the command and its `python -m fmha` entry


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The fmha modules ``path`` imports (``from x import y`` counts y when it is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "fmha.api" in graph and "fmha.tools.cli" in graph
    assert "fmha.dispatch" in graph["fmha.api"]
    assert "fmha.backends.triton.masking" in graph["fmha.backends.triton.forward"]


def test_the_core_never_imports_the_tools():
    offending = {(module, target) for module, targets in import_graph().items()
                 if not module.startswith(TOOLS) for target in targets if target.startswith(TOOLS)}
    assert not offending, f"core modules import the tools: {sorted(offending)}"


def test_there_are_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module):
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)

