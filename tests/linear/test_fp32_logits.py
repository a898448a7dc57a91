"""fp32 logits from bf16 / fp16 LM heads (the contract's 2026-12-02 addition): every linear op forms its
logits in fp32 from the operands' values, so its per-row results are within fp32 rounding of float64
of the SAME bf16 / fp16 values, on both backends and both methods, with no fp32 copy of the weight.

The bound. A logit ``z_c = sum_k h_k w_ck`` of bf16 / fp16 values: every product is exact in fp32, the
H-term sum carries at most ``H u A_c`` (``u = 2^-24``, ``A_c = sum_k |h_k w_ck|``, Higham's gamma_H);
the log-softmax and entropy of those logits add ``tolerances.FP32_UNITS u M`` (``M = 1 + max(|lse|, |z|)``,
``tolerances.py``). So each row's error is within ``FP32_UNITS u (M + A)`` with ``A = max_c A_c`` and
``H <= FP32_UNITS``. Shapes: H = 48 (under FP32_UNITS, so the gamma_H term is covered), V = 300 (the
tiled methods' blocks are smaller, so several vocabulary blocks), BT = 20 with every 7th row ignored.
The opt-out ``logits_dtype="input"`` (the stock composition's rounding) is checked to miss that bound,
so the bound tells the two apart.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedce
from fusedce.lm_head import fp32_linear
from inputs import make_target
from reference64_log_probs import reference_log_probs
from tolerances import FP32_UNITS, U32

BT, H, V = 20, 48, 300
LOW = (torch.bfloat16, torch.float16)
METHODS = ("chunked", "tiled")


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BT, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)   # logits of order 3: bf16 rounds them by ~1e-2
    return hidden, weight, make_target((BT,), V, ignore_every=7)


def _bound(hidden, weight):
    """Per-row ``FP32_UNITS u (M + A)`` (module docstring), from the float64 values."""
    h64, w64 = hidden.double(), weight.double()
    z = h64 @ w64.T
    lse = torch.logsumexp(z, dim=1)
    m = 1.0 + torch.maximum(lse.abs(), z.abs().amax(dim=1))
    a = (h64.abs() @ w64.abs().T).amax(dim=1)
    return FP32_UNITS * U32 * (m + a)


def _rows(hidden, weight, target, backend, method, **kw):
    """(log_probs, entropy, cross-entropy rows) of one bf16 / fp16 head, fp32."""
    out = fusedce.linear_token_log_probs(hidden, weight, target, return_entropy=True, backend=backend,
                                         method=method, **kw)
    ce = fusedce.linear_cross_entropy(hidden, weight, target, reduction="none", backend=backend, method=method,
                                      **kw)
    return out.log_probs, out.entropy, ce


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_rows_within_fp32_rounding_of_float64(backend, method, dtype):
    hidden, weight, target = _operands(dtype)
    log_probs, entropy, ce = _rows(hidden, weight, target, backend, method)
    ref_lp, ref_ent = reference_log_probs(hidden.double() @ weight.double().T, target)
    kept = target != -100
    bound = _bound(hidden, weight)
    for name, got, ref in (("log_probs", log_probs, ref_lp), ("entropy", entropy, ref_ent),
                           ("cross-entropy", ce, torch.where(kept, -ref_lp, 0.0))):
        assert got.dtype == torch.float32
        err = (got.double() - ref).abs()
        assert bool((err <= bound).all()), f"{name}: max error {err.max():.3e}, bound {bound.min():.3e}"


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_input_rounding_opt_out_misses_the_fp32_bound(dtype):
    """``logits_dtype="input"``: the logits rounded to the operands' dtype first, as ``F.linear``; their
    error is that rounding (about 2^-9 |z| in bf16), far above the fp32 bound, and close to the stock
    composition's."""
    hidden, weight, target = _operands(dtype)
    log_probs, _, ce = _rows(hidden, weight, target, "torch", "chunked", logits_dtype="input")
    ref_lp, _ = reference_log_probs(hidden.double() @ weight.double().T, target)
    stock_logits = torch.nn.functional.linear(hidden, weight).float()
    stock = torch.log_softmax(stock_logits, dim=1).gather(1, target.clamp(min=0)[:, None])[:, 0]
    kept = target != -100
    err = (log_probs.double() - ref_lp).abs()[kept]
    stock_err = (stock.double() - ref_lp).abs()[kept]
    assert bool((err > _bound(hidden, weight)[kept]).any())
    assert float(err.max()) <= 2.0 * float(stock_err.max())
    assert torch.equal(ce[kept], -log_probs[kept])


