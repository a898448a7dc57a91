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
    """Decorator (inside the entrance): the top-k teacher has one door, ``topk_name``; a call passing
    ``teacher_ids=`` / ``teacher_log_probs=`` (the form this op took until 2026-12-02) is a ``TypeError``
    saying where to go, before anything runs (Python's own "unexpected keyword" would not); so is
    ``tail=`` (the top-k teacher's (K+1)-th bin: a dense teacher has no tail)."""
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

    Per token, with ``c(x) = cap * tanh(x / cap)`` (each model's softcap, when given), ``s =
    softmax(c(a_s z_s) / T)``, ``t = softmax(c(a_t z_t) / T)`` (``a_s`` = ``logit_scale``, ``a_t`` =
    ``teacher_logit_scale``): ``beta = 0`` gives ``KL(t || s)`` (forward KL),
    ``beta = 1`` ``KL(s || t)`` (reverse KL), otherwise ``beta KL(t || m) + (1 - beta) KL(s || m)`` with
    ``m = beta t + (1 - beta) s`` (GKD's generalized JSD, arXiv 2306.13649 Eq. 1, as TRL's
    ``generalized_jsd_loss``; no ``T**2`` factor); plus ``hard_label_weight * CE(c(a_s z_s), target)`` (no
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
        beta: in [0, 1]. temperature: finite, > 0, with a normal fp32 inverse (the one temperature check,
            ``core/options/schema.check_temperature``). hard_label_weight: finite and >= 0 (``ValueError`` otherwise);
            != 0 needs a target.
        ignore_index: default -100. reduction: ``"mean"`` (``sum / D``, ``D`` = the non-ignored tokens,
            all tokens without a target, or ``num_items_in_batch``; 0.0 for ``D = 0``:
            ``core/reduction.token_mean_scale``, the rule of every distillation loss), ``"sum"``, ``"none"``.
        num_items_in_batch: replaces the mean's denominator (int or one-element tensor).
        student_softcap, teacher_softcap: None or > 0, applied after the logit scales, before the
            temperature.
        logit_scale, teacher_logit_scale: each model's logits are first multiplied by its scale (as in
            :func:`fusedce.cross_entropy`; finite > 0, default 1.0). A scale != 1 costs one scaled copy of
            that model's logits (its dtype; autograd carries the student's scale into the gradient).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.
        batch_invariant: True promises (and checks, a bool) that each row's ``"none"`` loss and its row of
            the gradient are bitwise independent of the other rows, their number and the row's position
            (fixed device, dtype, thread count, version): both backends' row ops compute each row from
            its own logits in an order that depends on V only (the PyTorch one reduces a lone row on
            one intra-op thread, always), so it costs nothing here.

    A top-k teacher (stored ``teacher_ids`` / ``teacher_log_probs``) has its own door,
    :func:`fusedce.topk_distillation_loss`; passing those keywords here is a ``TypeError`` saying so.

    Returns:
        fp32 scalar, or fp32 ``(...)`` per token for ``"none"``; every reduction's backward is exact
        (per-token upstream gradients for ``"none"``). Memory: the backward recomputes from the saved
        logits and writes one ``student_logits``-shaped gradient.

    Raises:
        TypeError: non-float logits, a target that is not an integer tensor, an option of the wrong kind,
            ``teacher_ids=`` / ``teacher_log_probs=`` (pointing to :func:`fusedce.topk_distillation_loss`).
        ValueError: different V, different leading shapes or devices, a target of another shape, ``beta``
            outside [0, 1], ``temperature`` not finite > 0, ``hard_label_weight != 0`` without a target,
            a softcap <= 0, a logit scale not finite > 0, a bad ``reduction`` / ``num_items_in_batch``.
        IndexError: a target neither ``ignore_index`` nor in [0, V) (host sync; skipped under
            torch.compile / CUDA-graph capture, where such a row gives a NaN loss).
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
    ``teacher_hidden @ teacher_weight.T + teacher_bias``, never allocating BT x V logits.

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16; ``student_weight`` ``(V, H)`` and
            ``student_bias`` (optional) ``(V,)`` of the same dtype. Each model's logits are formed in
            fp32 from its values (exact products summed in fp32, never rounded to its dtype, no fp32
            copy of a weight: ``lm_head/fp32_linear.py``), the loss math in fp32.
        teacher_hidden: ``(..., Ht)`` with the student's leading shape (Ht may differ from H);
            ``teacher_weight`` ``(V, Ht)`` (the same V) and ``teacher_bias`` ``(V,)`` of one dtype (may
            differ from the student's). Constants: they never receive a gradient.
        target: as :func:`distillation_loss`, and so are ``beta``, ``temperature``,
            ``hard_label_weight``, ``ignore_index``, ``reduction``, ``num_items_in_batch``,
            ``student_softcap``, ``teacher_softcap``, ``logit_scale``, ``teacher_logit_scale`` and
            ``backend``. A logit scale ``a != 1`` is applied to the operands, ``(a h) @ W.T + a b`` (equal
            in real arithmetic; one scaled copy of that model's hidden states and bias in their dtype,
            exact for a power-of-two ``a``; the kernels are unchanged), as ``integrations/trl`` does.
        method: ``"chunked"`` (both models' logits ``chunk_size`` tokens at a time; with mean / sum the
            student's gradients are formed in the forward), ``"tiled"`` (vocabulary blocks smaller than V:
            no tensor of V or more elements besides the weights, biases and the student's gradients) or
            ``"auto"`` (the rule of :func:`fusedce.linear_cross_entropy`). Ignored tokens are dropped
            before the matmuls (one host sync per call; skipped under torch.compile / graph capture).
        chunk_size: None (automatic, ``lm_head/head.py``) or a positive integer;
            ``"chunked"`` only.
        deterministic: None follows ``torch.are_deterministic_algorithms_enabled()``; True selects
            backward paths without float atomics (bitwise run-to-run identical results).
        batch_invariant: True makes each row's ``"none"`` loss and its row of the student hidden
            gradient bitwise independent of the rest of the batch (other rows, their number, the row's
            position, ignored rows, ``chunk_size``), for a fixed device, dtype, thread count and version:
            the kept rows in chunks of exactly 64 (``lm_head/invariant.py``, the last padded with zero rows
            of both models that get no gradient; ``chunk_size`` is then 64), with ``method="tiled"`` in
            whole token tiles, the gradients without atomics. The weight and bias gradients, sums over
            rows, are exempt.

    A top-k teacher has its own door, :func:`fusedce.linear_topk_distillation_loss`; ``teacher_ids=`` /
    ``teacher_log_probs=`` here are a ``TypeError`` saying so.

    Returns:
        As :func:`distillation_loss`; gradients of the student's hidden, weight and bias in their dtypes
        (weight / bias gradients accumulated in fp32).

    Raises:
        The errors of :func:`distillation_loss` (V compared between the heads), plus ``ValueError`` for
        ``hidden.shape[-1] != weight.shape[1]`` (per model), a bias that is not ``(V,)``, a bad ``method``
        or ``chunk_size``; ``TypeError`` for a model whose hidden / weight / bias dtypes differ or a
        ``deterministic`` that is not None or a bool.
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
