"""Public distillation losses: a student trained on a teacher's distribution over the same vocabulary,
from logits (``distillation_loss``) or from both models' hidden states and LM heads
(``linear_distillation_loss``, no BT x V tensor).

Conventions (contract, "Distillation losses"): the per-token loss is the generalized Jensen-Shannon
divergence of GKD (arXiv 2306.13649, Eq. 1) exactly as TRL's ``GKDTrainer.generalized_jsd_loss`` computes
it (``beta = 0``: ``KL(teacher || student)``; ``beta = 1``: ``KL(student || teacher)``; otherwise
``beta KL(t || m) + (1 - beta) KL(s || m)``, ``m = beta t + (1 - beta) s``), both distributions at the
temperature, with no ``T**2`` factor (as TRL), plus ``hard_label_weight`` times the student's cross-entropy
on the target computed WITHOUT the temperature. "mean" divides by the number of non-ignored tokens (all
tokens without a target) or ``num_items_in_batch``. TRL's ``reduction="batchmean"`` agrees with labels
(it divides by their non-ignored count); without labels it divides by the size of the first dimension
(sequences, for ``(B, S, V)`` logits): ``num_items_in_batch=B`` gives that here.

Liger-Kernel (read at its 2026-08 head): ``LigerFusedLinearJSDLoss`` (``chunked_loss/jsd_loss.py``) and
``LigerFusedLinearJSD`` (``ops/jsd.py``) compute the same divergence with the same ``beta`` (``m = beta t +
(1 - beta) s``; 0 forward, 1 reverse KL) at the temperature, and divide by the number of non-ignored
tokens. The chunked loss returns ``w_soft * JSD + w_hard * CE`` (defaults 0.5 / 0.5; its CE without the
temperature), i.e. ``w_soft`` times this loss with ``hard_label_weight = w_hard / w_soft``. Releases
0.5.3-0.5.5 (its first JSD loss, ``aa2d23dc``) mixed the other way round, ``m = beta s + (1 - beta) t``,
with the same KL weights and no special case at 0 / 1: their ``beta`` = 0 and 1 are our 1 and 0, 0.5 is
ours, and between they match neither ours nor our ``1 - beta``; before 0.6.5 the chunked loss also
summed the ignored tokens' JSD (divided by the non-ignored count). ``tests/distill/test_distill_peers.py`` checks TRL's
function itself and the re-derived Liger formulas on the same inputs.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce.distill import checks as dc
from fusedce.core import validation as val
from fusedce.lm_head.method import check_method
from fusedce.core.options import check_chunk_size, deterministic_mode
from fusedce.core.options.distill import distill_options
from fusedce.distill.linear_head import distillation, linear_distillation
from fusedce.distill.topk import linear_topk_distillation_loss, topk_distillation_loss
from fusedce.core.rows import rows_view
from fusedce.core.reduction import _given, mean_scale


def _scale(reduction: str, target: Optional[torch.Tensor], n: int, ignore_index: int, num_items_in_batch,
           device: torch.device) -> torch.Tensor:
    """0-dim fp32 ``1 / D`` of "mean" (0 for D = 0), 1 otherwise; no host sync."""
    if reduction != "mean":
        return torch.ones((), dtype=torch.float32, device=device)
    if num_items_in_batch is not None:
        return mean_scale(_given(num_items_in_batch, device))
    if target is None:
        return mean_scale(torch.full((), float(n), dtype=torch.float32, device=device))
    return mean_scale((target != ignore_index).sum().to(torch.float32))


def _topk_form(dense: tuple, teacher_ids, teacher_log_probs, beta: float, teacher_softcap,
               teacher_bias=None) -> bool:
    """True when the teacher comes as stored top-k log-probs (``teacher_ids`` / ``teacher_log_probs``)
    instead of its logits / hidden states and head (``dense``); exactly one form must be given."""
    if teacher_ids is None and teacher_log_probs is None:
        if any(t is None for t in dense):
            raise TypeError("the teacher is missing: pass its logits (or hidden states and head weight), or "
                            "its stored top-k as teacher_ids= and teacher_log_probs=")
        return False
    if teacher_ids is None or teacher_log_probs is None:
        raise ValueError("teacher_ids and teacher_log_probs go together (the top-k teacher form)")
    if any(t is not None for t in dense) or teacher_bias is not None:
        raise ValueError("give the teacher once: either its logits / hidden states and head, or teacher_ids= "
                         "and teacher_log_probs=, not both")
    if beta != 0.0:
        raise ValueError(f"the top-k teacher form is the forward KL over the K stored classes: beta must be 0, "
                         f"got {beta!r}")
    if teacher_softcap is not None:
        raise ValueError("teacher_softcap does not apply to stored teacher log-probs")
    return True


def _result(out: torch.Tensor, reduction: str, shape) -> torch.Tensor:
    return out.reshape(shape) if reduction == "none" else out


@public_op("logits")
def distillation_loss(student_logits: torch.Tensor, teacher_logits: Optional[torch.Tensor] = None,
                      target: Optional[torch.Tensor] = None, *, beta: float = 0.0, temperature: float = 1.0,
                      hard_label_weight: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
                      num_items_in_batch: Union[int, torch.Tensor, None] = None,
                      student_softcap: Optional[float] = None, teacher_softcap: Optional[float] = None,
                      backend: Optional[str] = None, teacher_ids: Optional[torch.Tensor] = None,
                      teacher_log_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Distillation loss between the student's and the teacher's logits over the same tokens.

    Per token, with ``c(x) = cap * tanh(x / cap)`` (each model's softcap, when given), ``s =
    softmax(c(z_s) / T)``, ``t = softmax(c(z_t) / T)``: ``beta = 0`` gives ``KL(t || s)`` (forward KL),
    ``beta = 1`` ``KL(s || t)`` (reverse KL), otherwise ``beta KL(t || m) + (1 - beta) KL(s || m)`` with
    ``m = beta t + (1 - beta) s`` (GKD's generalized JSD, arXiv 2306.13649 Eq. 1, as TRL's
    ``generalized_jsd_loss``; no ``T**2`` factor); plus ``hard_label_weight * CE(c(z_s), target)`` (no
    temperature). ``0 log 0 = 0``: a ``-inf`` teacher logit masks its class (with ``beta = 1`` the reverse
    KL is then infinite, as the formula says). Module docstring: TRL's and Liger's conventions.

    Args:
        student_logits: ``(..., V)`` float32 / bfloat16 / float16; any row stride (last dim not stride 1:
            one copy). Never modified. Receives the gradient (its dtype and shape).
        teacher_logits: ``(..., V)`` with the same leading shape and V, float32 / bfloat16 / float16 (its
            own, not necessarily the student's; float64 is a ``TypeError``); a constant (never receives a
            gradient, even if it requires grad).
        target: None (every token counts) or ``(...)`` int64 / int32 of the leading shape: rows equal to
            ``ignore_index`` contribute 0 and get exactly zero gradient; the hard labels.
        beta: in [0, 1]. temperature: finite, > 0. hard_label_weight: finite; != 0 needs a target.
        ignore_index: default -100. reduction: ``"mean"`` (over non-ignored tokens, or all tokens
            without a target, or ``num_items_in_batch``; 0.0 for 0), ``"sum"``, ``"none"``.
        num_items_in_batch: replaces the mean's denominator (int or one-element tensor).
        student_softcap, teacher_softcap: None or > 0, applied before the temperature.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.
        teacher_ids: the top-k teacher form, with ``teacher_log_probs``, in place of ``teacher_logits``:
            ``(..., K)`` integer class ids and ``(..., K)`` float stored log-probs; the loss is then
            :func:`fusedce.topk_distillation_loss` (forward KL over the K classes: ``beta`` must be 0, no
            ``teacher_softcap``).
        teacher_log_probs: see ``teacher_ids``.

    Returns:
        fp32 scalar, or fp32 ``(...)`` per token for ``"none"``; every reduction's backward is exact
        (per-token upstream gradients for ``"none"``). Memory: the backward recomputes from the saved
        logits and writes one ``student_logits``-shaped gradient.

    Raises:
        TypeError: non-float logits, a target that is not an integer tensor, an option of the wrong kind.
        ValueError: different V, different leading shapes or devices, a target of another shape, ``beta``
            outside [0, 1], ``temperature`` not finite > 0, ``hard_label_weight != 0`` without a target,
            a softcap <= 0, a bad ``reduction`` / ``num_items_in_batch``.
        IndexError: a target neither ``ignore_index`` nor in [0, V) (host sync; skipped under
            torch.compile / CUDA-graph capture, where such a row gives a NaN loss).
        RuntimeError / NotImplementedError: a backend without distillation kernels (``"cute"``).
    """
    if _topk_form((teacher_logits,), teacher_ids, teacher_log_probs, beta, teacher_softcap):
        return topk_distillation_loss(student_logits, teacher_ids, teacher_log_probs, target,
                                      temperature=temperature, hard_label_weight=hard_label_weight,
                                      ignore_index=ignore_index, reduction=reduction,
                                      num_items_in_batch=num_items_in_batch, student_softcap=student_softcap,
                                      backend=backend)
    val.check_float("student_logits", student_logits)
    val.check_float("teacher_logits", teacher_logits)
    if student_logits.dim() < 1 or teacher_logits.dim() < 1:
        raise ValueError("student_logits and teacher_logits must have at least one dimension (the classes, last)")
    val.check_nonzero("student_logits", student_logits.shape, -1, "V")
    dc.check_vocab(student_logits.shape[-1], teacher_logits.shape[-1], "the logits' last dimension")
    dc.check_pair(student_logits, teacher_logits, "student_logits", "teacher_logits")
    opts = distill_options(beta, temperature, hard_label_weight, ignore_index, reduction, student_softcap,
                           teacher_softcap, target)
    val.check_num_items(num_items_in_batch, student_logits.device)
    shape, n_classes = student_logits.shape[:-1], student_logits.shape[-1]
    rows_op, _ = dc.row_ops(backend, student_logits.device)
    flat_target = dc.check_target(target, shape, student_logits.device, n_classes, opts.ignore_index)
    student, teacher = rows_view(student_logits, False), rows_view(teacher_logits, False)
    scale = _scale(reduction, flat_target, student.shape[0], opts.ignore_index, num_items_in_batch,
                   student.device)
    out = distillation(rows_op, student, teacher, flat_target, opts.kwargs(), reduction, scale)
    return _result(out, reduction, shape)


