"""Plain result types shared by every layer: what the public ops return (``CrossEntropyOutput``, ``TokenLogProbs``,
``TokenStats``, ``TopkDistillationOutput``) and the backends' vocabulary-slice statistics (``SliceStats``)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy(..., return_stats=True)`` and ``linear_cross_entropy`` return.

    - ``loss``: float32, reduced as asked (``"none"``: shape ``target.shape``); the only field with a gradient.
    - ``z_loss``: float32, the ``lse_square_scale * lse**2`` part of ``loss`` alone, same reduction
      (``"mean"``: divided by N, the count of non-ignored rows or ``num_items_in_batch``).
    - ``lse``: float32 ``target.shape``, per-row log-sum-exp of the (softcapped) logits; 0 on ignored
      rows (never computed), in every op.
    - ``token_accuracy``: float32; fraction of non-ignored rows whose argmax (lowest index on ties)
      equals the target, 0.0 when no row counts; per-row 0/1 for ``reduction="none"`` (0 on ignored rows).
    - ``predicted_tokens``: int64 ``target.shape``, argmax of the logits per row, -1 on ignored rows.

    With probability targets (a float ``target`` of ``logits.shape``) no row is ignored: ``lse`` and
    ``predicted_tokens`` are set on every row, ``token_accuracy`` counts the rows whose argmax of the
    logits equals the argmax of the target (lowest index on ties), and the shapes are ``logits.shape[:-1]``.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    lse: torch.Tensor
    token_accuracy: torch.Tensor
    predicted_tokens: torch.Tensor


class TokenLogProbs(NamedTuple):
    """What ``token_log_probs`` / ``linear_token_log_probs`` return with ``return_entropy=True``: fp32
    tensors of ``target.shape``, ``log_probs = log softmax(q)[t]`` and ``entropy = -sum_c softmax(q)_c
    log softmax(q)_c`` (``q`` the logits after softcap and temperature), both 0 on ignored rows and
    both differentiable."""

    log_probs: torch.Tensor
    entropy: torch.Tensor


class TokenStats(NamedTuple):
    """What ``token_log_probs`` / ``linear_token_log_probs`` return with ``return_stats=True`` (the
    per-token fields of TRL's fused LM head, defined as its kernel does). Tensors of ``target.shape``,
    all 0 / False on ignored rows; with ``q`` the logits after logit scale, softcap and temperature and
    ``p = softmax(q)`` over the V classes:

    - ``log_probs`` fp32 ``log p_t`` and ``entropy`` fp32 ``-sum_c p_c log p_c`` (None without
      ``return_entropy``): differentiable, as in ``TokenLogProbs``;
    - ``log_sum_sq_probs`` fp32 ``log sum_c p_c**2 = logsumexp(2 q) - 2 logsumexp(q)`` (the log
      collision probability, minus the Renyi-2 entropy); no gradient;
    - ``mean_logits`` fp32 ``sum_c q_c / V`` (-inf if some logit is -inf); no gradient;
    - ``is_top1`` bool, ``argmax_c q_c == t`` with the lowest index winning ties (a tie with an
      earlier class is not a top-1 hit); no gradient.
    """

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    log_sum_sq_probs: torch.Tensor
    mean_logits: torch.Tensor
    is_top1: torch.Tensor


class TopkDistillationOutput(NamedTuple):
    """What ``topk_distillation_loss`` / ``linear_topk_distillation_loss`` return with
    ``return_stats=True`` (``tail`` True or False alike):

    - ``loss``: as without stats (fp32, reduced as asked); the only field with a gradient;
    - ``teacher_mass``: fp32 ``(...)`` (the tokens' leading shape), ``sum_k p_k`` over the token's kept
      entries (``p_k = exp(teacher_log_probs_k)`` as stored, summed in float64): the mass the teacher's
      K classes hold;
    - ``student_mass``: fp32 ``(...)``, ``sum_k s[id_k]`` over the same entries (``s`` the student's
      softmax at the temperature; a duplicated id counts once per entry, as in the loss). No gradient.

    Both are 0 on ignored tokens and on tokens whose K entries are all padding.
    """

    loss: torch.Tensor
    teacher_mass: torch.Tensor
    student_mass: torch.Tensor


class SliceStats(NamedTuple):
    """Partial row statistics of a vocabulary slice (the backends' ``slice_stats``)."""

    xmax: torch.Tensor
    argmax: torch.Tensor
    zmax: torch.Tensor
    sumexp: torch.Tensor
    target_logit: torch.Tensor
    zsum: Optional[torch.Tensor]
    tsum: Optional[torch.Tensor] = None
