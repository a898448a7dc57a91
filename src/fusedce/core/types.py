"""Plain result types shared by every layer: what the public ops return (``CrossEntropyOutput``, ``TokenLogProbs``,
``TokenStats``, ``TopkDistillationOutput``) and the backends' vocabulary-slice statistics (``SliceStats``)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy(..., return_stats=True)`` and ``linear_cross_entropy`` return (``docs/contract.md``).

    - ``loss``: fp32, reduced as asked; the only field with a gradient.
    - ``z_loss``: fp32, the ``lse_square_scale * lse**2`` part of ``loss`` alone, same reduction.
    - ``lse``: fp32 per row, 0 on ignored rows.
    - ``token_accuracy``: fp32, the fraction of counted rows whose argmax equals the target (per row for "none").
    - ``predicted_tokens``: int64 argmax per row, -1 on ignored rows.
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
    """What ``token_log_probs`` / ``linear_token_log_probs`` return with ``return_stats=True`` (TRL's fused
    LM head's per-token fields; ``docs/contract.md``): tensors of ``target.shape``, 0 / False on ignored rows,
    with ``q`` the transformed logits and ``p = softmax(q)``:

    - ``log_probs`` fp32 ``log p_t``, ``entropy`` fp32 ``-sum_c p_c log p_c`` (None without ``return_entropy``);
    - ``log_sum_sq_probs`` fp32 ``log sum_c p_c**2``, ``mean_logits`` fp32 ``sum_c q_c / V`` (no gradient);
    - ``is_top1`` bool, ``argmax_c q_c == t``, the lowest index winning ties (no gradient).
    """

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    log_sum_sq_probs: torch.Tensor
    mean_logits: torch.Tensor
    is_top1: torch.Tensor


class TopkDistillationOutput(NamedTuple):
    """What the top-k distillation losses return with ``return_stats=True`` (``docs/contract.md``):

    - ``loss``: as without stats; the only field with a gradient;
    - ``teacher_mass``: fp32 ``(...)``, ``sum_k p_k`` over the token's kept teacher entries;
    - ``student_mass``: fp32 ``(...)``, ``sum_k s[id_k]`` over the same entries (the student's softmax).
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
