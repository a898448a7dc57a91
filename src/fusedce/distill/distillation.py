"""Public distillation losses: a student trained on a teacher's distribution over the same vocabulary, from logits
(``distillation_loss``) or from both models' hidden states and LM heads (``linear_distillation_loss``, no BT x V
tensor)."""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce.lm_head import invariant
from fusedce.core.reduction import token_mean_scale
from fusedce.core.rows import rows_view
from fusedce.distill import checks as dc
from fusedce.distill.linear_head import distillation, linear_distillation

_TOPK_KEYWORDS = ("teacher_ids", "teacher_log_probs")


def _topk_door(topk_name: str):
    """Decorator: ``teacher_ids=`` / ``teacher_log_probs=`` / ``tail=`` are a ``TypeError`` pointing to
    ``topk_name``, before anything runs."""
    def decorate(fn):
        @functools.wraps(fn)
        def op(*args, **kwargs):
            given = [k for k in _TOPK_KEYWORDS if k in kwargs]
            if given:
                raise TypeError(f"{fn.__name__}() got {', '.join(repr(k) for k in given)}: a top-k teacher "
                                f"(teacher_ids, teacher_log_probs) goes to fusedce.{topk_name}(...) instead "
                                f"(the same options, forward KL over the K stored classes)")
            if "tail" in kwargs:
                raise TypeError(f"{fn.__name__}() got 'tail': the (K+1)-th 'tail' bin belongs to a top-k teacher, "
                                f"fusedce.{topk_name}(..., tail=True); this op's teacher gives its whole "
                                f"distribution over the V classes, which has no mass outside them")
            return fn(*args, **kwargs)
        return op
    return decorate


