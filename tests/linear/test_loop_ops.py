"""The chunk loops' custom ops (issue 43 item 2): every loop outside ``backends/`` is a kind of
``fusedce_lm::loop_forward`` / ``loop_backward`` (``lm_head/kinds.py``), not an op of its own."""
from __future__ import annotations

import importlib
import pkgutil

import torch

import fusedce

FAMILIES = ("core", "lm_head", "ce", "rl", "distill", "distributed", "nn")


def test_at_most_three_loop_ops_outside_the_backends():
    for family in FAMILIES:
        package = importlib.import_module(f"fusedce.{family}")
        for info in pkgutil.walk_packages(package.__path__, f"fusedce.{family}."):
            importlib.import_module(info.name)
    backends = ("fusedce_torch::", "fusedce::", "fusedce_cute::", "fusedce_triton::")
    ops = sorted(name for name in torch._C._dispatch_get_all_op_names()
                 if name.startswith("fusedce") and not name.startswith(backends))
    assert len(ops) <= 3, ops   # issue 43's bound (14 before the registry)
    assert {"fusedce_lm::loop_forward", "fusedce_lm::loop_backward"} <= set(ops)


def test_every_family_registers_its_kinds():
    from fusedce.lm_head.kinds import KINDS
    assert fusedce.__version__
    expected = {"ce", "ce_stats", "probs", "kclass", "distill", "tail_logits", "tail_head", "dist_ce",
                "dist_kclass", "dist_probs"}
    assert expected <= set(KINDS)
    for kind in KINDS.values():
        assert callable(kind.forward) and callable(kind.forward_fake)
        assert (getattr(kind, "backward", None) is None) == (getattr(kind, "backward_fake", None) is None)
