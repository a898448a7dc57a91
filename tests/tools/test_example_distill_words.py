"""Issue 47 item 8: examples/distill_smollm2.py printed ``|diff| ~6.7e-05`` between its stock and fused
runs without saying which one is nearer float64; each step's line now gives each loss's error against
the float64 loss of its own head inputs and names the nearer one."""
import importlib.util
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from reference64_distill import linear_distillation_loss64

spec = importlib.util.spec_from_file_location("distill_smollm2_words",
                                              Path(__file__).parents[2] / "examples" / "distill_smollm2.py")
distill = importlib.util.module_from_spec(spec)
spec.loader.exec_module(distill)


def test_each_step_names_the_loss_nearer_float64():
    line = distill.step_line(3, {"stock": 2.00004, "fused": 2.00001}, {"stock": 2.0, "fused": 2.0})
    assert line.startswith("step   3  loss stock") and "fused nearer float64" in line
    assert "|vs float64| 4.0e-05" in line and "|vs float64| 1.0e-05" in line and "|stock - fused| 3.0e-05" in line
    assert "stock nearer float64" in distill.step_line(1, {"stock": 1.0, "fused": 1.1}, {"stock": 1.0, "fused": 1.0})


@pytest.mark.parametrize("beta,temperature,hard", [(0.0, 1.0, 0.0), (1.0, 2.0, 0.0), (0.4, 0.7, 0.5)])
def test_the_reference_is_the_float64_formula(beta, temperature, hard):
    g = torch.Generator().manual_seed(0)
    h_s, w_s = torch.randn(14, 32, generator=g), torch.randn(211, 32, generator=g) / 3
    h_t, w_t = torch.randn(14, 48, generator=g), torch.randn(211, 48, generator=g) / 4
    target = torch.randint(0, 211, (14,), generator=g)
    target[[3, 9]] = -100
    args = Namespace(beta=beta, temperature=temperature, hard_label_weight=hard)
    expected = linear_distillation_loss64(h_s, w_s, h_t, w_t, target, beta=beta, temperature=temperature,
                                          hard_label_weight=hard)
    assert distill.reference_loss(h_s, w_s, h_t, w_t, target, args) == pytest.approx(float(expected), rel=1e-12)
