"""Shared test setup for the cross-entropy suite.

``TRITON_INTERPRET=1`` is set here, at the very top, before anything can import ``triton``: the Triton
backend then runs its kernels in the interpreter on CPU tensors (the only way to test it without a GPU).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede every `import triton` (fusedce imports it lazily)

import re  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (import before any test patches torch.empty; see test_compile.py)

import interpreter_math  # noqa: E402

interpreter_math.install()   # the interpreter's exp / log correctly rounded on every CPU (interpreter_math.py)

# Every backend of the contract that can run on this machine's CPU tensors. "triton" runs under the
# interpreter; it is NOT skipped when its package is missing: that failure is real information.
BACKENDS = ("torch", "triton")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _seed(request):
    """A fixed seed per test id: each test sees its own random data, the same on every run / worker."""
    # the id as it was before the tests moved into folders (tests/<area>/test_x.py -> tests/test_x.py), so
    # every test keeps its own random data
    torch.manual_seed(zlib.crc32(re.sub(r"^tests/[^/]+/(test_[^/]+\.py::)", r"tests/\1", request.node.nodeid).encode()))
    yield


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    """Tests pick backends explicitly; a developer's $FUSEDCE_BACKEND must not leak into them."""
    monkeypatch.delenv("FUSEDCE_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
