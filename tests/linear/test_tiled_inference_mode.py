"""The PyTorch backend's tiled method under ``torch.inference_mode()`` on CPU: its block loops run on
worker threads (``backends/pytorch/launch.run``), and inference mode is per thread, so the workers
must enter it too (else: "Inplace update to inference tensor outside InferenceMode"). Every tiled entry
point, with two intra-op threads so that the loops really use a second thread, against the same call
under ``torch.no_grad()``."""
import pytest
import torch

import fusedce

N, H, V, K = 24, 16, 300, 3


@pytest.fixture()
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    target = torch.randint(0, V, (N,), generator=g)
    target[::5] = -100
    return hidden, weight, target, torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3


CALLS = {
    "linear_cross_entropy": lambda h, w, t, th, tw: fusedce.linear_cross_entropy(
        h, w, t, method="tiled", backend="torch"),
    "linear_token_log_probs": lambda h, w, t, th, tw: fusedce.linear_token_log_probs(
        h, w, t, method="tiled", backend="torch"),
    "linear_token_log_probs K": lambda h, w, t, th, tw: fusedce.linear_token_log_probs(
        h, w, torch.stack([t.clamp_min(0), (t.clamp_min(0) + 7) % V, t], -1), method="tiled", backend="torch"),
    "linear_distillation_loss": lambda h, w, t, th, tw: fusedce.linear_distillation_loss(
        h, w, th, tw, t, beta=0.5, method="tiled", backend="torch"),
    "linear_topk_distillation_loss": lambda h, w, t, th, tw: fusedce.linear_topk_distillation_loss(
        h, w, torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(1)),
        torch.log_softmax(torch.randn(N, K, generator=torch.Generator().manual_seed(2)), -1), t,
        method="tiled", backend="torch"),
    # the top-k tail pass (distill/tail.py) runs its blocks on the same threads, for every method
    **{f"topk tail {form}": (lambda form: lambda h, w, t, th, tw: _topk_tail(h, w, t, form))(form)
       for form in ("logits", "chunked", "tiled")},
}


def _topk_tail(h, w, t, form):
    ids = torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(1))
    lp = torch.log_softmax(torch.randn(N, K, generator=torch.Generator().manual_seed(2)), -1) - 0.7   # a tail of 0.5
    if form == "logits":
        return fusedce.topk_distillation_loss(h @ w.T, ids, lp, t, tail=True, backend="torch")
    return fusedce.linear_topk_distillation_loss(h, w, ids, lp, t, tail=True, method=form, backend="torch")


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("made_inside", [False, True], ids=["inputs-outside", "inputs-inside"])
def test_tiled_runs_under_inference_mode(two_threads, name, made_inside):
    with torch.no_grad():
        expected = CALLS[name](*_inputs())
    with torch.inference_mode():
        got = CALLS[name](*_inputs()) if made_inside else None
    if not made_inside:
        inputs = _inputs()
        with torch.inference_mode():
            got = CALLS[name](*inputs)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
