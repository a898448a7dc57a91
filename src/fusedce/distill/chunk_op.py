"""``linear_distillation_loss(method="chunked")``'s chunk loop as one op, so that a tracer sees one node whatever the
token count (the reason and the mechanism are ``lm_head/loop.py``'s)."""
from __future__ import annotations

from typing import Optional

import torch

from fusedce.core.opaque import opaque_op
from fusedce.lm_head import loop
from fusedce.lm_head.loop import chunk_rows

Opt = Optional[torch.Tensor]
Tensor = torch.Tensor


def _rows_op(backend: str, device: torch.device):
    from fusedce import backends
    return backends.get(backend, device, distill=True).distill_rows


@opaque_op("fusedce_distill::chunked", mutates_args=(), observable=True)
def _chunked_op(hs: Tensor, ws: Tensor, bs: Opt, ht: Tensor, wt: Tensor, bt: Opt, target: Opt, grad_factor: Opt,
                beta: float, temperature: float, hard_label_weight: float, ignore_index: int,
                student_softcap: Optional[float], teacher_softcap: Optional[float], backend: str, chunk_size: int,
                needs_hidden: bool, needs_weight: bool, needs_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows_op = _rows_op(backend, hs.device)
    kw = dict(beta=beta, temperature=temperature, hard_label_weight=hard_label_weight, ignore_index=ignore_index,
              student_softcap=student_softcap, teacher_softcap=teacher_softcap)
    n = hs.shape[0]
    rows = chunk_size or chunk_rows(n, max(hs.shape[1], ht.shape[1]), ws.shape[0], hs.device.type)
    loss = torch.empty(n, dtype=torch.float32, device=hs.device)
    want = grad_factor is not None
    g_h = torch.empty(hs.shape, dtype=hs.dtype, device=hs.device) if want and needs_hidden else None
    g_w = torch.zeros(ws.shape, dtype=torch.float32, device=ws.device) if want and needs_weight else None
    g_b = torch.zeros(ws.shape[0], dtype=torch.float32, device=ws.device) if want and needs_bias else None
    buf_s = loop.chunk_buffer(n, rows, ws, hs.dtype)
    buf_t = loop.chunk_buffer(n, rows, wt, ht.dtype)
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        zs = loop.logits_chunk(hs[c], ws, bs, buf_s)
        zt = loop.logits_chunk(ht[c], wt, bt, buf_t)
        loss[c], d = rows_op(zs, zt, None if target is None else target[c], grad_factor[c] if want else None, **kw)
        del zs, zt
        if d is not None:   # d: the logits' dtype (fp32)
            loop.backprop_chunk_(d, hs[c], ws, c, g_h, g_w, g_b)
        del d
    return tuple(hs.new_empty(0, dtype=torch.float32) if g is None else g for g in (loss, g_h, g_w, g_b))


@_chunked_op.register_fake
def _(hs, ws, bs, ht, wt, bt, target, grad_factor, beta, temperature, hard_label_weight, ignore_index,
      student_softcap, teacher_softcap, backend, chunk_size, needs_hidden, needs_weight, needs_bias):
    want = grad_factor is not None
    return (hs.new_empty(hs.shape[0], dtype=torch.float32),
            torch.empty_like(hs) if want and needs_hidden else hs.new_empty(0, dtype=torch.float32),
            hs.new_empty(ws.shape if want and needs_weight else 0, dtype=torch.float32),
            hs.new_empty(ws.shape[0] if want and needs_bias else 0, dtype=torch.float32))


def chunked_distill(backend: str, chunk_size: Optional[int], hs, ws, bs, ht, wt, bt, target, grad_factor, kw: dict,
                    needs) -> tuple:
    """``(loss (N,) fp32, grad_h, grad_w, grad_b)`` (None where not made) through the op above; ``kw`` the
    ``DistillOptions.kwargs()``."""
    want = grad_factor is not None
    loss, g_h, g_w, g_b = _chunked_op(hs, ws, bs, ht, wt, bt, target, grad_factor, float(kw["beta"]),
                                      float(kw["temperature"]), float(kw["hard_label_weight"]),
                                      int(kw["ignore_index"]), kw["student_softcap"], kw["teacher_softcap"], backend,
                                      chunk_size or 0, *needs)
    return (loss, g_h if want and needs[0] else None, g_w if want and needs[1] else None,
            g_b if want and needs[2] else None)
