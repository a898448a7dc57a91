"""The package's layers (docs/architecture.md, "Layers"): every import arrow inside ``src/fusedce`` points down
or sideways, never up; no two modules import each other, directly or around a circle; and only the
tools package (``fusedce.tools``) imports the tools (bench, inspect, finetune, the command line).

The graph is read from the source (every ``import`` statement, module-level or inside a function: a
lazy import is an arrow too), not from ``sys.modules``, so it covers code paths no test runs.
"""
from __future__ import annotations

import ast
from pathlib import Path

import fusedce

SRC = Path(fusedce.__file__).resolve().parent

# (module prefix, layer): a module may import only modules of its layer or below. Longest prefix wins.
LAYERS = [
    ("fusedce.core.options", 0),       # LossOptions, scalar checks, signature helper
    ("fusedce.core.types", 0),         # result types
    ("fusedce.core.autograd_checks", 0),
    ("fusedce.core.transforms", 0),    # forward-AD / tracing predicates (torch only)
    ("fusedce.core.opaque", 0),        # custom ops that plain eager calls bypass (torch only)
    ("fusedce.core.bf16_products", 0), # fp32 GEMMs of bf16 values on the CPU bf16 units (torch only)
    ("fusedce.core.hints", 0),         # the likely-mistake hints of the shape errors (imports nothing of fusedce)
    ("fusedce.core.row_math", 1),      # the reference row formulas (PyTorch)
    ("fusedce.core.validation", 1),    # tensor checks
    ("fusedce.core.reduction", 1),
    ("fusedce.core.rows", 1),
    ("fusedce.core.autocast", 1),
    ("fusedce.core.dtensor", 1),
    ("fusedce.core.entrance", 2),      # the one entrance of every public op (autocast + DTensor + signature)
    ("fusedce.core", 2),               # the package's docstring
    ("fusedce.backends.protocol", 3),  # the backend interface
    ("fusedce.backends.op_autograd", 3),
    ("fusedce.backends.layout", 3),    # unit-stride / contiguous inputs of the kernel backends' custom ops
    ("fusedce.backends.pytorch", 4),
    ("fusedce.backends.triton", 4),
    ("fusedce.backends.cute", 4),
    ("fusedce.backends", 5),           # selection (imports the backend packages)
    ("fusedce.lm_head", 6),            # the machinery the linear families share (chunk loop, heads, method)
    ("fusedce.ce", 7),                 # cross-entropy: logits, linear, soft targets, modules
    ("fusedce.rl", 7),                 # RL log-probs and entropy, the K-class op
    ("fusedce.distill", 8),            # distillation (the top-k teacher composes the K-class op)
    ("fusedce.distributed", 8),        # vocabulary-parallel ops over torch.distributed
    ("fusedce.nn", 9),                 # torch drop-ins
    ("fusedce.integrations", 10),      # Hugging Face, TRL
    ("fusedce", 11),                   # __init__: the public names
    ("fusedce.tools", 12),             # the command and its tools: import the library, never the reverse
]
TOOLS = ("fusedce.tools",)


def _modules() -> dict:
    """dotted name -> path of every module of the package."""
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path) -> set:
    """The package's modules that ``module`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:   # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _matches(module: str, prefix: str) -> bool:
    """``prefix`` covers ``module`` (the bare ``fusedce`` entry is ``__init__.py`` alone)."""
    return module == prefix or (prefix != "fusedce" and module.startswith(prefix + "."))


def layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if _matches(module, p)), key=len)
    return dict(LAYERS)[best]


def test_every_module_has_a_layer():
    """A new module must be placed in ``LAYERS`` (its arrows are then checked)."""
    assert all(m == "fusedce" or m.startswith("fusedce.") for m in MODULES)
    assert {m for m in MODULES if not any(_matches(m, p) for p, _ in LAYERS)} == set()


def test_no_upward_arrow():
    up = sorted(f"{a} (layer {layer(a)}) -> {b} (layer {layer(b)})"
                for a, targets in GRAPH.items() for b in targets if layer(b) > layer(a))
    assert up == []


def test_no_circle():
    """No strongly connected component of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


def test_only_the_tools_import_the_tools():
    outside = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                     if b.startswith(TOOLS) and not a.startswith(TOOLS))
    assert outside == []
    assert {m for m in MODULES if m.split(".")[1:2] in (["bench"], ["inspect"], ["finetune"], ["cli"])} == set()


def test_the_graph_is_read():
    """The checks above see real arrows (a sanity check of the parser, from known imports)."""
    assert "fusedce.ce.linear_function" in GRAPH["fusedce.ce.functional"]
    assert "fusedce.backends.protocol" in GRAPH["fusedce.lm_head.head"]
    assert "fusedce.core.row_math" in GRAPH["fusedce.backends.pytorch.tiled"]
    assert "fusedce.tools.bench.harness" in GRAPH["fusedce.tools.bench.command"]   # a lazy import


def _part(module: str) -> str:
    """The top-level part a module belongs to: ``fusedce`` (``__init__``), a top-level module, or a folder."""
    parts = module.split(".")
    return "fusedce" if len(parts) == 1 else parts[1]


def _outside_parts() -> dict:
    """``benchmarks`` and ``scripts`` as parts: the package's parts each imports (any ``fusedce...`` import)."""
    root = SRC.parent.parent
    out = {}
    for folder in ("benchmarks", "scripts"):
        found = set()
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                for name in names:
                    if name == "fusedce" or name.startswith("fusedce."):
                        found.add(_part(name) if name.count(".") else "fusedce")
        out[folder] = found
    return out


def part_pairs() -> set:
    """Unordered pairs of parts tied by at least one import (issue 26's count)."""
    pairs = {frozenset((_part(a), _part(b))) for a, targets in GRAPH.items() for b in targets if _part(a) != _part(b)}
    for folder, found in _outside_parts().items():
        pairs |= {frozenset((folder, p)) for p in found}
    return pairs


def test_the_top_level_shows_the_families():
    """At most 3 modules beside ``__init__.py`` at the top of ``src/fusedce`` (the rest are folders, one per
    family or shared layer), and at most 55 pairs of parts tied by an import (parts: each top-level module,
    each top-level folder, ``benchmarks/`` and ``scripts/``; 79 before the family folders)."""
    top = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 3, top
    pairs = part_pairs()
    assert len(pairs) <= 55, sorted(tuple(sorted(p)) for p in pairs)
