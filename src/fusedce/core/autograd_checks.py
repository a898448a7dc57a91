"""Checks every backward of fusedce runs first: what a backward pass cannot do, said clearly."""
from __future__ import annotations

import torch


def check_backward_allowed(ctx, op: str) -> None:
    """Raise ``RuntimeError`` naming ``op`` for a double backward or a consumed in-place backward."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"{op}: double backward (create_graph=True) is not supported; its backward is a "
                           "fused kernel without a graph of its own")
    if getattr(ctx, "consumed", False):
        raise RuntimeError(f"{op}: backward ran already with inplace_backward=True, which overwrote the saved "
                           "logits with their gradient; a second backward needs inplace_backward=False")
