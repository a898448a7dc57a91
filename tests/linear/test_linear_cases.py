"""The cases of /work/shared/cases/README.md for ``linear_cross_entropy`` (C5, C9) and its edge cases:
every target ignored, D = 0, empty input, NaN rows, the caller's tensors never modified. Both backends;
the float64 reference and the tolerance rule are reference64_linear.py's."""
import pytest
import torch

import fusedce
from inputs import bit_identical, make_target, make_weight, poisoned_allocations
from reference64_linear import (assert_linear_loss_close, check_linear, make_linear, reference_linear_cross_entropy,
                                run_fused)

NAN = float("nan")


# --- C5: per-token upstream gradient -------------------------------------------------------------------
UPSTREAMS = {
    "randn": lambda: torch.randn(2, 4),
    "non_contiguous": lambda: torch.randn(4, 2).t(),           # strides (1, 2)
    "expanded": lambda: torch.randn(1, 4).expand(2, 4),        # stride 0 over the batch
}


@pytest.mark.parametrize("upstream", list(UPSTREAMS))
@pytest.mark.parametrize("chunk_size", [None, 3, 1], ids=lambda c: f"chunk{c}")
def test_c5_per_token_upstream_gradient(backend, chunk_size, upstream):
    """C5: B, T, H, V = 2, 4, 10, 15, reduction "none", upstream randn(2, 4): the grads of hidden and
    weight equal the reference (a peer multiplied every token's gradient by the first token's)."""
    hidden, weight, _ = make_linear((2, 4), 10, 15)
    target = torch.randint(0, 15, (2, 4))
    up = UPSTREAMS[upstream]()
    ref, _, _, _ = check_linear(hidden, weight, target, backend=backend, reduction="none", upstream=up,
                                chunk_size=chunk_size)
    # premise: the peer's fault is far outside the tolerance
    wrong = reference_linear_cross_entropy(hidden, weight, target, reduction="none",
                                           upstream=up.reshape(-1)[0].expand(2, 4))
    assert float((wrong.grad_hidden - ref.grad_hidden).abs().max()) > 1e-2


def test_c5_with_bias_and_ignored_tokens(backend):
    hidden, weight, bias = make_linear((2, 4), 10, 15, bias=True)
    target = torch.tensor([[3, -100, 14, 0], [-100, 7, 7, -100]])
    check_linear(hidden, weight, target, bias, backend=backend, reduction="none", upstream=torch.randn(2, 4),
                 chunk_size=2, return_stats=True)


# --- C9: unwritten output rows ------------------------------------------------------------------------
C9_BT, C9_H, C9_V = 256, 32, 4096


def _c9_inputs():
    hidden, weight, _ = make_linear((C9_BT,), C9_H, C9_V)
    target = torch.randint(0, C9_V, (C9_BT,))
    ignored = torch.rand(C9_BT) < 0.4                 # ~40% at random positions
    target[ignored] = -100
    assert 0.3 < float(ignored.float().mean()) < 0.5
    return hidden, weight, target, ignored


def _garbage_run(backend, hidden, weight, target, ignored):
    """Same shapes, NaN hidden states: every buffer the loss allocates and frees is left full of NaN (the
    CPU allocator hands such blocks out again), so the real call's unwritten rows would show. Also the
    contract: NaN in a row's logits -> that row's loss NaN; ignored rows 0 all the same.
    No stats here: the Triton interpreter's argmax (numpy nanargmax) raises on an all-NaN row."""
    with torch.no_grad(), poisoned_allocations():
        loss = fusedce.linear_cross_entropy(torch.full_like(hidden, NAN), weight, target, backend=backend,
                                            reduction="none")
    assert bool(torch.isnan(loss[~ignored]).all()), "NaN logits must give NaN loss rows"
    assert bool((loss[ignored] == 0).all())


