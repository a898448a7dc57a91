"""The package's layers (README, "Architecture"): every import arrow inside ``src/fusedce`` points down
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
    ("fusedce.options", 0),            # LossOptions, scalar checks, signature helper
    ("fusedce.types", 0),              # result types
    ("fusedce.autograd_checks", 0),
    ("fusedce.row_math", 1),           # the reference row formulas (PyTorch)
    ("fusedce.validation", 1),         # tensor checks
    ("fusedce.reduction", 1),
    ("fusedce.autocast", 1),
    ("fusedce.dtensor", 1),
    ("fusedce.backends.protocol", 2),  # the backend interface
    ("fusedce.backends.op_autograd", 2),
    ("fusedce.backends.layout", 2),    # unit-stride / contiguous inputs of the kernel backends' custom ops
    ("fusedce.backends.pytorch", 3),
    ("fusedce.backends.triton", 3),
    ("fusedce.backends.cute", 3),
    ("fusedce.backends", 4),           # selection (imports the backend packages)
    ("fusedce.lm_head", 5),            # the LM head fused with the loss
    ("fusedce.functional", 6),
    ("fusedce.log_probs", 6),
    ("fusedce.log_probs_multi", 6),
    ("fusedce.soft_targets", 6),
    ("fusedce.distillation_topk", 6),
    ("fusedce.distill_checks", 6),
    ("fusedce.distillation", 6),
    ("fusedce.integrations.distributed", 7),
    ("fusedce.distributed", 8),
    ("fusedce.modules", 8),
    ("fusedce.nn", 8),
    ("fusedce.integrations", 9),       # Hugging Face, TRL
    ("fusedce", 10),                   # __init__: the public names
    ("fusedce.tools", 11),             # the command and its tools: import the library, never the reverse
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
    assert "fusedce.lm_head.function" in GRAPH["fusedce.functional"] or "fusedce.lm_head" in GRAPH["fusedce.functional"]
    assert "fusedce.backends.protocol" in GRAPH["fusedce.lm_head.heads"]
    assert "fusedce.row_math" in GRAPH["fusedce.backends.pytorch.tiled"]
    assert "fusedce.tools.bench.harness" in GRAPH["fusedce.tools.bench.command"]   # a lazy import
