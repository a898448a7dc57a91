"""``linear_distillation_loss(method="chunked")``'s chunk loop as the loop kind ``distill`` (``lm_head/kinds.py``:
one node whatever the token count)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from fusedce.lm_head import kinds, loop
from fusedce.lm_head.kinds import Args, register
from fusedce.lm_head.loop import chunk_rows


@register("distill")
class _Distill:
    """Tensors ``hs, ws, bs, ht, wt, bt, target, grad_factor`` (``grad_factor`` None: the loss only); ints
    ``ignore_index, chunk_size, needs`` x3; floats ``beta, temperature, hard_label_weight, student_softcap,
    teacher_softcap`` (NaN for None); words the backend. Outputs ``loss, grad_h, grad_w, grad_b`` (fp32 but
    ``grad_h``; (0,) where not made)."""

    @staticmethod
    def forward(a: Args) -> list:
        from fusedce import backends
        hs, ws, bs, ht, wt, bt, target, grad_factor = a.t
        rows_op = backends.get(a.words, hs.device, distill=True).distill_rows
        beta, temperature, hard_label_weight, s_cap, t_cap = a.f
        kw = dict(beta=beta, temperature=temperature, hard_label_weight=hard_label_weight, ignore_index=a.i[0],
                  student_softcap=None if math.isnan(s_cap) else s_cap,
                  teacher_softcap=None if math.isnan(t_cap) else t_cap)
        n = hs.shape[0]
        rows = a.i[1] or chunk_rows(n, max(hs.shape[1], ht.shape[1]), ws.shape[0], hs.device.type)
        loss = torch.empty(n, dtype=torch.float32, device=hs.device)
        want = grad_factor is not None
        needs = [want and bool(need) for need in a.i[2:5]]
        g_h, g_w, g_b = loop.grad_buffers(hs, ws, needs, torch.float32)
        buf_s = loop.chunk_buffer(n, rows, ws, hs.dtype)
        buf_t = loop.chunk_buffer(n, rows, wt, ht.dtype)
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            zs = loop.logits_chunk(hs[c], ws, bs, buf_s)
            zt = loop.logits_chunk(ht[c], wt, bt, buf_t)
            loss[c], d = rows_op(zs, zt, None if target is None else target[c], grad_factor[c] if want else None,
                                 **kw)
            del zs, zt
            if d is not None:   # d: the logits' dtype (fp32)
                loop.backprop_chunk_(d, hs[c], ws, c, g_h, g_w, g_b)
            del d
        return [hs.new_empty(0, dtype=torch.float32) if g is None else g for g in (loss, g_h, g_w, g_b)]

    @staticmethod
    def forward_fake(a: Args) -> list:
        hs, ws, want, f32 = a.t[0], a.t[1], a.t[7] is not None, torch.float32
        needs = [want and bool(need) for need in a.i[2:5]]
        _, g_w, g_b = loop.grads_fake(hs, ws, needs, f32)
        return [hs.new_empty(hs.shape[0], dtype=f32), torch.empty_like(hs) if needs[0] else hs.new_empty(0, dtype=f32),
                g_w, g_b]


def chunked_distill(backend: str, chunk_size: Optional[int], hs, ws, bs, ht, wt, bt, target, grad_factor, kw: dict,
                    needs) -> tuple:
    """``(loss (N,) fp32, grad_h, grad_w, grad_b)`` (None where not made) through the kind above; ``kw`` the
    ``DistillOptions.kwargs()``."""
    want = grad_factor is not None
    floats = [kw[k] for k in ("beta", "temperature", "hard_label_weight")] + [
        math.nan if kw[k] is None else kw[k] for k in ("student_softcap", "teacher_softcap")]
    loss, g_h, g_w, g_b = kinds.forward("distill", [hs, ws, bs, ht, wt, bt, target, grad_factor],
                                        [kw["ignore_index"], chunk_size or 0, *needs], floats, backend)
    return (loss, g_h if want and needs[0] else None, g_w if want and needs[1] else None,
            g_b if want and needs[2] else None)
