"""``fusedce inspect``: the Triton kernels compile for real GPUs, without spills, with 128-bit accesses.

The interpreter (which every other Triton test uses) never runs Triton's GPU code generator, so a kernel
can pass every CPU test and still fail to compile for a GPU (it happened: two ``return`` statements of
different types in ``softcap_slope``), spill registers, or read the logits one 16-bit element at a time.
These tests compile the launches offline for sm_90 (H100 / H200) and sm_100 (B200) with Triton's bundled
ptxas. They run the command in a child Python (``support/inspect_cli.py``, one per test process) because
this test process has ``TRITON_INTERPRET=1`` (conftest.py), under which ``@triton.jit`` gives interpreted
functions that cannot be compiled.

Shapes: V = 32000 (Llama-2, a multiple of 16: Triton's own specialization applies); V = 128256
(Llama-3); V = 1000 (a 32-way vocabulary shard of 32000: V % 16 == 8, so 128-bit bf16 accesses rely on
the kernels' ALIGN hint); V = 50257 (GPT-2, odd: rows are unaligned, scalar access is the right answer).
"""

import pytest

from fusedce.tools.inspect.compile import access_bits
from inspect_cli import _inspect


# the row kernels (streaming rules apply); the tiled LM-head kernels have their own test below
ROW_KERNELS = ("--kernel", "forward", "--kernel", "backward", "--kernel", "chunk", "--kernel", "slice")


def _assert_clean(row):
    name = f"sm_{row['arch']} {row['kernel']} {row['variant']} {row['dtype']} V={row['vocab']}"
    assert not row["error"], (name, row["error"])
    assert row["spill_bytes"] == 0 and row["local"] == 0, (name, "spills", row)
    assert row["ld128"] >= row["ld128_needed"], (name, "logit loads not 128-bit", row)
    assert row["st128"] >= row["st128_needed"], (name, "gradient stores not 128-bit", row)
    if row["dtype"] == "bf16":
        # The only 16-bit load allowed is the gather of the target logit (forward and fused chunk).
        assert row["ld_bits"].get("16", 0) <= (0 if row["kernel"] == "backward" else 1), (name, row)


def test_every_flag_combination_compiles_bf16_sm90(tmp_path):
    """All 16 forward, 16 backward (HAS_GRAD_LSE for the z-loss too), 64 fused-chunk (z-loss and token
    scaling too) and 8 slice-statistics constexpr flag combinations: compile, no spill, 128-bit (~35 s)."""
    rows = _inspect(tmp_path, "--arch", "90", "--dtype", "bf16", "--vocab", "32000", "--every-variant",
                    "--strict", *ROW_KERNELS)
    assert len(rows) == 16 + 16 + 64 + 8
    for row in rows:
        _assert_clean(row)


@pytest.mark.parametrize("arch", ["90", "100"])
def test_vocab_alignment_bf16_fp32(tmp_path, arch):
    """V % 16 == 8 (ALIGN path) and Llama-3's V: clean on Hopper and Blackwell; odd V: scalar access
    (unaligned rows), still no spills. sm_100 is skipped only if the installed Triton can't target it.
    Blackwell in bf16 only: the fp32 rows' alignment rule is the same code whatever the arch (checked on
    sm_90), the arch's code generation is what sm_100 adds."""
    dtypes = ("--dtype", "bf16") if arch == "100" else ()
    rows = _inspect(tmp_path, "--arch", arch, "--vocab", "1000", "--vocab", "128256", "--vocab", "50257",
                    "--variant", "plain", "--variant", "all", *dtypes, *ROW_KERNELS)
    if not rows:
        pytest.skip(f"the installed Triton cannot compile for sm_{arch}")
    assert len(rows) == 4 * 2 * 3 * (1 if dtypes else 2)   # kernels x variants x vocabularies x dtypes
    for row in rows:
        if row["vocab"] == 50257:
            assert not row["error"] and row["spill_bytes"] == 0 and not row["aligned_rows"], row
        else:
            _assert_clean(row)
            assert row["align"] == (8 if row["dtype"] == "bf16" else 4), row


def test_access_bits_parses_ptx_widths():
    ptx = """
    ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p1 ld.global.nc.L1::evict_last.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd2 + 0 ];
    ld.global.b16 %rs1, [ %rd3 + 0 ];
    ld.global.b64 %rd4, [ %rd5 + 0 ];
    st.global.v2.b32 [ %rd6 + 0 ], { %r9, %r10 };
    """
    assert access_bits(ptx) == {"ld": {128: 2, 16: 1, 64: 1}, "st": {64: 1}}


