"""backend="cute" selection on a machine without CUDA, and the rule that "auto" never picks it."""
import subprocess
import sys

import pytest
import torch

import fusedce
from fusedce import backends


def test_cute_on_cpu_raises_naming_cuda():
    x, t = torch.randn(4, 10), torch.randint(0, 10, (4,))
    with pytest.raises(RuntimeError, match="cute.*CUDA tensors"):
        fusedce.cross_entropy(x, t, backend="cute")
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        fusedce.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), t, backend="cute")


def test_cute_is_a_valid_name():
    backends.check_name("cute")          # no ValueError / RuntimeError at module construction
    fusedce.CrossEntropyLoss(backend="cute")


def test_cute_without_extra_names_the_extra(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cutlass" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"fusedce\[cute\]"):
        backends.resolve("cute", torch.device("cpu"))


def test_auto_never_picks_cute():
    from fusedce.backends.cute import tuning
    assert tuning.AUTO_PICKS_CUTE is False and tuning.VERIFIED_ON_GPU is None
    assert backends.resolve("auto", torch.device("cuda")) == "triton"
    assert backends.resolve("auto", torch.device("cpu")) == "torch"


def test_library_import_does_not_import_cutlass():
    code = ("import sys, fusedce, fusedce.backends.cute, fusedce.backends.cute.variants, "
            "fusedce.backends.cute.tuning; sys.exit(1 if 'cutlass' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_onchip_rule_picks_the_fewest_ctas_whose_slices_fit(monkeypatch):
    """tuning.onchip_cluster: full-width vectors only, the fewest of 1/2/4/8 CTAs whose slices hold at
    most ONCHIP_SLICE_BYTES, None (the two-read kernel) beyond 8 slices; FUSEDCE_CUTE_ONCHIP=0 opts out."""
    from fusedce.backends.cute.tuning import ONCHIP_SLICE_BYTES, onchip_cluster
    assert onchip_cluster(32000, 2, True) == 1                 # 62.5 KiB bf16
    assert onchip_cluster(128256, 2, True) == 4                # Llama-3 bf16, 250.5 KiB
    assert onchip_cluster(262144, 2, True) == 8
    assert onchip_cluster(128256, 4, True) == 8                # fp32
    assert onchip_cluster(8 * ONCHIP_SLICE_BYTES // 2, 2, True) == 8
    assert onchip_cluster(8 * ONCHIP_SLICE_BYTES // 2 + 8, 2, True) is None
    assert onchip_cluster(32000, 2, False) is None             # vec < full width (e.g. odd V)
    monkeypatch.setenv("FUSEDCE_CUTE_ONCHIP", "0")
    assert onchip_cluster(32000, 2, True) is None


def test_onchip_shared_memory_fits_every_arch():
    """The dynamic shared memory of the largest on-chip slice stays under the 227 KiB opt-in limit of
    sm_90a / sm_100a (the formula is the kernel's host-side twin; importing it needs the cute extra)."""
    pytest.importorskip("cutlass")
    from fusedce.backends.cute.kernels.ce_chunk_onchip import smem_bytes
    from fusedce.backends.cute.tuning import ONCHIP_SLICE_BYTES, onchip_cluster
    for v, size, vec in [(393216, 2, 8), (196608, 4, 4), (32000, 2, 8), (128256, 2, 8), (3000, 2, 8)]:
        c = onchip_cluster(v, size, True)
        assert smem_bytes(v, vec, size, c) <= ONCHIP_SLICE_BYTES + 512 <= 227 * 1024
