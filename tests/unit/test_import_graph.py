"""No import cycle between the package's modules: every import counts, those inside functions
and under TYPE_CHECKING included (a cycle hidden in a function is still a cycle)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

Graph = dict[str, set[str]]


def _import_graph(package: str = "deepinfer_server", cache_dir: str | None = None) -> Graph:
    """Each module of `package` and the package's modules it imports."""
    # exclude_type_checking_imports=False: imports under TYPE_CHECKING are edges too; grimp
    # reads the whole module's syntax tree, so imports inside functions are edges as well.
    kwargs = {} if cache_dir is None else {"cache_dir": cache_dir}
    graph = grimp.build_graph(
        package, include_external_packages=False, exclude_type_checking_imports=False, **kwargs
    )
    return {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}


def _components(graph: Graph) -> Iterator[list[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is not None:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                elif successor in on_stack:
                    low[node] = min(low[node], index[successor])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                yield sorted(component)


def _cycle_through(graph: Graph, members: list[str]) -> list[str]:
    """One cycle through the component's first module, as the modules it passes."""
    inside = set(members)
    start = members[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for successor in sorted(graph[node] & inside):
                if successor == start:
                    return [*paths[node], start]
                if successor not in paths:
                    paths[successor] = [*paths[node], successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def cycles(graph: Graph) -> list[str]:
    """Each import cycle of `graph`, one per strongly connected component, as a readable chain
    (with the component's size when it holds more modules than the chain shown)."""
    found = []
    for members in _components(graph):
        if len(members) == 1 and members[0] not in graph[members[0]]:
            continue
        chain = " -> ".join(_cycle_through(graph, members))
        size = f" ({len(members)} modules in the circle)" if len(members) > 2 else ""
        found.append(chain + size)
    return found


def test_the_cycle_finder_finds_a_cycle_and_only_one() -> None:
    graph: Graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == ["a -> b -> c -> a (3 modules in the circle)", "e -> e"]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_and_under_type_checking_are_edges(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "hidden_cycle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f() -> None:\n    import hidden_cycle.b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import hidden_cycle.a\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = _import_graph("hidden_cycle", cache_dir=str(tmp_path / "cache"))
    assert cycles(graph) == ["hidden_cycle.a -> hidden_cycle.b -> hidden_cycle.a"]


def test_no_module_imports_itself_back() -> None:
    found = cycles(_import_graph())
    assert not found, "import cycles:\n" + "\n".join(found)
