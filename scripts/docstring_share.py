"""The docstring share of a package's lines (issue 43): lines inside module / class / function docstrings over
all lines, in total and per top-level folder.

    python scripts/docstring_share.py [src/fusedce]
"""
import ast
import sys
from pathlib import Path


def docstring_lines(source: str) -> int:
    """Lines of the module's, its classes' and its functions' docstrings."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                count += first.end_lineno - first.lineno + 1
    return count


def main(root: Path) -> None:
    per = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        folder = rel.parts[0] if len(rel.parts) > 1 else "(top)"
        source = path.read_text()
        doc, total = per.get(folder, (0, 0))
        per[folder] = (doc + docstring_lines(source), total + len(source.splitlines()))
    doc, total = (sum(v[i] for v in per.values()) for i in (0, 1))
    print(f"{root}: docstring lines {doc} / {total} = {100 * doc / total:.1f}%")
    for folder, (d, n) in sorted(per.items()):
        print(f"  {folder:14s} {d:5d} / {n:5d} = {100 * d / max(n, 1):.1f}%")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "src/fusedce"))
