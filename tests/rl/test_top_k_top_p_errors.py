"""RL: the errors of ``top_k`` / ``top_p`` (types, ranges, per-row tensors' dtype and shape, the methods and
options that cannot honour them): each a clear error naming the argument, raised before any kernel."""
import pytest
import torch

import fusedce

V = 11


def _logits():
    return torch.randn(4, V), torch.randint(0, V, (4,))


@pytest.mark.parametrize("kw, error, words", [
    ({"top_k": -1}, ValueError, "top_k must be >= 0"),
    ({"top_k": 1.5}, TypeError, "top_k must be an int"),
    ({"top_k": True}, TypeError, "top_k must be an int"),
    ({"top_k": "5"}, TypeError, "top_k must be an int"),
    ({"top_p": 0.0}, ValueError, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, ValueError, "top_p must be in (0, 1]"),
    ({"top_p": 90}, ValueError, "not a percentage"),
    ({"top_p": float("nan")}, ValueError, "top_p must be in (0, 1]"),
    ({"top_p": "0.9"}, TypeError, "top_p must be a number"),
    ({"top_p": False}, TypeError, "top_p must be a number"),
    ({"top_k": torch.ones(4)}, TypeError, "top_k as a per-row tensor must have an integer dtype"),
    ({"top_k": torch.ones(4, dtype=torch.bool)}, TypeError, "integer dtype"),
    ({"top_p": torch.ones(4, dtype=torch.int64)}, TypeError, "top_p as a per-row tensor must have a floating"),
    ({"top_k": torch.ones(5, dtype=torch.int64)}, ValueError, "top_k as a per-row tensor must have the target's shape"),
    ({"top_p": torch.ones(4, 1)}, ValueError, "top_p as a per-row tensor must have the target's shape"),
    ({"top_k": torch.tensor([1, 2, -3, 4])}, ValueError, "top_k[2] = -3"),
    ({"top_p": torch.tensor([0.5, 0.0, 1.0, 1.0])}, ValueError, "top_p[1] = 0.0"),
    ({"top_p": torch.tensor([0.5, 1.0, 1.01, float("nan")])}, ValueError, "top_p[2]"),
])
@pytest.mark.parametrize("op", ["logits", "linear"])
def test_bad_values(op, kw, error, words):
    logits, target = _logits()
    with pytest.raises(error, match=words.replace("[", r"\[").replace("(", r"\(").replace("]", r"\]")
                       .replace(")", r"\)")):
        if op == "logits":
            fusedce.token_log_probs(logits, target, **kw)
        else:
            fusedce.linear_token_log_probs(torch.randn(4, 3), torch.randn(V, 3), target, **kw)


def test_tiled_method_refused_naming_chunked():
    with pytest.raises(ValueError, match="method='chunked'"):
        fusedce.linear_token_log_probs(torch.randn(4, 3), torch.randn(V, 3), torch.zeros(4, dtype=torch.int64),
                                       method="tiled", top_p=0.9)


@pytest.mark.parametrize("op", ["logits", "linear"])
def test_options_that_cannot_honour_them(op):
    logits, target = _logits()
    args = (logits,) if op == "logits" else (torch.randn(4, 3), torch.randn(V, 3))
    fn = fusedce.token_log_probs if op == "logits" else fusedce.linear_token_log_probs
    with pytest.raises(ValueError, match="batch_invariant=True does not support top_k / top_p"):
        fn(*args, target, top_k=3, batch_invariant=True)
    with pytest.raises(ValueError, match="return_stats is not supported with top_k / top_p"):
        fn(*args, target, top_p=0.5, return_stats=True)
    with pytest.raises(ValueError, match=r"\(\.\.\., K\) form"):
        fn(*args, torch.zeros(4, 2, dtype=torch.int64), top_k=3)


def test_off_scalars_keep_every_option():
    """top_k=0 / top_p=1.0 are off: the options the truncation refuses stay available."""
    logits, target = _logits()
    fusedce.token_log_probs(logits, target, top_k=0, top_p=1.0, return_stats=True, batch_invariant=True)


def test_a_per_row_top_p_that_requires_grad_is_a_type_error():
    """A sampling setting gets no gradient: a per-row tensor that requires grad is refused (as
    ``num_items_in_batch``), not silently made part of the graph (fresh-user finding)."""
    z, t = torch.randn(3, 7), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match=r"top_p is a sampling setting.*top_p\.detach\(\)"):
        fusedce.token_log_probs(z, t, top_p=torch.full((3,), 0.9, requires_grad=True))
    with torch.no_grad():
        fusedce.token_log_probs(z, t, top_p=torch.full((3,), 0.9, requires_grad=True))
