"""The ``method="tiled"`` side of the K-class log-probs (``rl/kclass.py``): the K target logits of each row, and the
sparse ``[c == t_k]`` term of the gradient added to the tiled gradients."""
from __future__ import annotations

import torch

from fusedce.core.validation import host_readable

_GATHER_ELEMENTS = 1 << 22   # elements of the (rows, K, H) weight gathers
_ROWS = 32                   # rows per F.linear of the target logits (``target_logits``)


def target_logits(hidden, weight, bias, safe: torch.Tensor) -> torch.Tensor:
    """``x_ik = hidden_i . weight[t_ik] + bias[t_ik]`` (n, K) fp32 from the operands' values, in row chunks of
    gathered weight rows (no tensor with a V dimension)."""
    n, K = safe.shape
    x = torch.empty(n, K, dtype=torch.float32, device=hidden.device)
    rows = max(1, min(_ROWS, _GATHER_ELEMENTS // max(1, K * hidden.shape[1])))
    for s in range(0, n, rows):
        c = slice(s, s + rows)
        idx = safe[c].reshape(-1)
        logits = torch.nn.functional.linear(hidden[c].float(), weight[idx].float(),
                                            None if bias is None else bias[idx].float())
        r = logits.shape[0]
        x[c] = logits.reshape(r, r, K).diagonal(dim1=0, dim2=1).t()
    return x


def _add_rows_(acc: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, deterministic: bool) -> None:
    """``acc[ids[e]] += values[e]`` for every entry e (``index_add_``: float atomics on CUDA, so the sum of one class's
    entries is not bitwise reproducible)."""
    if not deterministic or not host_readable(ids) or ids.numel() == 0:
        acc.index_add_(0, ids, values.to(acc.dtype))
        return
    order = torch.argsort(ids, stable=True)
    classes, counts = torch.unique_consecutive(ids[order], return_counts=True)
    acc.index_add_(0, classes, torch.segment_reduce(values[order], "sum", lengths=counts).to(acc.dtype))


def sparse_grads_(grads, hidden, weight, d: torch.Tensor, safe: torch.Tensor, needs,
                  deterministic: bool = False) -> tuple:
    """Add the sparse term ``d`` ((n, K) fp32 dL/dx at the target columns) to the tiled gradients
    ``(grad_hidden, grad_weight, grad_bias)``."""
    g_h, g_w, g_b = grads
    n, K = safe.shape
    rows = max(1, _GATHER_ELEMENTS // max(1, K * hidden.shape[1]))
    if needs[0]:
        g_h32 = g_h.float()
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            g_h32[c] += torch.bmm(d[c, None, :], weight[safe[c]].float())[:, 0]
        g_h = g_h32.to(g_h.dtype)
    if needs[1]:
        for s in range(0, n, rows):
            c = slice(s, s + rows)
            rows_h = hidden[c].float()[:, None, :] * d[c, :, None]
            _add_rows_(g_w, safe[c].reshape(-1), rows_h.reshape(-1, hidden.shape[1]), deterministic)
    if needs[2]:
        _add_rows_(g_b, safe.reshape(-1), d.reshape(-1), deterministic)
    return g_h, g_w, g_b
