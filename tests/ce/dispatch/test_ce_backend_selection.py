"""Backend selection (ARCHITECTURE.md): backend=None reads $FUSEDCE_BACKEND (default "auto"); "auto" is
"torch" on CPU tensors; "triton" on CPU needs TRITON_INTERPRET=1, else RuntimeError; unknown names
raise ValueError listing the valid ones. Which backend ran is observed with a spy on its
``cross_entropy_rows`` (the interface ce/functional.py calls)."""
import importlib

import pytest
import torch

import fusedce
from inputs import bit_identical, call, make_logits, make_target

MODULES = {"torch": "fusedce.backends.pytorch", "triton": "fusedce.backends.triton"}


@pytest.fixture
def spies(monkeypatch):
    """Wrap each importable backend's cross_entropy_rows; returns {name: list of calls}."""
    calls = {}
    for name, module_name in MODULES.items():
        module = importlib.import_module(module_name)  # triton: fails until the package exists
        original = module.cross_entropy_rows
        calls[name] = []

        def spy(*args, __name=name, __original=original, **kwargs):
            calls[__name].append(1)
            return __original(*args, **kwargs)

        monkeypatch.setattr(module, "cross_entropy_rows", spy)
    return calls


def _run(**kw):
    x = make_logits((4, 50), torch.float32)
    t = make_target((4,), 50)
    return fusedce.cross_entropy(x, t, **kw)


@pytest.mark.parametrize("env, arg, expected", [
    (None, None, "torch"),            # default: auto -> torch on CPU
    ("auto", None, "torch"),
    ("torch", None, "torch"),
    ("triton", None, "triton"),       # env read when backend=None (TRITON_INTERPRET=1 in the tests)
    ("triton", "torch", "torch"),     # an explicit argument wins over the environment
    ("torch", "triton", "triton"),
    (None, "auto", "torch"),
    ("", None, "torch"),              # an empty $FUSEDCE_BACKEND means auto
    ("", "triton", "triton"),
])
def test_selection(spies, monkeypatch, env, arg, expected):
    if env is not None:
        monkeypatch.setenv("FUSEDCE_BACKEND", env)
    _run(backend=arg)
    assert {k: len(v) for k, v in spies.items()} == {n: int(n == expected) for n in MODULES}


def test_env_read_at_call_time(spies, monkeypatch):
    monkeypatch.setenv("FUSEDCE_BACKEND", "torch")
    _run()
    monkeypatch.setenv("FUSEDCE_BACKEND", "triton")
    _run()
    assert (len(spies["torch"]), len(spies["triton"])) == (1, 1)


def _assert_lists_valid_names(msg):
    for name in ("auto", "torch", "triton"):
        assert name in msg, f"the error should list the valid backends: {msg}"


@pytest.mark.parametrize("name", ["bogus", "Triton", "cuda", ""])
def test_unknown_backend_argument(name):
    x = make_logits((4, 50), torch.float32)
    before = x.detach().clone()
    with pytest.raises(ValueError) as info:
        call(x, make_target((4,), 50), backend=name, inplace_backward=True)
    _assert_lists_valid_names(str(info.value))
    assert bit_identical(x.detach(), before)


def test_unknown_backend_env(monkeypatch):
    monkeypatch.setenv("FUSEDCE_BACKEND", "bogus")
    with pytest.raises(ValueError) as info:
        _run()
    _assert_lists_valid_names(str(info.value))
    with pytest.raises(ValueError):
        fusedce.CrossEntropyLoss()(make_logits((4, 50), torch.float32), make_target((4,), 50))


@pytest.mark.parametrize("value", [None, "0", ""], ids=["unset", "0", "empty"])
@pytest.mark.parametrize("via", ["argument", "env"])
def test_triton_on_cpu_without_interpreter(monkeypatch, via, value):
    """backend="triton" with CPU tensors and no TRITON_INTERPRET: RuntimeError saying so, nothing run."""
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    kw = {"backend": "triton"}
    if via == "env":
        monkeypatch.setenv("FUSEDCE_BACKEND", "triton")
        kw = {}
    x = make_logits((4, 50), torch.float32)
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fusedce.cross_entropy(x, make_target((4,), 50), inplace_backward=True, **kw)
    assert bit_identical(x.detach(), before)


def test_auto_on_cpu_without_interpreter_is_torch(spies, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _run(backend="auto")
    assert (len(spies["torch"]), len(spies["triton"])) == (1, 0)


def test_empty_env_is_auto_for_every_entry_point(spies, monkeypatch):
    """FUSEDCE_BACKEND="" is "auto" (not an unknown name) for the functions and the modules; an empty
    backend= ARGUMENT stays an unknown name (test_unknown_backend_argument)."""
    monkeypatch.setenv("FUSEDCE_BACKEND", "")
    x, t = make_logits((4, 50), torch.float32), make_target((4,), 50)
    fusedce.cross_entropy(x, t)
    fusedce.CrossEntropyLoss()(x, t)
    assert (len(spies["torch"]), len(spies["triton"])) == (2, 0)
    hidden, weight = torch.randn(4, 8), torch.randn(50, 8)
    a = fusedce.linear_cross_entropy(hidden, weight, t)
    b = fusedce.linear_cross_entropy(hidden, weight, t, backend="torch")
    assert bit_identical(a, b)


def test_unknown_backend_from_the_environment_names_the_variable(monkeypatch):
    """No backend= passed, a bad $FUSEDCE_BACKEND: the message says where the name came from."""
    monkeypatch.setenv("FUSEDCE_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"\$FUSEDCE_BACKEND: unknown backend 'bogus'"):
        fusedce.cross_entropy(make_logits((2, 5), torch.float32), make_target((2,), 5))
    with pytest.raises(ValueError, match=r"^unknown backend 'bogus'"):   # passed explicitly: as before
        fusedce.cross_entropy(make_logits((2, 5), torch.float32), make_target((2,), 5), backend="bogus")
