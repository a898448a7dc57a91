"""Issue 43: a CPU ``linear_cross_entropy`` call (torch backend) enters at most 18 library files in its forward
(22 before: the entrance's four decorator layers, the option checks and the thread helper each a file of their
own), and a plain call goes through the entrance's one wrapper, not the autocast / DTensor / forward-AD layers."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import fusedce

ROOT = os.path.dirname(os.path.abspath(fusedce.__file__)) + os.sep


def _files_entered(call) -> set:
    seen: set = set()

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.add(frame.f_code.co_filename[len(ROOT):])

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def _inputs():
    torch.manual_seed(0)
    return (torch.randn(16, 8, requires_grad=True), torch.randn(24, 8, requires_grad=True),
            torch.randint(0, 24, (16,)))


def test_linear_cross_entropy_forward_enters_few_files():
    h, w, t = _inputs()
    fusedce.linear_cross_entropy(h, w, t, backend="torch")   # first call: imports, registrations
    seen = _files_entered(lambda: fusedce.linear_cross_entropy(h, w, t, backend="torch"))
    assert len(seen) <= 18, sorted(seen)


@pytest.mark.parametrize("layer", ["core/autocast.py", "core/dtensor.py", "core/transforms.py",
                                   "core/options/signatures.py"])
def test_a_plain_call_skips_the_entrance_layers(layer):
    h, w, t = _inputs()
    fusedce.linear_cross_entropy(h, w, t, backend="torch")
    assert layer not in _files_entered(lambda: fusedce.linear_cross_entropy(h, w, t, backend="torch"))
    if layer == "core/autocast.py":   # the layer still runs where it has work
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer in _files_entered(lambda: fusedce.linear_cross_entropy(h, w, t, backend="torch"))
