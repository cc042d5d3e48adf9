"""The import graph of the project's own code: no cycle anywhere in `kvjax/`, `kvjax/models/` and `kvjax/experiments/`.

An import inside a function is an edge like any other: it only postpones the cycle to the first call, it does
not remove the dependency. `kvjax/` never imports `kvjax/models/` or `kvjax/experiments/` (`tests/test_contract.py`,
`test_kvjax_never_imports_models_or_experiments`)."""

from __future__ import annotations

import ast
import itertools
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvjax", "benchmarks")  # the library, its models and suites (kvjax.models, kvjax.experiments), benchmarks


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules one import statement of `module` loads by name: `import a.b` -> `a.b`; `from a import
    b` -> `a.b` when that is a module, else `a` (a name defined there). The packages above them, whose
    `__init__` runs too, are not edges (Python has them in `sys.modules` before their submodules)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & modules
    if node.level:  # relative: from the module's own package, `level - 1` packages up
        parts = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    found = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    if len(found) < len(node.names):  # some names are not modules: they come from `base` itself
        found.add(base)
    return found & modules


def import_graph() -> dict[str, dict[str, int]]:
    """`{module: {imported module: line of its first import}}` over every module of `PACKAGES`, every import
    statement counted, those inside functions, classes and `if` blocks included."""
    paths = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    modules = set(paths)
    graph = {}
    for mod, path in paths.items():
        edges = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for dep in imported(node, mod, path.name == "__init__.py", modules) - {mod}:
                    edges[dep] = min(edges.get(dep, node.lineno), node.lineno)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of more than one module (Tarjan's
    components, then a breadth-first search from the component's first module back to itself)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):  # Tarjan, recursive: the graph is a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        start = min(component)
        parent, queue = {start: None}, deque([start])
        while queue:
            v = queue.popleft()
            if start in graph[v]:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                found.append(path[::-1] + [start])
                break
            for w in sorted(graph[v]):
                if w in component and w not in parent:
                    parent[w] = v
                    queue.append(w)
    return sorted(found)


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)) + f" -> {cycle[-1]}"


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    """The finder itself: a function-level import closes a cycle, and each component is reported once."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 9}, "d": {"a": 1}, "e": {"f": 1}, "f": {"e": 3}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert describe(["a", "b", "c", "a"], graph) == "a (line 1) -> b (line 2) -> c (line 9) -> a"
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    tree = ast.parse("def f():\n    from kvjax.policies import compose, base\n    from . import plan\n")
    froms = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules = {"kvjax.policies", "kvjax.policies.compose", "kvjax.policies.base", "kvjax.policies.plan"}
    assert imported(froms[0], "kvjax.policies.quantized", False, modules) == {"kvjax.policies.compose",
                                                                             "kvjax.policies.base"}
    assert imported(froms[1], "kvjax.policies.quantized", False, modules) == {"kvjax.policies.plan"}


def test_no_import_cycle_in_kvjax_models_or_experiments():
    """No module of `kvjax/`, `kvjax/models/` or `kvjax/experiments/` reaches itself through imports, those inside
    functions included (the suites build on `driver`, which builds on `records`; `kvjax.policies.compose` on
    `plan` on `quantized`; never the reverse)."""
    graph = import_graph()
    assert {"kvjax.policies.compose", "kvjax.models.llama", "kvjax.experiments.driver"} <= set(graph)  # the walk saw all three
    assert "kvjax.policies.plan" in graph["kvjax.policies.compose"]
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(describe(c, graph) for c in found)
