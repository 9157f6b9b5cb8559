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


def folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph over the package's rooms: each folder (`rayhpc.tune`) and each module at its top
    (`rayhpc.cli`), with an edge where some module of one imports one of another."""
    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {room(m): set() for m in graph}
    for module, targets in graph.items():
        rooms[room(module)] |= {room(t) for t in targets} - {room(module)}
    return rooms


def test_no_folder_imports_one_that_imports_it_back():
    """The rooms stack: no import runs from a lower one to a higher one, so a reader finds a feature's
    dependencies below it (`rayhpc.train` under `rayhpc.tune`, `rayhpc.engine` under both)."""
    rooms = folders(module_imports())
    assert {"rayhpc.tune", "rayhpc.train", "rayhpc.engine"} <= rooms["rayhpc.tune"] | {"rayhpc.tune"}
    assert cycles(rooms) == []


def test_the_folder_graph_joins_a_folders_modules():
    assert folders({"rayhpc.a.x": {"rayhpc.b.y"}, "rayhpc.b.y": {"rayhpc.a.z"}, "rayhpc.a.z": set()}) == {
        "rayhpc.a": {"rayhpc.b"}, "rayhpc.b": {"rayhpc.a"}}


@pytest.mark.parametrize("edges, expected", [({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
                                             ({"a": {"b"}, "b": {"c"}, "c": set()}, [])])
def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle(edges, expected):
    assert cycles(edges) == expected


def test_the_engine_imports_no_ray():
    """The engine is plain PyTorch: the adapters that hand its checkpoints and reports to Ray Train and Tune
    live in `rayhpc.train` and `rayhpc.tune`."""
    found = {}
    for path in (ROOT / "rayhpc" / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found.update({f"{path.name}: {n}": 1 for n in names if n.split(".")[0] == "ray"})
    assert list(found) == []
