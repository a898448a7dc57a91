"""Checks every backward of fusedce runs first: what a backward pass cannot do, said clearly.

- ``create_graph=True`` (double backward): the backward formulas are kernels (or no-grad PyTorch), whose
  results carry no graph; a second-order gradient would silently be wrong, so it is refused.
- A second backward through a retained graph after an in-place backward: the first one overwrote the
  saved logits with their gradient (``inplace_backward=True``), so nothing is left to differentiate.
Every other second backward (``retain_graph=True`` then ``backward`` again, or ``torch.autograd.grad``
then ``backward``) is supported and recomputes what it needs.
"""
from __future__ import annotations

import torch


def check_backward_allowed(ctx, op: str) -> None:
    """Raise ``RuntimeError`` naming ``op`` for a double backward or a consumed in-place backward.

    ``ctx.consumed`` (optional attribute) is True once an in-place backward has overwritten the saved
    inputs. Under torch.compile the backward is traced with grad mode on, which is not a double
    backward: the check is skipped while compiling.
    """
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(f"{op}: double backward (create_graph=True) is not supported; its backward is a "
                           "fused kernel without a graph of its own")
    if getattr(ctx, "consumed", False):
        raise RuntimeError(f"{op}: backward ran already with inplace_backward=True, which overwrote the saved "
                           "logits with their gradient; a second backward needs inplace_backward=False")
