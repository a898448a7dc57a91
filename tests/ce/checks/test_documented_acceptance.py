"""Options that do not apply, as documented (docs/contract.md, README; issue 47 item 5): ``ignore_index``
with probability targets follows torch's ``F.cross_entropy`` (a class index, >= 0, is refused; a
negative one names no class and has no effect), and ``num_items_in_batch`` with ``reduction="sum"`` /
``"none"`` is accepted and unused (the mean's denominator only, Hugging Face's rule), pinned so that a
change is a decision. Against float64 torch; every face that takes the option, both backends."""
import pytest
import torch
import torch.nn.functional as F

import fusedce

LEAD, V, H = (2, 3), 13, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(*LEAD, V, generator=g)
    q = torch.softmax(torch.randn(*LEAD, V, generator=g), -1)
    return logits, q, torch.randn(*LEAD, H, generator=g), torch.randn(V, H, generator=g)


@pytest.mark.parametrize("ignore_index", [-1, -100])   # negative: names no class
def test_negative_ignore_index_has_no_effect_on_probability_targets(backend, ignore_index):
    logits, q, hidden, weight = _inputs()
    ref = F.cross_entropy(logits.double().reshape(-1, V), q.double().reshape(-1, V), ignore_index=ignore_index)
    assert torch.equal(ref, F.cross_entropy(logits.double().reshape(-1, V), q.double().reshape(-1, V)))
    losses = [fusedce.cross_entropy(logits, q, ignore_index=ignore_index, backend=backend),
              fusedce.CrossEntropyLoss(ignore_index=ignore_index, backend=backend)(logits, q)]
    for loss in losses:
        torch.testing.assert_close(loss.double(), ref, atol=1e-6, rtol=1e-6)
    ref_linear = F.cross_entropy((hidden.double() @ weight.double().T).reshape(-1, V), q.double().reshape(-1, V))
    loss = fusedce.linear_cross_entropy(hidden, weight, q, ignore_index=ignore_index, backend=backend)
    torch.testing.assert_close(loss.double(), ref_linear, atol=1e-5, rtol=1e-5)


def test_class_ignore_index_with_probability_targets_is_refused_as_torch(backend):
    """A class ``ignore_index`` (>= 0) would ignore nothing: torch refuses it, and so does every face."""
    logits, q, hidden, weight = _inputs()
    with pytest.raises(RuntimeError, match="ignore_index is not supported"):   # torch's own rule
        F.cross_entropy(logits.reshape(-1, V), q.reshape(-1, V), ignore_index=2)
    calls = [lambda: fusedce.cross_entropy(logits, q, ignore_index=2, backend=backend),
             lambda: fusedce.CrossEntropyLoss(ignore_index=0, backend=backend)(logits, q),
             lambda: fusedce.linear_cross_entropy(hidden, weight, q, ignore_index=2, method="chunked", backend=backend),
             lambda: fusedce.linear_cross_entropy(hidden, weight, q, ignore_index=2, method="tiled", backend=backend),
             lambda: fusedce.LinearCrossEntropyLoss(ignore_index=2, backend=backend)(hidden, weight, q)]
    for call in calls:
        with pytest.raises(ValueError, match=r"ignore_index=\d names a class.*probabilities"):
            call()


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("soft", [False, True], ids=["indices", "probabilities"])
def test_num_items_in_batch_is_the_means_denominator_only(backend, reduction, soft):
    logits, q, hidden, weight = _inputs()
    target = q if soft else q.argmax(-1)
    given = fusedce.cross_entropy(logits, target, reduction=reduction, num_items_in_batch=7, backend=backend)
    ref = F.cross_entropy(logits.double().movedim(-1, 1), target.double().movedim(-1, 1) if soft else target,
                          reduction=reduction)
    torch.testing.assert_close(given.double(), ref, atol=1e-5, rtol=1e-6)
    given = fusedce.linear_cross_entropy(hidden, weight, target, reduction=reduction, num_items_in_batch=7,
                                         backend=backend)
    assert torch.equal(given, fusedce.linear_cross_entropy(hidden, weight, target, reduction=reduction,
                                                           backend=backend))
