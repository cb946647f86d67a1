"""No module of ggufcarve imports a module that imports it back.

The graph is read from the source with `ast`: every `import` and `from ... import` statement at
any depth (inside functions, `if TYPE_CHECKING:` blocks and `try` blocks too), absolute and
relative. `from P import N` is an edge to the module P.N when that file exists, else to P.
Only modules of the package itself are nodes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "ggufcarve"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `root` (a package directory)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a module a.b.c, or a name in it
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path (first module repeated last) through each strongly connected component of
    more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return [closed_path(graph, component) for component in components]


def closed_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    first = min(component)
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    return sorted(component)


def packages(root: Path) -> list[str]:
    """The subpackages of `root`, and "" for its top-level modules."""
    return ["", *sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file())]


def in_package(module: str, package: str) -> bool:
    """Whether `module` (a dotted name under ROOT) belongs to the subpackage `package` ("": top level)."""
    parts = module.split(".")
    return (parts[1] if len(parts) > 1 and (ROOT / parts[1] / "__init__.py").is_file() else "") == package


GRAPH = import_graph(ROOT)
CYCLES = cycles(GRAPH)


@pytest.mark.parametrize("package", packages(ROOT))
def test_no_import_cycle_touches_the_package(package):
    found = [c for c in CYCLES if any(in_package(m, package) for m in c)]
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_every_module_is_in_one_case():
    cases = packages(ROOT)
    assert all(sum(in_package(m, p) for p in cases) == 1 for m in GRAPH), [
        m for m in GRAPH if sum(in_package(m, p) for p in cases) != 1
    ]


def test_the_graph_sees_imports_inside_functions_and_relative_ones(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n")
    (package / "sub" / "c.py").write_text("from .. import a\nimport os\n")
    (package / "d.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph == {
        "pkg": set(),
        "pkg.sub": set(),
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub.b": {"pkg.sub.c"},
        "pkg.sub.c": {"pkg.a"},
        "pkg.d": {"pkg.a"},
    }
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]]