def test_c9_every_row_written(backend):
    """C9: BT=256, H=32, V=4096, ~40% targets -100 at random positions, reduction "none" with a per-token
    upstream gradient and stats; allocations NaN-poisoned (after a NaN garbage run on the torch backend,
    whose freed blocks the allocator hands out again). Row by row: the loss equals the reference, ignored
    rows are exactly 0 (loss, hidden grad, lse) and predicted -1 there."""
    hidden, weight, target, ignored = _c9_inputs()
    if backend == "torch":   # the interpreter is slow: for Triton the poisoned allocations have to do
        _garbage_run(backend, hidden, weight, target, ignored)
    up = torch.randn(C9_BT)
    _, out, loss, grads = check_linear(hidden, weight, target, backend=backend, reduction="none", upstream=up,
                                       return_stats=True)
    assert not bool(torch.isnan(loss).any())
    assert bool((loss[ignored] == 0).all()) and bool((loss[~ignored] > 0).all())
    assert bool((grads["grad_hidden"][ignored] == 0).all())
    assert bool((out.lse[ignored] == 0).all()) and bool((out.predicted_tokens[ignored] == -1).all())


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_c9_reduced_torch_backend(reduction):
    """C9 with mean / sum (the Triton backend runs the same loop; its interpreter is too slow for a
    second 256 x 4096 case)."""
    hidden, weight, target, ignored = _c9_inputs()
    _garbage_run("torch", hidden, weight, target, ignored)
    check_linear(hidden, weight, target, backend="torch", reduction=reduction, chunk_size=64)


# --- every target ignored, D = 0 --------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(backend, reduction):
    """(C2 for the linear op) 16 tokens, all -100: loss 0.0, every gradient exactly 0, no NaN (stock
    PyTorch gives NaN for the mean); stats: lse 0, predicted -1, accuracy 0."""
    hidden, weight, bias = make_linear((16,), 16, 1000, bias=True)
    target = torch.full((16,), -100)
    up = torch.randn(16) if reduction == "none" else None
    out, loss, grads = run_fused(hidden, weight, target, bias, backend=backend, reduction=reduction,
                                 upstream=up, return_stats=True, ce_weight=make_weight(1000))
    assert loss.dtype == torch.float32 and bool((loss == 0).all())
    for name, g in grads.items():
        assert not bool(torch.isnan(g).any()) and bool((g == 0).all()), name
    assert bool((out.lse == 0).all()) and bool((out.predicted_tokens == -1).all())
    assert bool((out.token_accuracy == 0).all()) and bool((out.z_loss == 0).all())


def test_num_items_zero(backend):
    """num_items_in_batch = 0 (int and tensor): D = 0 -> loss 0.0 and zero gradients, not NaN / inf."""
    hidden, weight, bias = make_linear((8,), 16, 300, bias=True)
    target = make_target((8,), 300, ignore_every=3)
    for d in (0, torch.tensor(0)):
        _, loss, grads = run_fused(hidden, weight, target, bias, backend=backend, num_items_in_batch=d)
        assert float(loss) == 0.0
        for name, g in grads.items():
            assert bool((g == 0).all()), name


# --- empty input --------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["BT0_2d", "B2_T0_3d"])
def test_empty_input(backend, lead, reduction):
    """BT = 0: mean and sum give 0.0, "none" an empty tensor of target.shape; backward gives an empty
    hidden gradient and zero weight / bias gradients."""
    hidden, weight, bias = make_linear(lead, 16, 300, bias=True)
    target = torch.zeros(lead, dtype=torch.int64)
    up = torch.randn(lead) if reduction == "none" else None
    out, loss, grads = run_fused(hidden, weight, target, bias, backend=backend, reduction=reduction,
                                 upstream=up, return_stats=True)
    assert loss.dtype == torch.float32
    assert tuple(loss.shape) == (lead if reduction == "none" else ())
    if reduction != "none":
        assert float(loss) == 0.0
    assert out.lse.shape == lead and out.predicted_tokens.shape == lead
    assert grads["grad_hidden"].shape == hidden.shape
    assert bool((grads["grad_weight"] == 0).all()) and bool((grads["grad_bias"] == 0).all())


