"""Shared test setup for the cross-entropy suite.

Without CUDA, ``TRITON_INTERPRET=1`` is set here, at the very top, before anything can import ``triton``:
the Triton backend then runs its kernels in the interpreter on CPU tensors (the only way to test it
without a GPU). With CUDA (the lent GPU machine: ``tests/cute/test_cute_gpu.py`` compares backend="cute"
with the compiled Triton kernels) the environment's own ``TRITON_INTERPRET`` is kept; the CPU-tensor
tests of backend="triton" then need ``TRITON_INTERPRET=1`` given by hand.
"""
import os
import re
import zlib

# OpenMP threads that wait for work sleep instead of spinning: the suite runs 2 workers (and their rank and bench
# processes) on 2 cores, where spinning threads starve the busy ones (small CPU ops were ~2x slower with two
# other busy processes; no slower alone). Read by the OpenMP runtime when torch loads it: the xdist workers and
# every Python the tests start inherit it from here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():   # torch imports no triton; this must precede every `import triton`
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the Pythons the tests start install interpreter_speed too (support/subprocess_site/sitecustomize.py)
_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "subprocess_site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (import before any test patches torch.empty; see test_compile.py)

import interpreter_index  # noqa: E402
import interpreter_math  # noqa: E402
import interpreter_speed  # noqa: E402

interpreter_math.install()   # the interpreter's exp / log correctly rounded on every CPU (interpreter_math.py)
interpreter_index.install()  # Triton < 3.7 with numpy >= 2.4: a tensor loop bound (interpreter_index.py)
interpreter_speed.install()  # two per-call costs of the interpreter cached, results unchanged (interpreter_speed.py)

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
    if INTERPRET:   # a test that changed it gets it back
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo process group for the vocabulary-parallel ops (made unless one exists; destroyed
    after the module if made here)."""
    import torch.distributed as dist
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    import schedule
    schedule.slow_first(items)
