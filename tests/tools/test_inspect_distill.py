"""``fusedce inspect`` rows of the distillation kernels: each compiles for sm_90 (H100 / H200) without
spills, the deterministic tiled kernels hold no atomic instruction, the tiled kernels' dots run on tensor
cores in bf16, and the row kernel's two logits streams and its gradient stores are 128-bit.

V = 32000 (a multiple of 16: every row aligned); the tiled kernels' H = Ht = 4096
(``inspect/distill_variants.py``). The representative variants: forward KL, reverse KL and the
generalized JSD, each plain and with every option (hard label at T = 2, both softcaps, both biases).
"""
from inspect_cli import _inspect

DISTILL = ("distill_rows", "distill_tiled_stats", "distill_tiled_jsd", "distill_tiled_grad",
           "distill_tiled_grad_hidden", "distill_tiled_grad_weight")


def test_distill_kernels_compile_clean_bf16_sm90(tmp_path):
    argv = [a for k in DISTILL for a in ("--kernel", k)]
    rows = _inspect(tmp_path, "--all", "--arch", "90", "--dtype", "bf16", "--vocab", "32000", "--strict", *argv)
    assert len(rows) == 5 * 6 + 2    # 6 variants per kernel, 2 for the JSD-only pass
    for row in rows:
        name = f"{row['kernel']} {row['variant']}"
        assert not row["error"], (name, row["error"])
        assert row["spill_bytes"] == 0 and row["local"] == 0, (name, row)
        assert row["problem"] == "", (name, row["problem"])
        if row["kernel"] == "distill_rows":
            assert row["ld128"] >= row["ld128_needed"] and row["st128"] >= row["st128_needed"], (name, row)
        else:
            assert row["mma"] == "wgmma", (name, row)
            assert (row["atomics"] > 0) == (row["kernel"] == "distill_tiled_grad"), (name, row)