def test_entropy_and_tiled_kernels_sm90(tmp_path):
    """The RL entropy variants of the row kernels (COMPUTE_ENTROPY / HAS_GRAD_ENTROPY) are as clean as the
    CE ones; the tiled LM-head kernels (hidden (8192, 4096) x weight (32000, 4096)) compile for sm_90, their
    bf16 dots lower to Hopper warpgroup MMA (wgmma) without spills, their fp32 dots to FMA (IEEE fp32,
    as F.linear without TF32)."""
    rows = _inspect(tmp_path, "--arch", "90", "--vocab", "32000", "--kernel", "forward", "--kernel", "backward",
                    "--kernel", "tiled_forward", "--kernel", "tiled_backward", "--variant", "entropy",
                    "--variant", "entropy+softcap", "--variant", "plain", "--variant", "all")
    entropy_rows = [r for r in rows if r["kernel"] in ("forward", "backward") and r["variant"].startswith("entropy")]
    assert len(entropy_rows) == 2 * 2 * 2      # kernels x variants x dtypes
    for row in entropy_rows:
        _assert_clean(row)
    tiled = [r for r in rows if r["kernel"].startswith("tiled")]
    assert len(tiled) == 2 * 3 * 2             # kernels x (plain, entropy, all) x dtypes
    for row in tiled:
        name = f"{row['kernel']} {row['variant']} {row['dtype']}"
        assert not row["error"], (name, row["error"])
        assert row["mma"] == ("wgmma" if row["dtype"] == "bf16" else "none"), (name, row["mma"])
        if row["dtype"] == "bf16":
            assert row["spill_bytes"] == 0 and row["local"] == 0, (name, row)


def test_deterministic_tiled_kernels_sm90(tmp_path):
    """The deterministic tiled backward (``tiled_grad_hidden`` / ``tiled_grad_weight``, issue 18) compiles
    for sm_90 with every option at bf16 (hidden (8192, 4096) x weight (32000, 4096)): wgmma, no spills and
    no atomic instruction in its PTX, while the atomic backward has them (so the count is not vacuous)."""
    rows = _inspect(tmp_path, "--arch", "90", "--vocab", "32000", "--dtype", "bf16", "--variant", "all",
                    "--kernel", "tiled_backward", "--kernel", "tiled_grad_hidden", "--kernel", "tiled_grad_weight")
    by_kernel = {r["kernel"]: r for r in rows}
    assert sorted(by_kernel) == ["tiled_backward", "tiled_grad_hidden", "tiled_grad_weight"]
    assert by_kernel["tiled_backward"]["atomics"] > 0 and not by_kernel["tiled_backward"]["problem"]
    for name in ("tiled_grad_hidden", "tiled_grad_weight"):
        row = by_kernel[name]
        assert not row["error"], (name, row["error"])
        assert row["mma"] == "wgmma" and row["atomics"] == 0, (name, row)
        assert row["spill_bytes"] == 0 and row["local"] == 0 and not row["problem"], (name, row)


def test_kernels_take_the_loss_options_as_two_arguments():
    """Every kernel takes the loss options as ``scalars`` (a runtime ``LossScalars``) and ``FLAGS`` (a
    constexpr ``LossFlags``), never one parameter per option, so a new element-wise option changes no
    kernel signature and no launcher; the launches (as ``fusedce inspect`` builds them) pass exactly the
    options' ``kernel_scalars()`` / ``kernel_flags(has_weight)``."""
    import inspect

    from fusedce.tools.inspect.variants import DTYPES, KERNELS, every_variant, launch
    from fusedce.core.options import LossFlags, LossScalars

    option_names = set(LossScalars._fields) | set(LossFlags._fields)
    for kernel in KERNELS:
        for name, variant in every_variant(kernel).items():
            fn, _grid, args, meta = launch(kernel, DTYPES["bf16"], 1000, variant, rows=64)
            params = list(inspect.signature(getattr(fn, "fn", fn)).parameters)
            assert "scalars" in params and "FLAGS" in params, (kernel, params)
            assert not option_names & set(params), (kernel, option_names & set(params))
            assert [a for a in args if isinstance(a, LossScalars)] == [variant.options().kernel_scalars()]
            assert args[params.index("scalars")] == variant.options().kernel_scalars(), (kernel, name)
            assert isinstance(meta["FLAGS"], LossFlags) and meta["FLAGS"] == variant.flags(), (kernel, name)


def test_soft_target_kernels_sm90(tmp_path):
    """The probability-target kernels (``probs_forward`` / ``probs_backward``; the target streamed next to
    the logits, in their dtype here): all 16 constexpr flag combinations of each compile for sm_90 in bf16
    without spills, every stream 128-bit (logits, target, class weights; the gradient's stores)."""
    rows = _inspect(tmp_path, "--arch", "90", "--dtype", "bf16", "--vocab", "32000", "--every-variant", "--strict",
                    "--kernel", "probs_forward", "--kernel", "probs_backward")
    assert len(rows) == 16 + 16
    for row in rows:
        _assert_clean(row)