def test_logits_dtype_is_checked():
    hidden, weight, target = _operands(torch.bfloat16)
    for fn in (fusedce.linear_cross_entropy, fusedce.linear_token_log_probs):
        with pytest.raises(ValueError, match="logits_dtype"):
            fn(hidden, weight, target, logits_dtype="bfloat16")
    with pytest.raises(ValueError, match="logits_dtype"):
        fusedce.LinearCrossEntropyLoss(logits_dtype=torch.float32)


def test_input_rounding_with_the_tiled_method_is_refused():
    """A fresh user found ``logits_dtype="input"`` silently ignored by ``method="tiled"`` (its tiles form fp32
    logits): now a ``ValueError`` pointing to ``method="chunked"``, on every entry that takes both."""
    hidden, weight, target = _operands(torch.bfloat16)
    for fn in (fusedce.linear_cross_entropy, fusedce.linear_token_log_probs):
        with pytest.raises(ValueError, match="applies to method='chunked'"):
            fn(hidden, weight, target, method="tiled", logits_dtype="input")
    with pytest.raises(ValueError, match="applies to method='chunked'"):
        fusedce.LinearCrossEntropyLoss(method="tiled", logits_dtype="input")
    pytest.importorskip("transformers")
    from hf_models import build
    with pytest.raises(ValueError, match="applies to method='chunked'"):
        fusedce.patch_causal_lm(build("llama", tied=False), method="tiled", logits_dtype="input")


class _LargestFp32(TorchDispatchMode):
    """Records the largest fp32 tensor any torch op (allocations included) returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("method", METHODS)
def test_forward_never_makes_an_fp32_weight(backend, method, monkeypatch):
    """The forward's fp32 temporaries stay below the weight's size: blocks of the weight are upcast,
    never all of it (``fp32_linear.BLOCK_ELEMENTS`` lowered to a quarter of the weight so that the
    blocks show at this small size; chunks of 8 rows so the chunk's logits are smaller than V x H)."""
    monkeypatch.setattr(fp32_linear, "BLOCK_ELEMENTS", V * H // 4)
    hidden, weight, target = _operands(torch.bfloat16)
    kw = dict(chunk_size=8) if method == "chunked" else {}
    with torch.no_grad(), _LargestFp32() as mode:
        fusedce.linear_token_log_probs(hidden, weight, target, return_entropy=True, backend=backend,
                                       method=method, **kw)
        fusedce.linear_cross_entropy(hidden, weight, target, backend=backend, method=method, **kw)
    assert 0 < mode.largest < V * H


@pytest.mark.parametrize("n_rows, hidden_size, vocab", [(144, 576, 49152), (8, 64, 1000), (4096, 576, 49152),
                                                         (1, 7, 3), (64, 4096, 128256)])
def test_weight_block_is_bounded_by_the_chunk_and_the_cap(n_rows, hidden_size, vocab):
    """Issue 32: the upcast weight block widens to the chunk's own fp32 logits (``n x V``, which the
    backward's weight-gradient step upcasts anyway) but never beyond ``MAX_BLOCK_FACTOR`` base blocks,
    nor below one base block."""
    rows = fp32_linear.weight_block_rows(hidden_size, n_rows, vocab)
    base = fp32_linear.BLOCK_ELEMENTS
    elements = rows * hidden_size
    assert elements <= fp32_linear.MAX_BLOCK_FACTOR * base
    assert elements <= max(base, n_rows * vocab)
    assert rows >= max(1, base // hidden_size)
    wanted = min(max(base, n_rows * vocab), fp32_linear.MAX_BLOCK_FACTOR * base)
    assert elements > wanted - hidden_size   # as wide as allowed, to one weight row


def test_wide_blocks_keep_the_fp32_logits_bits(monkeypatch):
    """The wider blocks change only how the vocabulary is split across GEMMs, never a logit's sum over
    H: the same bits as the base-sized blocks (here the base lowered so that both are several blocks)."""
    torch.manual_seed(0)
    n, hidden_size, vocab = 16, 64, 3000
    h = torch.randn(n, hidden_size).bfloat16()
    w = torch.randn(vocab, hidden_size).bfloat16()
    monkeypatch.setattr(fp32_linear, "BLOCK_ELEMENTS", 64 * 200)
    wide = fp32_linear.linear_fp32_(h, w, None, torch.empty(n, vocab), False)
    assert fp32_linear.weight_block_rows(hidden_size, n, vocab) == 400
    monkeypatch.setattr(fp32_linear, "MAX_BLOCK_FACTOR", 1)
    assert fp32_linear.weight_block_rows(hidden_size, n, vocab) == 200
    narrow = fp32_linear.linear_fp32_(h, w, None, torch.empty(n, vocab), False)
    assert torch.equal(wide, narrow)   # the float64 reference of the values: the tests above
