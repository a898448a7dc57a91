"""The float64 oracle of the RL log-probs (``token_log_probs``, ``linear_token_log_probs`` and their
vocab-parallel forms, one class or K classes per token), written from the contract's formula. Nothing
here imports fusedce.

Per token, from the logits ``x`` (..., V):

- ``z = logit_scale * x``, then softcap ``z = c tanh(z / c)`` (if given), then ``q = z / temperature``;
- ``lse = logsumexp(q)``; ``log_probs = q[t] - lse`` at each requested class ``t`` (a ``(...)`` target or a
  ``(..., K)`` one), 0 on an entry whose class is ``ignore_index``;
- ``entropy = lse - sum_c p_c q_c`` with ``p = softmax(q)`` (the same value as ``-sum_c p_c log p_c``), 0
  on a token whose entries are all ignored.

The ``-inf`` rule: a logit of ``-inf`` (a masked class) has probability exactly 0 and contributes exactly
0 to the entropy, never NaN (``0 * -inf`` is not formed: ``q_c`` is replaced by 0 where it is ``-inf``
before the product), and its gradient is 0. Its log-prob, if asked for, is ``-inf``. A token needs at least
one finite logit (a row of ``-inf`` has no softmax).

The outputs are differentiable through the float64 logits given (e.g. ``F.linear`` of float64 leaves), so
a test takes the gradients of any objective over both outputs by autograd.
"""
from __future__ import annotations

from typing import Optional

import torch


def transformed_logits(x64: torch.Tensor, temperature: float = 1.0, softcap: Optional[float] = None,
                       logit_scale: float = 1.0) -> torch.Tensor:
    """``q = (c tanh(logit_scale x / c)) / temperature`` in float64 (softcap optional)."""
    z = x64 * logit_scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    return z / temperature


def entropy_of(q: torch.Tensor) -> torch.Tensor:
    """``lse(q) - sum_c softmax(q)_c q_c`` over the last dimension; a ``-inf`` ``q_c`` adds exactly 0."""
    lse = torch.logsumexp(q, dim=-1)
    p = torch.exp(q - lse[..., None])
    finite_q = torch.where(q == float("-inf"), 0.0, q)   # p = 0 there: the term is 0, not 0 * -inf
    return lse - (p * finite_q).sum(dim=-1)


def reference_log_probs(x64: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                        softcap: Optional[float] = None, *, logit_scale: float = 1.0, ignore_index: int = -100):
    """``(log_probs, entropy)`` in float64: ``log_probs`` target.shape (``(...)`` or ``(..., K)``), ``entropy``
    (...) (the token's leading shape); both 0 where ignored (see the module docstring)."""
    q = transformed_logits(x64, temperature, softcap, logit_scale)
    lse = torch.logsumexp(q, dim=-1)
    target = target.long()
    kclass = target.dim() == q.dim()   # (..., K) classes per token
    idx = target if kclass else target[..., None]
    valid = idx != ignore_index
    q_t = q.gather(-1, torch.where(valid, idx, 0))
    log_probs = torch.where(valid, q_t - lse[..., None], 0.0)
    entropy = torch.where(valid.any(-1), entropy_of(q), 0.0)
    return (log_probs if kclass else log_probs[..., 0]), entropy
