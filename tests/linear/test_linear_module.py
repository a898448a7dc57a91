"""``fusedce.LinearCrossEntropyLoss``: the same results as ``linear_cross_entropy`` (bit for bit, loss
and gradients) and the same argument order: data first, then target, then optional tensors, then
options (ARCHITECTURE.md, Modules)."""
import inspect

import numpy as np
import pytest
import torch

import fusedce
from inputs import bit_identical, make_target, make_weight
from reference64_linear import make_linear, run_fused

H, V = 16, 300

CONFIGS = {
    "defaults": {},
    "everything": {"ignore_index": -1, "reduction": "sum", "label_smoothing": 0.1, "lse_square_scale": 1e-2,
                   "softcap": 30.0, "return_stats": True, "chunk_size": 3, "accum_dtype": torch.float32},
    "none_per_token": {"reduction": "none", "chunk_size": 5, "accum_dtype": torch.float64},
}


def _module_fwd_bwd(module, hidden, weight, target, bias, num_items, upstream):
    leaves = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    out = module(hidden, weight, target, bias, num_items)           # positional, in the contract's order
    loss = out.loss if isinstance(out, fusedce.CrossEntropyOutput) else out
    grads = torch.autograd.grad(loss, leaves, torch.ones_like(loss) if upstream is None else upstream)
    return out, loss.detach(), grads


