"""The package check of ``make check-package`` (run by CI): what the built wheel and sdist contain, and
the README's quickstart run from an installed wheel, outside the repository.

    python scripts/check_package.py contents dist/          # the project venv: the files in both archives
    python scripts/check_package.py quickstart README.md     # a fresh venv with the wheel installed

``quickstart`` runs the first ```python block under "## Quickstart" in README.md as it is written, with
the fusedce the running interpreter installed (it refuses a fusedce imported from a source checkout).
"""
from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

MAX_SDIST_BYTES = 5 * 2**20   # the sources, tests and docs are well under 1 MB; a cache or a result is not
WHEEL_NEEDS = ("fusedce/__init__.py", "fusedce/py.typed", "fusedce/backends/triton/kernels/row_math.py",
               "fusedce/tools/cli.py")
SDIST_NEEDS = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "MANIFEST.in", "src/fusedce/py.typed",
               "src/fusedce/__init__.py", "tests/conftest.py", "tests/support/reference64.py", "docs/conf.py")
NEVER = (".cache/", "results/", ".venv/", "dist/", "__pycache__/", ".pyc")


def _version(root: Path) -> str:
    text = (root / "src" / "fusedce" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def contents(dist: Path) -> list[str]:
    """The problems of the one wheel and one sdist in ``dist`` (empty: fine)."""
    problems = []
    version = _version(Path(__file__).resolve().parents[1])
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"want one wheel and one sdist in {dist}, found {[p.name for p in wheels + sdists]}"]
    if f"-{version}-" not in wheels[0].name or f"-{version}.tar.gz" not in sdists[0].name:
        problems.append(f"archives {wheels[0].name}, {sdists[0].name} are not version {version}")
    wheel = zipfile.ZipFile(wheels[0]).namelist()
    problems += [f"wheel lacks {name}" for name in WHEEL_NEEDS if name not in wheel]
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel):
        problems.append("wheel lacks the LICENSE")
    problems += [f"wheel holds {n}" for n in wheel if n.split("/")[0] not in ("fusedce",)
                 and ".dist-info/" not in n]
    with tarfile.open(sdists[0]) as tar:
        members = tar.getmembers()
    prefix = f"fusedce-{version}/"
    sdist = {m.name.removeprefix(prefix) for m in members}
    problems += [f"sdist lacks {name}" for name in SDIST_NEEDS if name not in sdist]
    problems += [f"sdist holds {n}" for n in sorted(sdist) if any(bad in n + "/" for bad in NEVER)]
    size = sum(m.size for m in members)
    if size > MAX_SDIST_BYTES:
        problems.append(f"sdist unpacks to {size / 2**20:.1f} MiB (> {MAX_SDIST_BYTES / 2**20:.0f} MiB)")
    print(f"{wheels[0].name}: {len(wheel)} files; {sdists[0].name}: {len(sdist)} files, "
          f"{size / 2**20:.2f} MiB unpacked")
    return problems


def quickstart_code(readme: Path) -> str:
    """The first ```python block under the README's "## Quickstart" heading."""
    text = readme.read_text()
    section = text.split("\n## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def quickstart(readme: Path) -> list[str]:
    import fusedce
    where = Path(fusedce.__file__).resolve()
    if Path(sys.prefix).resolve() not in where.parents:
        return [f"fusedce was imported from {where}, not from this environment ({sys.prefix})"]
    from importlib.metadata import version
    problems = []
    if version("fusedce") != fusedce.__version__:
        problems.append(f"installed metadata {version('fusedce')} != fusedce.__version__ {fusedce.__version__}")
    cli = subprocess.run([str(Path(sys.executable).parent / "fusedce"), "--version"], capture_output=True,
                         text=True)
    if cli.returncode != 0 or cli.stdout.strip() != f"fusedce {fusedce.__version__}":
        problems.append(f"`fusedce --version` gave {cli.returncode}: {cli.stdout!r} {cli.stderr!r}")
    code = quickstart_code(readme)
    exec(compile(code, f"{readme}:Quickstart", "exec"), {"__name__": "__quickstart__"})
    print(f"quickstart ran ({len(code.splitlines())} lines) with fusedce {fusedce.__version__} from {where.parent}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("contents", "quickstart"):
        print(__doc__)
        return 2
    problems = contents(Path(argv[1])) if argv[0] == "contents" else quickstart(Path(argv[1]).resolve())
    for problem in problems:
        print(f"package check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
