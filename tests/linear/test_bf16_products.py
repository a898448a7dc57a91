"""``core/bf16_products.exact_bf16_gemms`` (issue 32): fp32 GEMMs of bf16 values on the CPU's bf16 units.

What must hold: the mode is switched only for bf16 CPU operands and restored after (also on error), the
caller's own choice is left alone, and the GEMMs it covers stay fp32 sums of exact products: within
``H u A`` of float64 (``u = 2^-24``, ``A = sum_k |a_k b_k|``, Higham's gamma_H), a bound that a bf16
rounding of any operand or of the result (2^-9 relative) misses by far. Shapes are large enough for
torch to hand the fp32 GEMM to oneDNN (tiny ones stay on its own kernel, where the mode does nothing).
"""
from __future__ import annotations

import pytest
import torch

import fusedce
from fusedce.core import bf16_products
from fusedce.core.bf16_products import applies, exact_bf16_gemms
from fusedce.lm_head import fp32_linear, loop

KNOB = torch.backends.mkldnn.matmul
ENGAGES = applies(torch.zeros(1, dtype=torch.bfloat16))   # the mode engages on this CPU (measured)
U32 = 2.0 ** -24


@pytest.fixture(autouse=True)
def _default_precision():
    before = KNOB.fp32_precision
    KNOB.fp32_precision = "none"
    yield
    KNOB.fp32_precision = before