@public_op("linear", linear=(("student_hidden", "student_weight", "student_bias"),
                           ("teacher_hidden", "teacher_weight", "teacher_bias")))
def linear_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                             teacher_hidden: Optional[torch.Tensor] = None,
                             teacher_weight: Optional[torch.Tensor] = None, target: Optional[torch.Tensor] = None, *, student_bias: Optional[torch.Tensor] = None,
                             teacher_bias: Optional[torch.Tensor] = None, beta: float = 0.0,
                             temperature: float = 1.0, hard_label_weight: float = 0.0, ignore_index: int = -100,
                             reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                             student_softcap: Optional[float] = None, teacher_softcap: Optional[float] = None,
                             method: str = "auto", chunk_size: Optional[int] = None, backend: Optional[str] = None,
                             deterministic: Optional[bool] = None, teacher_ids: Optional[torch.Tensor] = None,
                             teacher_log_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`distillation_loss` of ``student_hidden @ student_weight.T + student_bias`` and
    ``teacher_hidden @ teacher_weight.T + teacher_bias``, never allocating BT x V logits.

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16; ``student_weight`` ``(V, H)`` and
            ``student_bias`` (optional) ``(V,)`` of the same dtype. Each model's logits are computed in
            its dtype with fp32 accumulation (as ``F.linear``), the loss math in fp32.
        teacher_hidden: ``(..., Ht)`` with the student's leading shape (Ht may differ from H);
            ``teacher_weight`` ``(V, Ht)`` (the same V) and ``teacher_bias`` ``(V,)`` of one dtype (may
            differ from the student's). Constants: they never receive a gradient.
        target: as :func:`distillation_loss`, and so are ``beta``, ``temperature``,
            ``hard_label_weight``, ``ignore_index``, ``reduction``, ``num_items_in_batch``,
            ``student_softcap``, ``teacher_softcap`` and ``backend``.
        method: ``"chunked"`` (both models' logits ``chunk_size`` tokens at a time; with mean / sum the
            student's gradients are formed in the forward), ``"tiled"`` (vocabulary blocks smaller than V:
            no tensor of V or more elements besides the weights, biases and the student's gradients) or
            ``"auto"`` (the rule of :func:`fusedce.linear_cross_entropy`). Ignored tokens are dropped
            before the matmuls (one host sync per call; skipped under torch.compile / graph capture).
        chunk_size: None (automatic, ``lm_head/method.py``) or a positive integer;
            ``"chunked"`` only.
        deterministic: None follows ``torch.are_deterministic_algorithms_enabled()``; True selects
            backward paths without float atomics (bitwise run-to-run identical results).
        teacher_ids: with ``teacher_log_probs``, the top-k teacher form in place of ``teacher_hidden`` /
            ``teacher_weight`` / ``teacher_bias``: the loss is then
            :func:`fusedce.linear_topk_distillation_loss` (``beta`` must be 0, no ``teacher_softcap``).
        teacher_log_probs: see ``teacher_ids``.

    Returns:
        As :func:`distillation_loss`; gradients of the student's hidden, weight and bias in their dtypes
        (weight / bias gradients accumulated in fp32).

    Raises:
        The errors of :func:`distillation_loss` (V compared between the heads), plus ``ValueError`` for
        ``hidden.shape[-1] != weight.shape[1]`` (per model), a bias that is not ``(V,)``, a bad ``method``
        or ``chunk_size``; ``TypeError`` for a model whose hidden / weight / bias dtypes differ or a
        ``deterministic`` that is not None or a bool.
    """
    if _topk_form((teacher_hidden, teacher_weight), teacher_ids, teacher_log_probs, beta, teacher_softcap,
                  teacher_bias):
        return linear_topk_distillation_loss(
            student_hidden, student_weight, teacher_ids, teacher_log_probs, target, student_bias=student_bias,
            temperature=temperature, hard_label_weight=hard_label_weight, ignore_index=ignore_index,
            reduction=reduction, num_items_in_batch=num_items_in_batch, student_softcap=student_softcap,
            method=method, chunk_size=chunk_size, backend=backend, deterministic=deterministic)
    dc.check_head(student_hidden, student_weight, student_bias, "student")
    dc.check_head(teacher_hidden, teacher_weight, teacher_bias, "teacher")
    dc.check_vocab(student_weight.shape[0], teacher_weight.shape[0], "weight.shape[0]")
    dc.check_pair(student_hidden, teacher_hidden, "student_hidden", "teacher_hidden")
    check_chunk_size(chunk_size)
    check_method(method, chunk_size)
    deterministic = deterministic_mode(deterministic)
    opts = distill_options(beta, temperature, hard_label_weight, ignore_index, reduction, student_softcap,
                           teacher_softcap, target)
    val.check_num_items(num_items_in_batch, student_hidden.device)
    shape, n_classes = student_hidden.shape[:-1], student_weight.shape[0]
    rows_op, tiled_op = dc.row_ops(backend, student_hidden.device)
    flat_target = dc.check_target(target, shape, student_hidden.device, n_classes, opts.ignore_index)
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    scale = _scale(reduction, flat_target, hs.shape[0], opts.ignore_index, num_items_in_batch, hs.device)
    out = linear_distillation(rows_op, tiled_op, hs, student_weight, student_bias, ht, teacher_weight, teacher_bias,
                              flat_target, opts.kwargs(), reduction, scale, method,
                              None if chunk_size is None else int(chunk_size), deterministic)
    return _result(out, reduction, shape)
