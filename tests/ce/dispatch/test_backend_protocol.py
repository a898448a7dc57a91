"""The backend interface (``backends/protocol.py``): every backend package has the ``Backend`` names and
the same file names for the same jobs, and what it lacks (``Capabilities``) fails at the call, before any
work, with a ``RuntimeError`` naming the backend and the missing piece (CuTe: no ``method="tiled"``, no
entropy kernels)."""
from __future__ import annotations

import importlib
import typing
from pathlib import Path

import pytest
import torch

import fusedce
from fusedce import backends
from fusedce.backends.protocol import Backend, Capabilities

PACKAGES = {"torch": "fusedce.backends.pytorch", "triton": "fusedce.backends.triton", "cute": "fusedce.backends.cute"}
# job -> file: the same name in every backend that has the job
JOBS = {"cross_entropy.py", "custom_ops.py", "launch.py", "linear.py", "slices.py", "tuning.py", "__init__.py"}
OPTIONAL = {"tiled.py", "token_stats.py", "probs_targets.py", "probs_launch.py", "variants.py",
            "compile.py", "distill.py", "distill_launch.py", "distill_tiled.py", "probs_tiled.py", "fused_rows.py",
            "block_accum.py"}


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_package_has_the_backend_names(name):
    module = importlib.import_module(PACKAGES[name])
    assert module.NAME == name
    assert isinstance(module.CAPABILITIES, Capabilities)
    for attr in typing.get_type_hints(Backend):
        assert hasattr(module, attr), (name, attr)
    assert (module.TILED_CE is None) == (not module.CAPABILITIES.tiled)
    for method in ("loss", "grad_", "loss_and_grad_"):
        assert callable(getattr(module.CHUNK_CE, method))


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_same_file_names_for_the_same_jobs(name):
    folder = Path(importlib.import_module(PACKAGES[name]).__file__).parent
    files = {p.name for p in folder.glob("*.py")}
    assert files - JOBS - OPTIONAL == set()
    missing = JOBS - files
    assert missing == set(), missing


@pytest.fixture
def as_cute(monkeypatch):
    """``backend="cute"`` resolved on this CPU machine (the capability check comes after resolution)."""
    real = backends.resolve
    monkeypatch.setattr(backends, "resolve", lambda name, device: "cute" if name == "cute" else real(name, device))


def _linear(n=6, h=4, v=9):
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    return hidden, weight, torch.randint(0, v, (n,))


def test_cute_tiled_fails_at_the_call(as_cute):
    hidden, weight, target = _linear()
    before = (hidden.detach().clone(), weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"backend='cute' has no method='tiled'.*method='chunked'"):
        fusedce.linear_cross_entropy(hidden, weight, target, method="tiled", backend="cute")
    with pytest.raises(RuntimeError, match=r"backend='cute' has no method='tiled'"):
        fusedce.linear_token_log_probs(hidden, weight, target, method="tiled", backend="cute")
    assert torch.equal(hidden, before[0]) and torch.equal(weight, before[1]) and hidden.grad is None


def test_cute_entropy_fails_at_the_call(as_cute):
    logits, target = torch.randn(5, 7), torch.randint(0, 7, (5,))
    with pytest.raises(RuntimeError, match=r"backend='cute' has no entropy"):
        fusedce.token_log_probs(logits, target, backend="cute")
    hidden, weight, target = _linear()
    with pytest.raises(RuntimeError, match=r"backend='cute' has no entropy"):
        fusedce.linear_token_log_probs(hidden, weight, target, backend="cute", method="chunked")


@pytest.mark.parametrize("kwargs", [{}, {"tiled": True}, {"entropy": True}, {"slices": True}])
def test_full_backends_pass_every_check(kwargs):
    for name in ("torch", "triton"):
        assert backends.get(name, torch.device("cpu"), **kwargs).NAME == name
