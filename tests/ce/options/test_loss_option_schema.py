"""The loss options have one description (``fusedce.core.options.LossOptions``): every public signature,
docstring, check, custom-op argument list and kernel argument is derived from it. These tests fail when a
public entry point, the type checkers' ``LossOptionValues`` or a kernel's parameter list drifts from it
(docs/architecture.md's "Adding a loss option" relies on that)."""
from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest
import torch

import fusedce
from fusedce.integrations.hf import patch as hf
from fusedce.distributed import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from fusedce.core.options import LossFlags, LossOptions, LossOptionValues, LossScalars

FIELDS = [f for f in dataclasses.fields(LossOptions)]
NAMES = [f.name for f in FIELDS]
ENTRY_POINTS = [fusedce.cross_entropy, fusedce.linear_cross_entropy, vocab_parallel_cross_entropy,
                vocab_parallel_linear_cross_entropy, fusedce.CrossEntropyLoss, fusedce.LinearCrossEntropyLoss]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda e: e.__name__)
def test_every_entry_point_lists_every_option(entry):
    """Each option appears in the signature (keyword-capable, the field's default) and in the doc."""
    params = inspect.signature(entry).parameters
    for f in FIELDS:
        assert f.name in params, f"{entry.__name__} lacks the loss option {f.name}"
        p = params[f.name]
        assert p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        assert p.default == f.default, (entry.__name__, f.name)
        assert f.metadata["doc"].split()[0] in entry.__doc__, (entry.__name__, f.name)
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())


def test_hf_patch_takes_every_option():
    assert set(NAMES) <= set(hf.LOSS_OPTIONS)


def test_typed_dict_mirrors_the_fields():
    """``LossOptionValues`` (for static type checkers) has exactly the fields, with their types."""
    hints = typing.get_type_hints(LossOptionValues)
    assert list(hints) == NAMES
    assert LossOptionValues.__total__ is False


@pytest.mark.parametrize("entry", ENTRY_POINTS[:2] + ENTRY_POINTS[4:], ids=lambda e: e.__name__)
def test_unknown_keyword_is_a_type_error(entry):
    x, t = torch.randn(3, 5), torch.randint(0, 5, (3,))
    with pytest.raises(TypeError, match="label_smoothin"):
        if entry is fusedce.cross_entropy:
            entry(x, t, label_smoothin=0.1)
        elif entry is fusedce.linear_cross_entropy:
            entry(x, torch.randn(5, 5), t, label_smoothin=0.1)
        else:
            entry(label_smoothin=0.1)


def test_each_field_is_checked():
    """Every field's check rejects a value of the wrong kind (a string) with ``TypeError``."""
    for name in NAMES:
        with pytest.raises(TypeError, match=name):
            LossOptions.checked(**{name: "1"})


OPTION_SETS = [
    {},
    {"label_smoothing": 0.1, "softcap": 30.0},
    {"ignore_index": 7, "lse_square_scale": 1e-4, "logit_scale": 0.25, "use_token_scaling": True},
    {"ignore_index": -(2 ** 40), "softcap": 1e-3},
]


@pytest.mark.parametrize("values", OPTION_SETS)
def test_op_args_round_trip(values):
    """The custom ops' argument form comes back to the same options (every field, every type)."""
    opts = LossOptions.checked(**values)
    ignore_index, scalars = opts.op_args()
    assert isinstance(ignore_index, int) and all(isinstance(s, float) for s in scalars)
    assert LossOptions.from_op_args(ignore_index, scalars) == opts


@pytest.mark.parametrize("values", OPTION_SETS)
def test_kernel_arguments(values):
    """The kernels' two option arguments: runtime scalars (softcap 1.0 when unused) and flags."""
    opts = LossOptions.checked(**values)
    scalars, flags = opts.kernel_scalars(), opts.kernel_flags(True)
    assert isinstance(scalars, LossScalars) and isinstance(flags, LossFlags)
    assert scalars.softcap == (1.0 if opts.softcap is None else opts.softcap)
    assert flags == (True, opts.label_smoothing > 0.0, opts.softcap is not None)
    for name in set(LossScalars._fields) & set(NAMES) - {"softcap"}:
        assert getattr(scalars, name) == getattr(opts, name)


def _params(fn) -> list:
    """Parameter names of a kernel: a Triton ``JITFunction`` / interpreted function, or a Python function."""
    fn = getattr(fn, "fn", fn)
    return list(inspect.signature(fn).parameters)


