"""``fusedce.nn.functional.linear_cross_entropy`` with probability targets against PyTorch's own
``F.linear_cross_entropy`` (run in float64 on the same values, its reference path ``options=None``):
every reduction, class weights, label smoothing, bias, 1-D input, values and gradients of input, weight and
bias. fusedce runs in fp32, so the tolerances are test_nn_functional.py's (fp32's). A torch without the
function, or whose function refuses probability targets for a reduction, is a skip with the reason.
Shapes: 37 tokens, H = 24, V = 300 (as test_nn_functional.py); a chunk of 8 rows in some cases; targets:
softmax(randn * 2) rows, one one-hot row, one row with zeros, in fp32 / bf16 / fp64.
"""
import pytest
import torch
import torch.nn.functional as TF

import fusedce.nn.functional as F
from tolerances import NN_ATOL, NN_RTOL

N, H, V = 37, 24, 300

if not hasattr(TF, "linear_cross_entropy"):
    pytest.skip("this torch has no torch.nn.functional.linear_cross_entropy", allow_module_level=True)


def _data(seed=0, q_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    bias = torch.randn(V, generator=gen) * 0.1
    q = torch.softmax(torch.randn(N, V, generator=gen) * 2.0, dim=-1)
    q[0] = 0.0
    q[0, V - 1] = 1.0
    q[1, ::3] = 0.0
    class_weight = torch.rand(V, generator=gen) + 0.5
    return hidden, weight, bias, q.to(q_dtype), class_weight


def _run(fn, hidden, head, bias, target, upstream, dtype=None, **kwargs):
    leaves = [(t if dtype is None else t.to(dtype)).detach().clone().requires_grad_(True) for t in (hidden, head, bias)]
    if dtype is not None:
        target = target.to(dtype)
        kwargs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    loss = fn(leaves[0], leaves[1], target, linear_bias=leaves[2], **kwargs)
    (loss * upstream.to(loss.dtype)).sum().backward()
    return loss.detach(), [t.grad for t in leaves]


def _torch_or_skip(*args, **kwargs):
    try:
        return _run(TF.linear_cross_entropy, *args, dtype=torch.float64, **kwargs)
    except (RuntimeError, NotImplementedError, ValueError) as e:   # a torch that refuses this case
        pytest.skip(f"torch's F.linear_cross_entropy refuses it: {e}")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["plain", "weight", "smoothing", "weight+smoothing+chunks"])
def test_against_torch(reduction, case):
    hidden, weight, bias, q, class_weight = _data()
    kwargs = dict(reduction=reduction)
    if "weight" in case:
        kwargs["weight"] = class_weight
    if "smoothing" in case:
        kwargs["label_smoothing"] = 0.15
    upstream = torch.randn(N) if reduction == "none" else torch.tensor(2.5)
    ref, ref_grads = _torch_or_skip(hidden, weight, bias, q, upstream, **kwargs)
    fused_kwargs = dict(kwargs)
    if case.endswith("chunks"):
        fused_kwargs["options"] = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8)
    loss, grads = _run(F.linear_cross_entropy, hidden, weight, bias, q, upstream, **fused_kwargs)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=NN_RTOL, atol=NN_ATOL)
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), g_ref, rtol=NN_RTOL, atol=NN_ATOL)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float64])
def test_target_dtype_and_1d_input(q_dtype):
    hidden, weight, bias, q, _ = _data(1, q_dtype)
    up = torch.tensor(1.0)
    ref, ref_grads = _torch_or_skip(hidden[3], weight, bias, q[3].double(), up, reduction="sum")
    loss, grads = _run(F.linear_cross_entropy, hidden[3], weight, bias, q[3], up, reduction="sum")
    # the fused op reads q at its own dtype exactly as torch's float64 run does (q's values, widened)
    torch.testing.assert_close(loss.double(), ref, rtol=NN_RTOL, atol=NN_ATOL)
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), g_ref, rtol=NN_RTOL, atol=NN_ATOL)


def test_target_requiring_grad_is_refused():
    hidden, weight, bias, q, _ = _data()
    with pytest.raises(TypeError, match=r"target\.detach\(\)"):
        F.linear_cross_entropy(hidden, weight, q.requires_grad_())
