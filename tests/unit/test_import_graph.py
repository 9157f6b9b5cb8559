"""The library's house has no cycles: no module of `rayhpc` imports, at any depth and from inside a function
too, a module that imports it back (the entry points, `rayhpc.entry.run_main` and the modules run with
`python -m`, sit above what they start)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "platform"


def module_imports() -> dict[str, set[str]]:
    """Every rayhpc module -> the rayhpc modules it imports (`from pkg import sub` is the submodule)."""
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "rayhpc").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{a.name}" for a in node.names} & files.keys()
                found |= subs | ({node.module} if len(subs) < len(node.names) else set())
        graph[name] = {_owner(t, files) for t in found if t.startswith("rayhpc")} - {name, None}
    return graph


def _owner(target: str, files) -> str | None:
    while target and target not in files:
        target = target.rpartition(".")[0]
    return target or None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other (strongly connected, more than one module)."""
    index, low, stack, out = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    graph = module_imports()
    assert len(graph) > 100 and "rayhpc.cluster" in graph["rayhpc.entry"]  # the graph is read, not empty
    assert cycles(graph) == []


@pytest.mark.parametrize("edges, expected", [({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
                                             ({"a": {"b"}, "b": {"c"}, "c": set()}, [])])
def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle(edges, expected):
    assert cycles(edges) == expected