def _mode_is_on() -> bool:
    """Whether fp32 GEMMs run in bf16 math right now: a product of NON-bf16 fp32 data loses digits. The
    shape is one that torch hands to oneDNN in every version tried (torch 2.11 keeps 64 x 256 x 64 on MKL,
    where the mode does nothing; torch 2.13 sends it to oneDNN)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(128, 576, generator=g), torch.randn(576, 512, generator=g)
    return ((a @ b).double() - a.double() @ b.double()).abs().max().item() > 1e-3


def test_switches_for_bf16_cpu_operands_and_restores():
    bf = torch.zeros(2, 2, dtype=torch.bfloat16)
    with exact_bf16_gemms(bf, bf):
        assert KNOB.fp32_precision == ("bf16" if ENGAGES else "none")
        assert _mode_is_on() == ENGAGES
    assert KNOB.fp32_precision == "none" and not _mode_is_on()


def test_the_decision_is_what_this_cpu_does():
    """Issue 46 item 8: the library's belief (``ENGAGES``) is what the mode does on this CPU, whatever it has
    (AMX, AVX512-BF16 only, neither, AMD): set by hand, the mode loses digits exactly where the library says it
    engages. The probe leaves the setting as it found it."""
    caps = bf16_products.cpu_bf16_capabilities()
    assert set(caps) == {"cpu", "amx", "avx512_bf16", "bf16_gemm_mode"} and caps["bf16_gemm_mode"] == ENGAGES
    assert KNOB.fp32_precision == "none"
    KNOB.fp32_precision = "bf16"
    assert _mode_is_on() == ENGAGES
    KNOB.fp32_precision = "none"
    assert not ENGAGES or caps["amx"] or caps["avx512_bf16"]


@pytest.mark.parametrize("engages", [False, True])
def test_the_switch_follows_the_measured_decision(monkeypatch, engages):
    """The switch obeys the measurement, not the CPU flags: a CPU that reports bf16 support but where the
    probe shows no bf16 math keeps the setting untouched (the AVX512-BF16-without-AMX Xeon of issue 46)."""
    monkeypatch.setattr(bf16_products, "_cpu_has_bf16_units", lambda: engages)
    bf = torch.zeros(2, 2, dtype=torch.bfloat16)
    with exact_bf16_gemms(bf, bf):
        assert KNOB.fp32_precision == ("bf16" if engages else "none")
    assert KNOB.fp32_precision == "none"


def test_a_probe_that_shows_no_bf16_math_means_no_switch(monkeypatch):
    monkeypatch.setattr(bf16_products, "_probe_mode_engages", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    bf16_products.cpu_bf16_capabilities.cache_clear()
    try:
        caps = bf16_products.cpu_bf16_capabilities()
        assert caps["avx512_bf16"] and not caps["bf16_gemm_mode"] and not applies(torch.zeros(1, dtype=torch.bfloat16))
    finally:
        bf16_products.cpu_bf16_capabilities.cache_clear()


def test_restores_after_an_error():
    bf = torch.zeros(2, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="inside"):
        with exact_bf16_gemms(bf):
            raise RuntimeError("inside")
    assert KNOB.fp32_precision == "none"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes_leave_the_mode_alone(dtype):
    """fp16 values are not bf16 values (more significand bits): converting them would round."""
    x = torch.zeros(2, 2, dtype=dtype)
    with exact_bf16_gemms(x, torch.zeros(2, 2, dtype=torch.bfloat16)):
        assert KNOB.fp32_precision == "none"


def test_meta_tensors_and_the_opt_out_leave_the_mode_alone(monkeypatch):
    with exact_bf16_gemms(torch.zeros(2, 2, dtype=torch.bfloat16, device="meta")):
        assert KNOB.fp32_precision == "none"
    monkeypatch.setattr(bf16_products, "ENABLED", False)
    with exact_bf16_gemms(torch.zeros(2, 2, dtype=torch.bfloat16)):
        assert KNOB.fp32_precision == "none"


def test_the_callers_own_choice_is_kept():
    KNOB.fp32_precision = "tf32"
    with exact_bf16_gemms(torch.zeros(2, 2, dtype=torch.bfloat16)):
        assert KNOB.fp32_precision == "tf32"
    assert KNOB.fp32_precision == "tf32"


def _within_gamma(out: torch.Tensor, a64: torch.Tensor, b64: torch.Tensor, extra: float = 0.0) -> None:
    exact = a64 @ b64
    bound = a64.shape[1] * U32 * (a64.abs() @ b64.abs()) + extra
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"worst error / bound {(err / bound.clamp_min(1e-300)).max().item():.3g}"


def test_fp32_logits_of_bf16_operands_stay_exact_sums():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 256, generator=g).bfloat16()
    w = (torch.randn(3000, 256, generator=g) * 0.1).bfloat16()
    out = fp32_linear.linear_fp32_(h, w, None, torch.empty(64, 3000), False)
    _within_gamma(out, h.double(), w.double().T)
    assert KNOB.fp32_precision == "none"


@pytest.mark.parametrize("scalar_fallback", [False, True])
def test_weight_gradient_of_a_bf16_chunk_stays_an_exact_sum(monkeypatch, scalar_fallback):
    """``backprop_chunk_`` with an fp32 chunk gradient of bf16 operands (the default fp32 logits): the
    gradient is rounded to bf16 once (as stock), then ``grad_W += g.T @ h`` sums the exact products in
    fp32; ``g`` itself holds the rounded values after (the documented in-place write)."""
    monkeypatch.setattr(bf16_products, "_scalar_fallback", lambda dtype: scalar_fallback)
    gen = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = 96, 256, 2000
    h = torch.randn(n, hidden_size, generator=gen).bfloat16()
    w = torch.randn(vocab, hidden_size, generator=gen).bfloat16()
    g = torch.randn(n, vocab, generator=gen) * 1e-3
    rounded = g.bfloat16()
    grad_h = torch.empty(n, hidden_size, dtype=torch.bfloat16)
    grad_w = torch.full((vocab, hidden_size), 0.5)
    loop.backprop_chunk_(g, h, w, slice(0, n), grad_h, grad_w, None)
    assert torch.equal(g, rounded.float())
    # into an existing 0.5: one more rounding at 0.5's scale (half an ulp, 2^-25); the - 0.5 is exact (Sterbenz)
    _within_gamma(grad_w - 0.5, rounded.double().T, h.double(), extra=2.0 ** -25)
    if scalar_fallback:   # one weight block (2000 rows): the fp32 GEMM of the same values, rounded once
        assert torch.equal(grad_h, (rounded.float() @ w.float()).bfloat16())
    else:
        assert torch.equal(grad_h, rounded @ w)                      # the bf16 GEMM, as stock's backward


def test_scalar_fallback_is_what_torch_reports():
    """The upcast GEMMs engage exactly where oneDNN has no kernel for the dtype on this CPU (torch's own
    bf16 / fp16 GEMM is then its scalar fallback, ~30x an fp32 GEMM of the same values)."""
    for dtype, probe in ((torch.bfloat16, torch.ops.mkldnn._is_mkldnn_bf16_supported),
                         (torch.float16, torch.ops.mkldnn._is_mkldnn_fp16_supported)):
        t = torch.zeros(1, dtype=dtype)
        assert bf16_products.upcast_gemms(t, t) == (not probe())
    assert not bf16_products.upcast_gemms(torch.zeros(1), torch.zeros(1))          # fp32: never
    assert not bf16_products.upcast_gemms(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1))   # mixed: never


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_upcast_hidden_gradient_within_one_rounding_of_float64(monkeypatch, dtype):
    """The fallback's hidden gradient over several weight blocks (forced small) is the float64 product
    within fp32 summation error plus the one final rounding to ``dtype`` (half an ulp): as accurate as a
    native low-precision GEMM with fp32 accumulation; the logits of ``logits="input"`` likewise."""
    monkeypatch.setattr(bf16_products, "_scalar_fallback", lambda dt: True)
    monkeypatch.setattr(fp32_linear, "BLOCK_ELEMENTS", 256 * 300)   # 300-row weight blocks: 7 of them
    gen = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = 40, 256, 2000
    h = torch.randn(n, hidden_size, generator=gen).to(dtype)
    w = torch.randn(vocab, hidden_size, generator=gen).to(dtype)
    g = (torch.randn(n, vocab, generator=gen) * 1e-3).to(dtype).float()
    grad_h = torch.empty(n, hidden_size, dtype=dtype)
    loop.backprop_chunk_(g.clone(), h, w, slice(0, n), grad_h, None, None)
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11   # the dtype's unit roundoff (half an ulp)

    def within(got, exact, size, terms):
        summed = terms * U32 * size * 1.01                       # fp32 summation (gamma_terms)
        return ((got.double() - exact).abs() <= u * (exact.abs() + summed) + summed).all()
    assert within(grad_h, g.double() @ w.double(), g.double().abs() @ w.double().abs(), vocab)
    logits = loop.logits_chunk(h, w, None, logits="input")
    assert logits.dtype == dtype
    assert within(logits, h.double() @ w.double().T, h.double().abs() @ w.double().abs().T, hidden_size)
    # the bound is tight enough to fail: an fp32 result is not within it for a coarser rounding (2 ulps)
    assert not within(logits.double() * (1 + 4 * u), h.double() @ w.double().T, h.double().abs() @ w.double().abs().T,
                      hidden_size)



@pytest.mark.parametrize("smoothing_with_class_weights", [False, True])
def test_tiled_forward_modes(monkeypatch, smoothing_with_class_weights):
    """The tiled forward's block logits (bf16 values) run in the mode; never its row math's own product of
    fp32 values, the smoothing sum ``z @ w`` with class weights: the mode seen by every block's row math
    is recorded (and restored after the call)."""
    from fusedce.backends.pytorch import tiled
    seen = []
    add = tiled._Running.add

    def spy(self, *args):
        seen.append(KNOB.fp32_precision)
        return add(self, *args)

    monkeypatch.setattr(tiled._Running, "add", spy)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(20, 16, generator=gen).bfloat16()
    w = torch.randn(300, 16, generator=gen).bfloat16()
    target = torch.randint(0, 300, (20,), generator=gen)
    kw = dict(ce_weight=torch.rand(300, generator=gen) + 0.5, label_smoothing=0.1) if smoothing_with_class_weights \
        else {}
    fusedce.linear_cross_entropy(h, w, target, backend="torch", method="tiled", **kw)
    assert seen and KNOB.fp32_precision == "none"
    assert set(seen) == {"bf16" if ENGAGES and not smoothing_with_class_weights else "none"}