OPTION_PARAMS = set(NAMES) | set(LossFlags._fields) | {"eps", "lse_square_scale"}


def test_no_triton_kernel_names_a_loss_option():
    """Every Triton kernel takes the options as ``scalars`` and ``FLAGS`` only, so a new option changes
    no kernel parameter list (docs/architecture.md, "Adding a loss option")."""
    from fusedce.backends.triton.kernels import ce_backward, ce_chunk, ce_forward, ce_slice, tiled_backward, \
        tiled_forward
    kernels = [ce_forward.ce_forward_kernel, ce_backward.ce_backward_kernel, ce_chunk.ce_chunk_kernel,
               ce_slice.ce_slice_stats_kernel, tiled_forward.tiled_forward_kernel,
               tiled_backward.tiled_backward_kernel]
    for kernel in kernels:
        params = _params(kernel)
        assert {"scalars", "FLAGS"} <= set(params), (kernel, params)
        assert not OPTION_PARAMS & set(params), (kernel, OPTION_PARAMS & set(params))


def test_no_cute_kernel_names_a_loss_option():
    """The same for the CuTe kernels' ``__call__`` and ``kernel`` (their flags: the constructor's ``FLAGS``)."""
    pytest.importorskip("cutlass")
    from fusedce.backends.cute.kernels.ce_backward import CEBackward
    from fusedce.backends.cute.kernels.ce_chunk import CEChunk
    from fusedce.backends.cute.kernels.ce_chunk_onchip import CEChunkOnChip
    from fusedce.backends.cute.kernels.ce_forward import CEForward
    for cls in (CEForward, CEBackward, CEChunk, CEChunkOnChip):
        for method in (cls.__call__, cls.kernel, cls.__init__):
            params = set(_params(inspect.unwrap(method)))
            assert not OPTION_PARAMS & params, (cls.__name__, method.__name__, OPTION_PARAMS & params)
        assert "scalars" in _params(inspect.unwrap(cls.__call__))
        assert "FLAGS" in _params(cls.__init__)


@pytest.mark.parametrize("value", [1e-50, 1e-39, 1e39])
def test_softcap_outside_normal_fp32_is_a_value_error(value):
    """A softcap that fp32 rounds to 0 (or a subnormal, or beyond fp32) would give NaN gradients."""
    x, t = torch.randn(2, 5), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="softcap must be a finite number > 0, a normal fp32"):
        fusedce.cross_entropy(x, t, softcap=value)


def test_num_items_tensor_that_requires_grad_is_a_type_error():
    x, t = torch.randn(2, 5), torch.tensor([0, 1])
    with pytest.raises(TypeError, match="num_items_in_batch is a constant"):
        fusedce.cross_entropy(x, t, num_items_in_batch=torch.tensor(3.0, requires_grad=True))


def test_tensor_option_under_fullgraph_compile_names_the_option():
    """Under torch.compile a tensor option's value cannot be checked: a TypeError naming it (Dynamo
    reports it in its message), instead of an internal error; eager mode accepts the tensor."""
    x, t = torch.randn(4, 7), torch.tensor([0, 1, 2, 3])
    fn = torch.compile(lambda x, t, s: fusedce.cross_entropy(x, t, label_smoothing=s, backend="torch"),
                       fullgraph=True)
    with pytest.raises(Exception, match="label_smoothing: pass a Python number under torch.compile"):
        fn(x, t, torch.tensor(0.1))
    eager = fusedce.cross_entropy(x, t, label_smoothing=torch.tensor(0.1), backend="torch")
    assert torch.allclose(eager, torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1))


def test_module_repr_shows_the_options_that_differ_from_their_defaults():
    m = fusedce.CrossEntropyLoss(None, -1, "sum", 0.1, logit_scale=2.0, backend="torch")
    assert repr(m) == ("CrossEntropyLoss(reduction='sum', ignore_index=-1, label_smoothing=0.1, "
                       "logit_scale=2.0, backend='torch')")
    m.label_smoothing = 0.0   # an attribute changed later is shown as it is now
    assert "label_smoothing" not in repr(m)
    lin = fusedce.LinearCrossEntropyLoss(softcap=30.0, method="tiled")
    assert repr(lin) == "LinearCrossEntropyLoss(reduction='mean', softcap=30.0, method='tiled')"
