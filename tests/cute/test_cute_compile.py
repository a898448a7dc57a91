"""backend="cute": every CuTe DSL kernel compiles for Hopper (sm_90a) and Blackwell (sm_100a) without a
GPU, and ``fusedce inspect --cute`` reports them.

There is no CPU emulation of CuTe DSL kernels, so on this machine the kernels are only compiled (fake
tensors with dynamic BT and V, ``backends/cute/compile.py``) and their PTX / ptxas report checked; the
numerics are checked on a GPU by tests/cute/test_cute_gpu.py. ``fusedce inspect --cute`` compiles them in one
fresh process per arch (the DSL reads the target from ``$CUTE_DSL_ARCH`` at trace time); the command itself
runs in ``inspect_cli``'s child Python, since this process has ``TRITON_INTERPRET=1``.

Variants: per kernel plain, each constexpr flag alone and all flags in bf16 with 128-bit vectors (V and
row strides multiples of 8, e.g. Llama-3's 128256), plus plain / all in fp32 and fp16, and the scalar
variant (vec 1) that odd vocabularies such as GPT-2's 50257 get, and the on-chip fused chunk kernel with
every flag on one CTA and on a cluster of 8 CTAs. ``make test-cute`` compiles every flag combination
and the on-chip kernel's variant set (FUSEDCE_CUTE_EVERY=1). Every compiled variant must be free of
spills and local memory.
"""
import json
import os

import pytest

from inspect_cli import inspect_command

pytest.importorskip("cutlass", reason="the cute extra (nvidia-cutlass-dsl) is not installed: "
                                      "pip install -e '.[cute]' or make test-cute")

EVERY = os.environ.get("FUSEDCE_CUTE_EVERY", "") not in ("", "0")
FULL_VEC = {"fp32": 4, "bf16": 8, "fp16": 8}


def _inspect(tmp_path, arch: str) -> dict:
    out = tmp_path / "inspect.json"
    argv = ["--arch", arch, "--kernel", "forward", "--variant", "plain", "--dtype", "bf16", "--vocab", "32000",
            "--cute", "--json", str(out)] + (["--every-variant"] if EVERY else [])
    rc, stdout, stderr = inspect_command(*argv)   # the CuTe half runs in a fresh process per arch (cute_report.py)
    assert rc == 0, stdout + stderr
    assert "CuTe DSL kernels" in stdout and "CuTe variants" in stdout, stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize("arch", ["90", "100"])
def test_every_cute_variant_compiles(tmp_path, arch):
    rows = _inspect(tmp_path, arch)["cute_rows"]
    from fusedce.backends.cute.variants import check_keys, quick_keys
    assert len(rows) == len(check_keys() if EVERY else quick_keys())
    assert {r["arch"] for r in rows} == {f"sm_{arch}a"}
    assert any(r["kernel"] == "onchip" and r["cluster"] > 1 for r in rows)   # the cluster path is compiled
    for r in rows:
        name = f"{r['arch']} {r['kernel']} {r['variant']} {r['dtype']} vec={r['vec']}"
        assert not r["error"], (name, r["error"])
        assert r["has_cubin"] and r["regs"], (name, r)
        # no spill and no local memory in any variant, scalar and on-chip ones included
        assert r["spill_bytes"] == 0 and not r["local"], (name, "spills", r)
        if r["vec"] == FULL_VEC[r["dtype"]]:
            # the logits (and gradient) streams are 128-bit; the only 16-bit load is the target logit.
            # The on-chip chunk kernel streams its logits with 16-byte cp.async into shared memory.
            assert (r["cp16"] if r["kernel"] == "onchip" else r["ld128"]) >= 1, (name, r)
            if r["kernel"] != "forward":
                assert r["st128"] >= 1, (name, r)
