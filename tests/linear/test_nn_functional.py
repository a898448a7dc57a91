"""``fusedce.nn.functional.linear_cross_entropy`` against PyTorch's own ``F.linear_cross_entropy``.

The reference is torch's function itself, run in float64 on the same values (its reference path,
``options=None``); fusedce runs in float32, so the tolerances are fp32's (the loss and gradients of a
few-hundred-class problem: a few ulps of fp32 times log V). Shapes: 37 tokens (odd, not a chunk multiple),
H = 24, V = 300 (not a power of 2); a chunk of 8 rows is forced through ``options.batch_chunk_size`` in
some cases so the chunk loop runs several chunks. Without torch's function (torch before 2.13) the
comparisons skip, saying so; the refusals still run.
"""
import inspect

import pytest
import torch
import torch.nn.functional as TF

import fusedce.nn.functional as F
from versions import needs_torch_lce
from tolerances import NN_ATOL, NN_RTOL

N, H, V = 37, 24, 300


def _data(seed=0, ignore=-100, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    bias = torch.randn(V, generator=gen) * 0.1
    target = torch.randint(0, V, (N,), generator=gen)
    target[torch.randperm(N, generator=gen)[:9]] = ignore
    class_weight = torch.rand(V, generator=gen) + 0.5
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), target, class_weight.to(dtype)


def _run(fn, hidden, head, bias, target, upstream=None, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, head, bias)]
    loss = fn(leaves[0], leaves[1], target, linear_bias=leaves[2], **kwargs)
    (loss if upstream is None else loss * upstream).sum().backward()
    return loss.detach(), [t.grad for t in leaves]


def _compare(kwargs, seed=0, ignore=-100, options=None):
    hidden, weight, bias, target, class_weight = _data(seed, ignore)
    if kwargs.pop("class_weight", False):
        kwargs["weight"] = class_weight
    upstream = None
    if kwargs.get("reduction") == "none":   # a per-token upstream gradient, not all ones
        upstream = torch.randn(N, generator=torch.Generator().manual_seed(seed + 1))
    ref_kwargs = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    loss_ref, grads_ref = _run(TF.linear_cross_entropy, hidden.double(), weight.double(), bias.double(), target,
                               None if upstream is None else upstream.double(), **ref_kwargs)
    loss, grads = _run(F.linear_cross_entropy, hidden, weight, bias, target, upstream, options=options, **kwargs)
    assert loss.dtype == torch.float32 and loss.shape == loss_ref.shape
    torch.testing.assert_close(loss.double(), loss_ref, rtol=NN_RTOL, atol=NN_ATOL)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), g_ref, rtol=NN_RTOL, atol=NN_ATOL)
    return loss, grads


@needs_torch_lce
def test_signature_is_torchs():
    ours, theirs = inspect.signature(F.linear_cross_entropy), inspect.signature(TF.linear_cross_entropy)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in theirs.parameters.values()]


@needs_torch_lce
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("class_weight", [False, True])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_torch_every_reduction_weights_smoothing(reduction, class_weight, label_smoothing):
    _compare(dict(reduction=reduction, class_weight=class_weight, label_smoothing=label_smoothing))


@needs_torch_lce
def test_ignore_index_none_means_minus_100():
    loss, _ = _compare(dict(reduction="none"))                    # ignore_index left at None
    _, _, _, target, _ = _data()
    assert bool((loss[target == -100] == 0).all()) and bool((loss[target != -100] > 0).all())


@needs_torch_lce
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_custom_ignore_index_in_vocabulary(reduction):
    # 7 is a real class: rows whose target is 7 are ignored, the class itself still takes part in the softmax
    _compare(dict(reduction=reduction, ignore_index=7, class_weight=True, label_smoothing=0.05), ignore=7)


@needs_torch_lce
def test_options_batch_chunk_size_is_the_chunk_and_the_rest_is_ignored():
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8, chunking_method=None, acc_policy="compact")
    _compare(dict(reduction="mean", class_weight=True), options=options)
    _compare(dict(reduction="sum"), options=torch.nn.LinearCrossEntropyOptions())   # "auto" everything


@needs_torch_lce
def test_unbatched_input():
    hidden, weight, bias, target, _ = _data()
    for reduction in ("mean", "none"):
        ours = F.linear_cross_entropy(hidden[0], weight, target[1], linear_bias=bias, reduction=reduction)
        ref = TF.linear_cross_entropy(hidden[0].double(), weight.double(), target[1], linear_bias=bias.double(),
                                      reduction=reduction)
        assert ours.shape == ref.shape == ()
        torch.testing.assert_close(ours.double(), ref, rtol=NN_RTOL, atol=NN_ATOL)


@needs_torch_lce
def test_bf16_gradients_in_their_dtype_and_close_to_torch():
    hidden, weight, bias, target, _ = _data(dtype=torch.bfloat16)
    loss, grads = _run(F.linear_cross_entropy, hidden, weight, bias, target)
    ref, ref_grads = _run(TF.linear_cross_entropy, hidden, weight, bias, target)
    assert loss.dtype == torch.float32 and [g.dtype for g in grads] == [torch.bfloat16] * 3
    torch.testing.assert_close(loss, ref.float(), rtol=2e-2, atol=2e-2)   # torch's bf16 loss is rounded
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), g_ref.float(), rtol=2e-2, atol=2e-3)


def test_refusals():
    hidden, weight, bias, target, _ = _data()
    with pytest.raises(NotImplementedError, match="K-dimensional"):
        F.linear_cross_entropy(hidden, weight.reshape(V, 2, H // 2).transpose(1, 2).reshape(V, 1, H), target[:, None])
    with pytest.raises(RuntimeError, match="dimensionality"):
        F.linear_cross_entropy(hidden[None], weight, target[None])
    with pytest.raises(TypeError, match="LinearCrossEntropyOptions"):
        F.linear_cross_entropy(hidden, weight, target, options={"batch_chunk_size": 8})


def test_every_other_name_is_torchs():
    assert F.silu is TF.silu and F.cross_entropy is TF.cross_entropy
    assert "silu" in dir(F)
    with pytest.raises(AttributeError):
        F.no_such_function  # noqa: B018
