"""backend="cute" selection on a machine without CUDA, and the rule that "auto" never picks it."""
import subprocess
import sys

import pytest
import torch

import fusedce
from fusedce import backends


def test_cute_on_cpu_raises_naming_cuda():
    x, t = torch.randn(4, 10), torch.randint(0, 10, (4,))
    with pytest.raises(RuntimeError, match="cute.*CUDA tensors"):
        fusedce.cross_entropy(x, t, backend="cute")
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        fusedce.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), t, backend="cute")


def test_cute_is_a_valid_name():
    backends.check_name("cute")          # no ValueError / RuntimeError at module construction
    fusedce.CrossEntropyLoss(backend="cute")


def test_cute_without_extra_names_the_extra(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"fusedce\[cute\]"):
        backends.resolve("cute", torch.device("cpu"))


def test_auto_never_picks_cute():
    from fusedce.backends.cute import tuning
    assert tuning.AUTO_PICKS_CUTE is False and tuning.VERIFIED_ON_GPU is None
    assert backends.resolve("auto", torch.device("cuda")) == "triton"
    assert backends.resolve("auto", torch.device("cpu")) == "torch"


def test_library_import_does_not_import_cutlass():
    code = ("import sys, fusedce, fusedce.backends.cute, fusedce.backends.cute.variants, "
            "fusedce.backends.cute.tuning; sys.exit(1 if 'cutlass' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