# --- NaN rows --------------------------------------------------------------------------------------------
def test_nan_in_one_row(backend):
    """NaN hidden state in a counted row -> that row's loss is NaN, the others are right; NaN in an
    ignored row -> nothing (its logits are never computed), the other rows and gradients stay finite."""
    hidden, weight, _ = make_linear((6,), 16, 300, requires_grad=(False, True, False))
    target = make_target((6,), 300)
    target[4] = -100
    hidden[2] = NAN
    hidden[4] = NAN
    keep = torch.tensor([0, 1, 3, 5])
    loss = fusedce.linear_cross_entropy(hidden, weight, target, backend=backend, reduction="none").detach()
    assert bool(torch.isnan(loss[2])) and float(loss[4]) == 0.0
    ref = reference_linear_cross_entropy(hidden[keep], weight, target[keep], reduction="none")
    assert_linear_loss_close(loss[keep], ref, torch.float32)
    hidden[2] = torch.randn(16)
    _, loss, grads = run_fused(hidden, weight, target, backend=backend, reduction="none",
                               upstream=torch.randn(6))
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grads["grad_weight"]).all())


# --- the caller's tensors ----------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_callers_tensors_never_modified(backend, dtype, reduction):
    """hidden, weight, bias, target, ce_weight (and num_items_in_batch) bit-identical after forward and
    backward, with every option on; and a second identical call gives bit-identical results."""
    hidden, weight, bias = make_linear((3, 5), 16, 300, dtype, bias=True, logit_scale=40.0)
    target = make_target((3, 5), 300, ignore_every=3)
    ce_weight, d = make_weight(300), torch.tensor(9)
    args = (hidden, weight, bias, target, ce_weight, d)
    before = [t.detach().clone() for t in args]
    kw = dict(ce_weight=ce_weight, reduction=reduction, label_smoothing=0.1, lse_square_scale=1e-2,
              softcap=30.0, num_items_in_batch=d, chunk_size=4, return_stats=True)
    up = torch.randn(3, 5) if reduction == "none" else None
    first = run_fused(hidden, weight, target, bias, backend=backend, upstream=up, **kw)
    with torch.no_grad():
        fusedce.linear_cross_entropy(hidden, weight, target, bias, backend=backend, **kw)
    second = run_fused(hidden, weight, target, bias, backend=backend, upstream=up, **kw)
    for name, b, a in zip(("hidden", "weight", "bias", "target", "ce_weight", "num_items"), before, args):
        assert bit_identical(a.detach(), b), f"{name} was modified"
    assert bit_identical(first[1], second[1])
    for name in first[2]:
        assert bit_identical(first[2][name], second[2][name]), name


# --- argmax ties ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_predicted_lowest_index_on_ties(backend, dtype):
    """Small-integer hidden states and weights make every logit an exact integer (exact in bf16 too, in any
    summation order). Classes 100, 2500 and 4500 share the largest possible row (all 3s; hidden in
    [1, 3]): predicted is 100, the lowest index, for every row, across a 4096-wide vocabulary block."""
    n_classes, n_hidden = 5000, 8
    hidden = torch.randint(1, 4, (6, n_hidden)).to(dtype)
    weight = torch.randint(-3, 3, (n_classes, n_hidden)).to(dtype)   # at most 2 except the tied rows
    weight[[100, 2500, 4500]] = 3.0
    target = torch.randint(0, n_classes, (6,))
    target[0], target[3] = 100, -100
    out = fusedce.linear_cross_entropy(hidden, weight, target, backend=backend, reduction="none",
                                       return_stats=True)
    assert out.predicted_tokens.tolist() == [100, 100, 100, -1, 100, 100]
    assert out.token_accuracy.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
