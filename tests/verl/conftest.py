"""The verl plugin's tests. ``plugin``: its pieces (``fusedce.integrations.verl.*``) imported WITHOUT running
the package's ``__init__`` (which activates the plugin, and raises ImportError where verl is not installed):
the package is stood in for by a bare module with the same ``__path__``, so the submodules import as
usual; removed again after the test. The options start at their defaults."""
import importlib
import sys
import types
from pathlib import Path

import pytest

import fusedce.integrations

NAME = "fusedce.integrations.verl"
PIECES = ("options", "head", "functions", "tensor_parallel")


def _drop():
    return {k: sys.modules.pop(k) for k in list(sys.modules) if k == NAME or k.startswith(NAME + ".")}


@pytest.fixture
def plugin():
    saved = _drop()
    stub = types.ModuleType(NAME)
    stub.__path__ = [str(Path(fusedce.integrations.__file__).parent / "verl")]
    sys.modules[NAME] = stub
    try:
        found = types.SimpleNamespace(**{p: importlib.import_module(f"{NAME}.{p}") for p in PIECES})
        found.options.OPTIONS.clear()
        found.options.OPTIONS.update(found.options.DEFAULTS)
        yield found
    finally:
        _drop()
        sys.modules.update(saved)
