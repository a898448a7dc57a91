"""The PyTorch backend's tiled distillation loop (``distill_tiled.tiled_distill``) as the torch custom op
``fusedce_torch::tiled_distill``, so that torch.compile sees one opaque node instead of tracing its block
loop (which also calls ``torch.is_inference_mode_enabled``, a Dynamo error with ``fullgraph=True``), as
``custom_ops.py`` does for the cross-entropy loops. Plain eager calls run the body directly
(``core/opaque.py``). Outputs the call does not make are (0,) tensors, mapped back to None here."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.opaque import opaque_op
from .distill_tiled import tiled_distill as _tiled_distill

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0, dtype=torch.float32)


@opaque_op("fusedce_torch::tiled_distill", mutates_args=())
def _tiled_distill_op(hs: Tensor, ws: Tensor, bs: Opt, ht: Tensor, wt: Tensor, bt: Opt, target: Opt,
                      grad_factor: Opt, beta: float, temperature: float, hard_label_weight: float, ignore_index: int,
                      student_softcap: Optional[float], teacher_softcap: Optional[float],
                      deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    loss, g_h, g_w, g_b = _tiled_distill(hs, ws, bs, ht, wt, bt, target, grad_factor, beta=beta,
                                         temperature=temperature, hard_label_weight=hard_label_weight,
                                         ignore_index=ignore_index, student_softcap=student_softcap,
                                         teacher_softcap=teacher_softcap, deterministic=deterministic)
    return (loss, _empty(hs) if g_h is None else g_h, _empty(hs) if g_w is None else g_w,
            _empty(hs) if g_b is None else g_b)


@_tiled_distill_op.register_fake
def _(hs, ws, bs, ht, wt, bt, target, grad_factor, beta, temperature, hard_label_weight, ignore_index,
      student_softcap, teacher_softcap, deterministic):
    n = hs.shape[0]
    loss = hs.new_empty(n, dtype=torch.float32)
    if grad_factor is None:
        return loss, _empty(hs), _empty(hs), _empty(hs)
    g_b = _empty(hs) if bs is None else hs.new_empty(ws.shape[0], dtype=torch.float32)
    return loss, torch.empty_like(hs), hs.new_empty(ws.shape, dtype=torch.float32), g_b


def tiled_distill(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
                  target, grad_factor, *, beta: float, temperature: float, hard_label_weight: float,
                  ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                  deterministic: bool = False):
    """``distill_tiled.tiled_distill`` (same arguments and results) through the custom op."""
    loss, g_h, g_w, g_b = _tiled_distill_op(student_hidden, student_weight, student_bias, teacher_hidden,
                                            teacher_weight, teacher_bias, target, grad_factor, float(beta),
                                            float(temperature), float(hard_label_weight), int(ignore_index),
                                            None if student_softcap is None else float(student_softcap),
                                            None if teacher_softcap is None else float(teacher_softcap),
                                            bool(deterministic))
    if grad_factor is None:
        return loss, None, None, None
    return loss, g_h, g_w, (None if student_bias is None else g_b)