@pytest.mark.parametrize("with_ce_weight", [False, True], ids=["no_ce_weight", "ce_weight"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_module_equals_function(backend, config, with_ce_weight):
    opts = dict(CONFIGS[config])
    hidden, weight, bias = make_linear((2, 6), H, V, bias=True, logit_scale=40.0 if "softcap" in opts else 2.0)
    target = make_target((2, 6), V, ignore_every=3, ignore_index=opts.get("ignore_index", -100))
    ce_weight = make_weight(V) if with_ce_weight else None
    num_items = None if opts.get("reduction", "mean") != "mean" else torch.tensor(7)
    upstream = torch.randn(2, 6) if opts.get("reduction") == "none" else None
    module = fusedce.LinearCrossEntropyLoss(ce_weight, backend=backend, **opts)
    m_out, m_loss, m_grads = _module_fwd_bwd(module, hidden, weight, target, bias, num_items, upstream)
    f_out, f_loss, f_grads = run_fused(hidden, weight, target, bias, backend=backend, upstream=upstream,
                                       poison=False, ce_weight=ce_weight, num_items_in_batch=num_items, **opts)
    assert bit_identical(m_loss, f_loss)
    for a, b in zip(m_grads, f_grads.values()):
        assert bit_identical(a, b)
    if opts.get("return_stats"):
        assert isinstance(m_out, fusedce.CrossEntropyOutput)
        for a, b in zip(m_out, f_out):
            assert bit_identical(a.detach(), b.detach())


def test_module_keywords_and_buffer():
    """Keywords work too; ce_weight is a registered buffer (moves with .to(), saved in state_dict)."""
    hidden, weight, bias = make_linear((8,), H, V, bias=True)
    target = make_target((8,), V, ignore_every=3)
    ce_weight = make_weight(V)
    module = fusedce.LinearCrossEntropyLoss(ce_weight=ce_weight, reduction="mean", backend="torch")
    assert "ce_weight" in dict(module.named_buffers()) and "ce_weight" in module.state_dict()
    a = module(hidden=hidden, weight=weight, target=target, bias=bias, num_items_in_batch=5)
    b = fusedce.linear_cross_entropy(hidden, weight, target, bias, ce_weight=ce_weight, num_items_in_batch=5,
                                     backend="torch")
    assert bit_identical(a.detach(), b.detach())
    assert fusedce.LinearCrossEntropyLoss().ce_weight is None


def test_argument_order():
    """function: (hidden, weight, target, bias=None, *, options); module: forward(hidden, weight, target,
    bias=None, num_items_in_batch=None); constructor: ce_weight first, the loss options, chunk_size and
    accum_dtype last, each with the function's default."""
    fn = inspect.signature(fusedce.linear_cross_entropy).parameters
    positional = [n for n, p in fn.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == ["hidden", "weight", "target", "bias"]
    assert all(p.kind == p.KEYWORD_ONLY for n, p in fn.items() if n not in positional)
    assert fn["bias"].default is None

    fwd = list(inspect.signature(fusedce.LinearCrossEntropyLoss.forward).parameters)
    assert fwd == ["self", "hidden", "weight", "target", "bias", "num_items_in_batch", "token_weights"]
    forward = inspect.signature(fusedce.LinearCrossEntropyLoss.forward).parameters
    assert forward["token_weights"].kind == inspect.Parameter.KEYWORD_ONLY   # per-call tensor, keyword-only

    init = inspect.signature(fusedce.LinearCrossEntropyLoss.__init__).parameters
    names = [n for n in init if n != "self"]
    positional = [n for n in names if init[n].kind == init[n].POSITIONAL_OR_KEYWORD]
    assert positional[0] == "ce_weight" and positional[-2:] == ["chunk_size", "accum_dtype"]
    # options added after the contract's positional ones are keyword-only: old positional calls keep
    # their meaning
    assert sorted(n for n in names if n not in positional) == ["batch_invariant", "deterministic", "logit_scale",
                                                                "logits_dtype", "method", "use_token_scaling"]
    assert all(init[n].kind == init[n].KEYWORD_ONLY for n in ("logit_scale", "use_token_scaling", "logits_dtype"))
    for n in names:
        assert n in fn, f"constructor option {n!r} is not an option of linear_cross_entropy"
        assert init[n].default == fn[n].default, n
    missing = set(fn) - set(names) - {"hidden", "weight", "target", "bias", "num_items_in_batch", "token_weights"}
    assert not missing, f"options of the function the module lacks: {missing}"
    # the loss options come in CrossEntropyLoss's order
    ce_init = [n for n in inspect.signature(fusedce.CrossEntropyLoss.__init__).parameters
               if n not in ("self", "weight", "inplace_backward")]
    assert [n for n in names if n in ce_init] == ce_init


# The constructor checks every option, with the errors linear_cross_entropy raises for it.
BAD_OPTIONS = {
    "reduction": ({"reduction": "batchmean"}, ValueError),
    "smoothing_range": ({"label_smoothing": -0.1}, ValueError),
    "smoothing_str": ({"label_smoothing": "0.1"}, TypeError),
    "zloss_nan": ({"lse_square_scale": float("nan")}, ValueError),
    "softcap_neg": ({"softcap": -30.0}, ValueError),
    "softcap_inf": ({"softcap": float("inf")}, ValueError),
    "ignore_float": ({"ignore_index": -100.0}, TypeError),
    "ignore_wide": ({"ignore_index": -(2 ** 64)}, ValueError),
    "chunk_0": ({"chunk_size": 0}, ValueError),
    "chunk_float": ({"chunk_size": 2.7}, TypeError),
    "chunk_bool": ({"chunk_size": True}, TypeError),
    "accum_int": ({"accum_dtype": torch.int64}, TypeError),
    "accum_str": ({"accum_dtype": "float32"}, TypeError),
    "backend": ({"backend": "Triton"}, ValueError),
    "ce_weight_2d": ({"ce_weight": torch.ones(1, V)}, ValueError),
    "ce_weight_int": ({"ce_weight": torch.ones(V, dtype=torch.int32)}, TypeError),
}


@pytest.mark.parametrize("name", list(BAD_OPTIONS))
def test_module_checks_options_at_construction(name):
    kw, exc = BAD_OPTIONS[name]
    with pytest.raises(exc) as at_init:
        fusedce.LinearCrossEntropyLoss(**kw)
    hidden, weight, _ = make_linear((4,), H, V)
    target = make_target((4,), V)
    options = {k: v for k, v in kw.items() if k != "ce_weight"}
    with pytest.raises(exc) as at_call:
        fusedce.linear_cross_entropy(hidden, weight, target, ce_weight=kw.get("ce_weight"),
                                     **{"backend": "torch", **options})
    if name != "ce_weight_2d":   # the function names V in its message, the constructor cannot know it
        assert str(at_init.value) == str(at_call.value)
    else:
        assert all("ce_weight must have shape" in str(e.value) for e in (at_init, at_call))


def test_module_valid_options_accepted():
    for kw in ({}, {"backend": "triton"}, {"chunk_size": np.int64(4), "accum_dtype": torch.float64},
               {"ce_weight": make_weight(V), "ignore_index": torch.tensor(-1), "label_smoothing": 1.0}):
        fusedce.LinearCrossEntropyLoss(**kw)


def test_weight_keyword_points_to_ce_weight():
    """Issue 27 item 9: ``LinearCrossEntropyLoss(weight=...)`` named no alternative (the function does)."""
    with pytest.raises(TypeError, match=r"forward's second argument; class weights of the loss are `ce_weight=`"):
        fusedce.LinearCrossEntropyLoss(weight=torch.ones(4))