def _scale(reduction: str, call: dc.DistillCall, n: int, num_items_in_batch, device) -> torch.Tensor:
    """0-dim fp32 ``1 / D`` of "mean" (the rule of every distillation loss, ``token_mean_scale``), 1
    otherwise; no host sync."""
    if reduction != "mean":
        return torch.ones((), dtype=torch.float32, device=device)
    return token_mean_scale(call.target, n, call.opts.ignore_index, num_items_in_batch, device)


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * x`` (autograd flows through it), ``x`` itself for 1."""
    return x if scale == 1.0 or x is None else x * scale


def _result(out: torch.Tensor, reduction: str, shape) -> torch.Tensor:
    return out.reshape(shape) if reduction == "none" else out


@public_op("logits")
@_topk_door("topk_distillation_loss")
def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      target: Optional[torch.Tensor] = None, *, beta: float = 0.0, temperature: float = 1.0,
                      hard_label_weight: float = 0.0, ignore_index: int = -100, reduction: str = "mean",
                      num_items_in_batch: Union[int, torch.Tensor, None] = None,
                      student_softcap: Optional[float] = None, teacher_softcap: Optional[float] = None,
                      logit_scale: float = 1.0, teacher_logit_scale: float = 1.0,
                      backend: Optional[str] = None, batch_invariant: bool = False) -> torch.Tensor:
    """Distillation loss between the student's and the teacher's logits over the same tokens.

    Per token, ``s = softmax(c(a_s z_s) / T)``, ``t = softmax(c(a_t z_t) / T)``: ``beta = 0`` gives ``KL(t || s)``,
    ``beta = 1`` ``KL(s || t)``, otherwise GKD's generalized JSD (arXiv 2306.13649 Eq. 1, as TRL's
    ``generalized_jsd_loss``); plus ``hard_label_weight * CE(c(a_s z_s), target)``. Semantics: docs/contract.md,
    "Distillation losses". A top-k teacher goes to :func:`fusedce.topk_distillation_loss`.

    Args:
        student_logits: ``(..., V)`` float32 / bfloat16 / float16; receives the gradient.
        teacher_logits: ``(..., V)`` float32 / bfloat16 / float16, the student's leading shape; a constant.
        target: None or ``(...)`` int64 / int32, the hard labels; ``ignore_index`` rows add 0.
        beta: in [0, 1].
        temperature: finite > 0, applied to both models.
        hard_label_weight: finite >= 0; != 0 needs a target.
        ignore_index: the ignored target value.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        num_items_in_batch: the mean's denominator (int or one-element tensor), if given.
        student_softcap, teacher_softcap: None or > 0.
        logit_scale, teacher_logit_scale: finite > 0, multiply each model's logits.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.
        batch_invariant: bool; each row's results bitwise independent of the rest of the batch.

    Returns:
        fp32 scalar, or fp32 ``(...)`` for ``"none"``.

    Raises:
        TypeError: non-float logits, a non-integer target, an option of the wrong kind, ``teacher_ids=`` /
            ``teacher_log_probs=`` / ``tail=`` (the top-k door).
        ValueError: different V, leading shapes or devices, an option out of range, ``hard_label_weight != 0``
            without a target.
        IndexError: a target outside [0, V) and not ``ignore_index`` (host sync).
        RuntimeError / NotImplementedError: a backend without distillation kernels (``"cute"``).
    """
    call = dc.checked_distill(student_logits, teacher_logits, target, beta=beta, temperature=temperature,
                              hard_label_weight=hard_label_weight, ignore_index=ignore_index, reduction=reduction,
                              num_items_in_batch=num_items_in_batch, student_softcap=student_softcap,
                              teacher_softcap=teacher_softcap, logit_scale=logit_scale,
                              teacher_logit_scale=teacher_logit_scale, backend=backend)
    invariant.check(batch_invariant)
    student = rows_view(_scaled(student_logits, call.logit_scale), False)
    teacher = rows_view(_scaled(teacher_logits.detach(), call.teacher_logit_scale), False)
    scale = _scale(reduction, call, student.shape[0], num_items_in_batch, student.device)
    out = distillation(call.rows_op, student, teacher, call.target, call.opts.kwargs(), reduction, scale)
    return _result(out, reduction, call.lead)


@public_op("linear", linear=(("student_hidden", "student_weight", "student_bias"),
                           ("teacher_hidden", "teacher_weight", "teacher_bias")))
@_topk_door("linear_topk_distillation_loss")
def linear_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                             teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                             target: Optional[torch.Tensor] = None, *, student_bias: Optional[torch.Tensor] = None,
                             teacher_bias: Optional[torch.Tensor] = None, beta: float = 0.0,
                             temperature: float = 1.0, hard_label_weight: float = 0.0, ignore_index: int = -100,
                             reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                             student_softcap: Optional[float] = None, teacher_softcap: Optional[float] = None,
                             logit_scale: float = 1.0, teacher_logit_scale: float = 1.0,
                             method: str = "auto", chunk_size: Optional[int] = None, backend: Optional[str] = None,
                             deterministic: Optional[bool] = None, batch_invariant: bool = False) -> torch.Tensor:
    """:func:`distillation_loss` of ``student_hidden @ student_weight.T + student_bias`` and
    ``teacher_hidden @ teacher_weight.T + teacher_bias``, without BT x V logits.

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16.
        student_weight: ``(V, H)``, the hidden's dtype.
        teacher_hidden: ``(..., Ht)``, the student's leading shape, float32 / bfloat16 / float16; a constant.
        teacher_weight: ``(V, Ht)``, the teacher hidden's dtype; a constant.
        target: as :func:`distillation_loss`, and so are the loss options.
        student_bias, teacher_bias: None or ``(V,)``, that model's dtype.
        method: ``"auto"``, ``"chunked"`` or ``"tiled"`` (as :func:`fusedce.linear_cross_entropy`).
        chunk_size: None (automatic) or a positive int; ``"chunked"`` only.
        deterministic: None follows ``torch.are_deterministic_algorithms_enabled()``; True: no float atomics.
        batch_invariant: bool; as :func:`distillation_loss` (the weight and bias gradients exempt).

    Returns:
        As :func:`distillation_loss`; gradients of the student's hidden, weight and bias in their dtypes.

    Raises:
        The errors of :func:`distillation_loss`; ``ValueError`` for ``hidden.shape[-1] != weight.shape[1]``, a
        bias that is not ``(V,)``, a bad ``method`` / ``chunk_size``; ``TypeError`` for mixed dtypes in one model.
    """
    call = dc.checked_distill(student_hidden, teacher_hidden, target, beta=beta, temperature=temperature,
                              hard_label_weight=hard_label_weight, ignore_index=ignore_index, reduction=reduction,
                              num_items_in_batch=num_items_in_batch, student_softcap=student_softcap,
                              teacher_softcap=teacher_softcap, logit_scale=logit_scale,
                              teacher_logit_scale=teacher_logit_scale, backend=backend,
                              heads=((student_weight, student_bias), (teacher_weight, teacher_bias)), method=method,
                              chunk_size=chunk_size, deterministic=deterministic)
    invariant.check(batch_invariant)
    hs = _scaled(student_hidden.reshape(-1, student_hidden.shape[-1]), call.logit_scale)
    ht = _scaled(teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]), call.teacher_logit_scale)
    bs, bt = _scaled(student_bias, call.logit_scale), _scaled(teacher_bias, call.teacher_logit_scale)
    scale = _scale(reduction, call, hs.shape[0], num_items_in_batch, hs.device)
    out = linear_distillation(call.backend, call.tiled_op, hs, student_weight, bs, ht, teacher_weight, bt,
                              call.target, call.opts.kwargs(), reduction, scale, method,
                              None if chunk_size is None else int(chunk_size), call.deterministic,
                              batch_invariant)
    return _result(out, reduction, call.lead)
