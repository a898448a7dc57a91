"""What the installed torch / transformers can do, for tests that depend on it (each skips saying why).

- ``TORCH_LCE``: ``torch.nn.functional.linear_cross_entropy`` and ``torch.nn.LinearCrossEntropyOptions``
  exist (torch 2.13 has them, torch 2.11 does not); ``needs_torch_lce`` skips a test without them.
- ``needs_trl``: skips a test without TRL installed (the lent GPU image has none).
- ``TORCH``: torch's (major, minor).
- ``transformers_at_least(major, minor)``: whether transformers is installed at that version or newer.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch


def _major_minor(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


TORCH = _major_minor(torch.__version__)
TORCH_LCE = hasattr(torch.nn.functional, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
needs_torch_lce = pytest.mark.skipif(
    not TORCH_LCE, reason=f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy "
                          "(torch 2.13 has it)")

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")


def transformers_at_least(major: int, minor: int) -> bool:
    try:
        return _major_minor(importlib.metadata.version("transformers")) >= (major, minor)
    except importlib.metadata.PackageNotFoundError:
        return False
