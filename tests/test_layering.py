"""The package is layered: imports flow one way and no modules import each other in a circle.

An AST scan of every module under tandem/ (imports inside functions and under TYPE_CHECKING
count: a lazy import is still a dependency, it only moves the failure to run time). Layers,
lowest first:

    0  config, kernels, tree (DraftTree and its masks: flat records every floor reads)
    1  kv (cache buffers and the paged pool)
    2  models, quant (the W12 weight format and the INT8 head), parallel (a model over processes)
    3  the runner floor: runtime.runner (model step, graphs), timing, streaming, auto, pair (loading)
    4  verify (greedy walk, rejection sampling; VerifyResult)
    5  drafting (drafters propose trees and observe VerifyResult; the evolving tree cache)
    6  the loops and the engine: runtime (serial and async loops, workers, placement), engine
    7  entry points: the CLI, serve, bench, train, `tandem convert`, the package root

NOTE: the order differs from the issue's sketch (models -> kv -> runner -> drafting and tree ->
verify) in three places, all following the code as it is: tree (DraftTree and masks only, the
issue's "lowest floor") sits at the bottom because the hybrid Qwen3.5 model builds tree masks;
kv sits under models because that model owns a kv.cache and no kv module needs a model; verify
sits under drafting because every drafter's `observe` reads the verifier's VerifyResult (and
the sampled chain drafter warps its logits with the verifier's own sampling code), while verify
needs no drafter.
A module may import its own layer or any layer below; imports within a layer must still be free
of circles.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "tandem"

# the longest matching prefix decides a module's layer
LAYERS: dict[str, int] = {
    "tandem.config": 0,
    "tandem.kernels": 0,
    "tandem.tree": 0,
    "tandem.kv": 1,
    "tandem.models": 2,
    "tandem.quant": 2,
    "tandem.parallel": 2,
    "tandem.runtime.runner": 3,
    "tandem.runtime.timing": 3,
    "tandem.runtime.streaming": 3,
    "tandem.runtime.auto": 3,
    "tandem.runtime.pair": 3,
    "tandem.verify": 4,
    "tandem.drafting": 5,
    "tandem.runtime": 6,
    "tandem.engine": 6,
    "tandem": 7,  # the package root (lazy tandem.LLM) and __main__
    "tandem.cli": 7,
    "tandem.serve": 7,
    "tandem.bench": 7,
    "tandem.train": 7,
    "tandem.quant.convert": 7,  # `tandem convert`: loads the pair, writes a W12 folder
}


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported tandem module: line of the first such import}, lazy imports included.
    `from pkg import name` points at pkg.name when that is a module, else at pkg."""
    mods = _modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        edges = graph.setdefault(mod, {})
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x / from ..y import z
                    up = package[: len(package) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                target = resolve(name) if name.split(".")[0] == "tandem" else None
                if target and target != mod:
                    edges.setdefault(target, node.lineno)
    return graph


def _owner(mod: str) -> str:
    """The LAYERS entry deciding `mod`'s layer: its longest listed prefix."""
    return max((p for p in LAYERS if mod == p or mod.startswith(p + ".")), key=len)


def layer_of(mod: str) -> int:
    return LAYERS[_owner(mod)]


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _describe(comp: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(comp)
    lines = [f"import circle among {', '.join(comp)}:"]
    for m in comp:
        for t, line in sorted(graph[m].items()):
            if t in members:
                lines.append(f"    {m.replace('.', '/')}.py:{line} imports {t}")
    return "\n".join(lines)


def test_every_module_has_a_layer():
    # a new package or top-level module must be placed in LAYERS, not fall to the root's layer
    graph = import_graph()
    assert "tandem.runtime.generate" in graph and "tandem.engine.engine" in graph  # the scan found the package
    unplaced = sorted(m for m in graph if _owner(m) == "tandem" and m not in ("tandem", "tandem.__main__"))
    assert not unplaced, f"modules with no layer in tests/test_layering.py LAYERS: {', '.join(unplaced)}"


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "\n" + "\n".join(_describe(c, graph) for c in found)


def test_imports_flow_down_the_layers():
    graph = import_graph()
    bad = [f"{m.replace('.', '/')}.py:{line} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
           for m in sorted(graph) for t, line in sorted(graph[m].items()) if layer_of(t) > layer_of(m)]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_scan_sees_lazy_imports_and_circles(tmp_path):
    # a hand-built package: a lazy import inside a function closes a circle and climbs a layer
    pkg = tmp_path / "tandem"
    (pkg / "kv").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kv" / "__init__.py").write_text("")
    (pkg / "kv" / "a.py").write_text("from tandem.kv import b\n")
    (pkg / "kv" / "b.py").write_text("def f():\n    from tandem.kv.a import x\n    from tandem.engine import y\n")
    (pkg / "engine.py").write_text("")
    graph = import_graph(pkg)
    assert graph["tandem.kv.a"] == {"tandem.kv.b": 1}
    assert graph["tandem.kv.b"] == {"tandem.kv.a": 2, "tandem.engine": 3}
    assert cycles(graph) == [["tandem.kv.a", "tandem.kv.b"]]
    assert layer_of("tandem.engine") > layer_of("tandem.kv.b")
