"""The modules of ggufcarve.evaluate import each other without a circle (every import counted: top level, in functions, TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

import ggufcarve

PACKAGE = Path(ggufcarve.__file__).resolve().parent / "evaluate"


def _imports(path: Path) -> set[str]:
    """The ggufcarve.evaluate modules a file names in any import statement (read from its syntax tree)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "ggufcarve.evaluate":
                found.update(f"ggufcarve.evaluate.{alias.name}" for alias in node.names)
            elif node.module.startswith("ggufcarve.evaluate."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ggufcarve.evaluate."))
    return found


def test_evaluate_has_no_import_circle():
    graph = {f"ggufcarve.evaluate.{p.stem}": _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert {"ggufcarve.evaluate.protocol", "ggufcarve.evaluate.child", "ggufcarve.evaluate.run"} <= set(graph)
    assert "ggufcarve.evaluate.qa" in graph["ggufcarve.evaluate.child"]  # the scanner sees function-level imports
    state: dict[str, int] = {}  # 1 on the current path, 2 finished

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    bottom = graph["ggufcarve.evaluate.protocol"]
    assert bottom <= {"ggufcarve.evaluate.speed", "ggufcarve.evaluate.gate", "ggufcarve.evaluate.models"}, bottom
