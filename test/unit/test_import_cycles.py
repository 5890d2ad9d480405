"""srt's import graph, built from the source with every import counted (module-level, function-local and
`TYPE_CHECKING` alike), has no cycles but the ones still listed below, each to be broken; the list only
shrinks: a new cycle fails, and so does a listed one that is gone (delete its line)."""

from __future__ import annotations

import grimp

# Cycles not yet broken, each a set of modules importing each other.
KNOWN_CYCLES = [
    # quantization drives the runner's pools: it should be a pure weight transform
    {"srt.model_executor.model_runner", "srt.model_executor.quantization"},
    # the kernels' start-up probe compares with int8_linear's PyTorch reference, which dispatches to them
    {"srt.model_executor.layers.cpu_kernels", "srt.model_executor.layers.int8_linear"},
]


def import_cycles(package: str) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return cycles


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyc import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyc import a\n")
    (pkg / "d.py").write_text("from cyc import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cyc") == [{"cyc.a", "cyc.b", "cyc.c"}]


def test_srt_has_no_import_cycles_but_the_known_ones():
    found = import_cycles("srt")
    new = [c for c in found if c not in KNOWN_CYCLES]
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not new, f"new import cycles: {new}"
    assert not gone, f"cycles broken (delete them from KNOWN_CYCLES): {gone}"
