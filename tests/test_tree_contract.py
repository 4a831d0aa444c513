"""The contracts the decode loop relies on: a one-way import graph, and draft trees whose scores
are acceptance probabilities and whose merges keep sampled children lossless."""
from __future__ import annotations

import ast
from pathlib import Path

import lyanna

PACKAGE = Path(lyanna.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """Module -> the lyanna modules it imports (function-level imports included), read with ast."""
    modules: dict[str, tuple[Path, bool]] = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (f, is_package)
    graph: dict[str, set[str]] = {}
    for name, (f, is_package) in modules.items():
        package = name if is_package else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:  # ``from pkg import module`` imports the module
                    if f"{source}.{a.name}" in modules:
                        edges.add(f"{source}.{a.name}")
                    elif source in modules:
                        edges.add(source)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_import_graph_sees_relative_and_lazy_imports():
    graph = import_graph()
    assert "lyanna.speculative" in graph["lyanna.decoding"]  # a top-level relative import
    assert "lyanna.training.pipeline" in graph["lyanna.train"]  # an import inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_the_package():
    assert find_cycle(import_graph()) is None
