"""Every ```python block of README.md and docs/*.md runs as written (issue 47 item 7), each in a fresh
namespace in a temporary working directory, so that a snippet that names something it never defines, or
an API that changed, fails here rather than for a reader.

Markers: HTML comment lines right above a fence (invisible once rendered) say how a block is run:

- ``<!-- snippet: continues -->``: it reads names of the python block above it in the same file and runs
  after it, in its namespace (the whole chain is one test, named after its first block);
- ``<!-- snippet: needs MODULE ... -->``: skipped unless each module imports (the optional extras);
- ``<!-- snippet: skip REASON -->``: not run (only compiled), for a block that needs what a test cannot
  have: a GPU, a multi-process launcher (``torchrun``), a network download; the reason is the skip's
  message;
- ``<!-- snippet: signatures -->``: a list of call signatures (``name(params) -> result``, ``.method(params)``
  below a class), each compared with ``inspect.signature`` of the real ``fusedce`` object: the same
  parameters, in order, of the same kinds, with equal defaults.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import fusedce

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>\w+)\s*(?P<arg>.*?)\s*-->\s*$")


def _blocks(path: Path):
    """``(line, code, markers)`` of each ```python block of ``path``: its first line (1-based), its text
    with the fence's indentation removed, ``{kind: argument}`` of the marker lines right above it."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        markers, j = {}, i - 1
        while j >= 0 and MARKER.match(lines[j]):
            m = MARKER.match(lines[j])
            markers[m["kind"]] = m["arg"]
            j -= 1
        indent, start, i = fence["indent"], i + 1, i + 1
        while not lines[i].strip().startswith("```"):
            i += 1
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[start:i])
        blocks.append((start, code + "\n", markers))
        i += 1
    return blocks


def _chains():
    """One pytest param per chain of blocks (a block and the ``continues`` blocks after it)."""
    params = []
    for path in FILES:
        chain = []
        for block in _blocks(path):
            if "continues" in block[2] and chain:
                chain.append(block)
                continue
            if chain:
                params.append(pytest.param(path, chain, id=f"{path.name}:{chain[0][0]}"))
            chain = [block]
        if chain:
            params.append(pytest.param(path, chain, id=f"{path.name}:{chain[0][0]}"))
    return params


def _signature_entries(code: str):
    """``(owner, name, params)`` per signature of a ``signatures`` block: ``owner`` the class a
    ``.method(...)`` line belongs to (else None); ``params`` the text between the parentheses."""
    entries, current = [], None
    for line in code.splitlines():
        if re.match(r"^[A-Za-z_]\w*\(", line) or re.match(r"^\s+\.\w+\(", line):
            current = [line.strip()]
            entries.append(current)
        elif current is not None:
            current.append(line.strip())
    out, owner = [], None
    for entry in entries:
        text = " ".join(entry)
        name, rest = text.split("(", 1)
        depth, end = 1, 0
        for end, char in enumerate(rest):   # noqa: B007 (the last end is read after the loop)
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        params = rest[:end]
        if name.startswith("."):
            out.append((owner, name[1:], params))
        else:
            owner = name
            out.append((None, name, params))
    return out


def _described(params: str) -> list:
    namespace = {"torch": torch}
    exec(f"def _f({params}): pass", namespace)   # noqa: S102 (the docs' own text)
    return [(p.name, p.kind, p.default) for p in inspect.signature(namespace["_f"]).parameters.values()]


def _actual(owner, name) -> list:
    obj = getattr(getattr(fusedce, owner), name) if owner else getattr(fusedce, name)
    params = list(inspect.signature(obj).parameters.values())
    if owner:
        params = params[1:]   # self
    return [(p.name, p.kind, p.default) for p in params]


def _check_signatures(code: str) -> None:
    entries = _signature_entries(code)
    assert entries, "a signatures block without a signature"
    for owner, name, params in entries:
        where = f"{owner}.{name}" if owner else name
        assert _described(params) == _actual(owner, name), f"{where}: the docs' signature is not the code's"


@pytest.mark.parametrize("path,chain", _chains())
def test_snippet_runs_as_written(path, chain, tmp_path, monkeypatch):
    for line, code, markers in chain:
        if "skip" in markers:   # not run, but it must at least be Python
            compile(code, f"{path.name}:{line}", "exec")
            pytest.skip(markers["skip"] or "marked skip")
        for module in markers.get("needs", "").split():
            pytest.importorskip(module)
    if "signatures" in chain[0][2]:
        for _, code, _ in chain:
            _check_signatures(code)
        return
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {"__name__": "__snippet__"}
    for line, code, _ in chain:
        exec(compile(code, f"{path.name}:{line}", "exec"), namespace)   # noqa: S102


def test_markers_are_known():
    """A misspelt marker would silently run (or not skip) a block."""
    for path in FILES:
        for line, _, markers in _blocks(path):
            assert set(markers) <= {"continues", "needs", "skip", "signatures"}, (path.name, line, markers)
