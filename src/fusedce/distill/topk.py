"""Distillation from stored top-k teacher log-probs (offline knowledge distillation): the teacher is given as
``teacher_ids (..., K)`` and ``teacher_log_probs (..., K)`` per token, as axolotl's ``kd`` datasets and TRL's
teacher servers store them, instead of a teacher model."""
from __future__ import annotations

from typing import Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce.core.reduction import token_mean_scale
from fusedce.core.types import TopkDistillationOutput
from fusedce.distill import checks as dc
from fusedce.distill import tail as student_tail
from fusedce.lm_head.head import compact_rows, resolve_method, scatter_rows
from fusedce.rl import kclass


def _classes(teacher_ids, teacher_log_probs, target, ignore_index: int, fold_target: bool):
    """The K-class target of the student op: the teacher's ids, ``ignore_index`` on padding and ignored tokens;
    with ``fold_target`` the hard label as a (K+1)-th class."""
    ids = teacher_ids.long()
    lp = teacher_log_probs.detach().float()
    keep = (lp != float("-inf")) & (ids != ignore_index)
    if target is not None:
        keep = keep & (target != ignore_index)[..., None]
    classes = torch.where(keep, ids, ignore_index)
    if fold_target:
        classes = torch.cat([classes, target.long()[..., None]], dim=-1)
    return classes, torch.where(keep, lp.exp(), 0.0), lp, keep


def _teacher_tail(lp, keep, ids, n_classes: int):
    """``(p_tail, teacher_mass)`` per token fp32, summed in float64 from the stored log-probs."""
    mass = torch.where(keep, lp.double().exp(), 0.0).sum(-1)
    p_tail = (1.0 - mass).clamp(min=0.0)
    noise = keep.sum(-1, dtype=torch.float64) * (torch.finfo(lp.dtype).eps / 2)
    p_tail = torch.where(p_tail <= noise, 0.0, p_tail)
    if ids.shape[-1] >= n_classes:
        ordered = torch.where(keep, ids.long(), -1).sort(dim=-1).values
        fresh = torch.ones_like(keep)
        fresh[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
        distinct = (fresh & (ordered >= 0)).sum(-1)
        p_tail = torch.where(distinct >= n_classes, 0.0, p_tail)
    return p_tail.float(), mass.float()


def _tail_inputs(teacher_ids, lp, keep, target, call: dc.TopkCall):
    """``(p_tail, teacher_mass, active, excluded)`` per flat token: the tokens whose tail term counts and the (N, K)
    classes excluded from the student's tail (-1: none)."""
    k = keep.shape[-1]
    flat_keep, flat_ids = keep.reshape(-1, k), teacher_ids.reshape(-1, k).long()
    p_tail, mass = _teacher_tail(lp.reshape(-1, k), flat_keep, flat_ids, call.n_classes)
    active = p_tail > 0
    if target is not None:
        active = active & (target.reshape(-1) != call.ignore_index)
    excluded = torch.where(flat_keep & active[:, None], flat_ids, -1)
    return p_tail, mass, active, excluded


def _tail_term(log_s_tail, p_tail, active, call: dc.TopkCall):
    """``p_tail log(p_tail / s_tail)`` per token, fp32 ``(...)``: 0 where ``p_tail = 0`` (and no gradient
    there) or the token is ignored; ``log_s_tail`` (N,) the student's (its inactive values unused)."""
    log_p_tail = torch.where(active, p_tail, 1.0).log()
    term = torch.where(active, p_tail * (log_p_tail - torch.where(active, log_s_tail, 0.0)), 0.0)
    return term.reshape(call.lead)


class _LogitRows:
    """The student given as logits: the K-class op and the tail pass on ``logits`` (no compaction)."""
    compacts = False

    def __init__(self, call: dc.TopkCall, logits):
        self.call, self.logits = call, logits

    def select(self, needed) -> None:
        pass

    def log_probs(self, classes, opts):
        return kclass.log_probs_rows(self.call.impl, self.logits, classes, opts, False)[0]

    def log_tail(self, excluded):
        flat = self.logits.reshape(-1, self.call.n_classes)
        return student_tail.log_tail_logits(flat, excluded, self.call.opts)


class HeadRows:
    """The student given as its LM head: the needed tokens kept once (``select``, one host sync), every pass run on
    them and scattered back (0 elsewhere)."""
    compacts = True

    def __init__(self, call: dc.TopkCall, hidden, weight, bias, method, chunk_size):
        self.call, self.weight, self.bias = call, weight, bias
        self.method, self.chunk_size = method, chunk_size
        self.hidden = hidden.reshape(-1, hidden.shape[-1])
        self.n, self.index = self.hidden.shape[0], None

    def select(self, needed) -> None:
        ignore = self.call.ignore_index
        rep = torch.where(needed, 0 if ignore != 0 else 1, ignore)
        self.hidden, _, self.index = compact_rows(self.hidden, rep, ignore)

    def _kept(self, t):
        return t if self.index is None else t.index_select(0, self.index)

    def class_log_probs(self, classes, opts):
        """(n', K) fp32 log-probs of the kept rows' ``classes`` (n', K)."""
        return kclass.linear_log_probs_rows(self.call.impl, self.hidden, self.weight, classes, self.bias, opts, False,
                                           self.chunk_size, self.method, self.call.deterministic, compact=False)[0]

    def kept_log_tail(self, excluded):
        """(n',) fp32 ``log s_tail`` of the kept rows, ``excluded`` (n', K)."""
        return student_tail.log_tail_linear(self.hidden, self.weight, self.bias, excluded, self.call.opts,
                                            resolve_method(self.method))

    def log_probs(self, classes, opts):
        flat = classes.reshape(-1, classes.shape[-1])
        out = self.class_log_probs(self._kept(flat), opts)
        return out if self.index is None else out.new_zeros(self.n, out.shape[1]).index_copy(0, self.index, out)

    def log_tail(self, excluded):
        return scatter_rows(self.kept_log_tail(self._kept(excluded)), self.index, self.n, 0.0)


def _loss(log_s, p, lp, keep, target, hard, tail_term, call: dc.TopkCall, reduction, num_items_in_batch):
    """Per token ``sum_k p_k (lp_k - log_s_k)`` (+ the tail term, + the hard-label CE), reduced with
    ``core/reduction.token_mean_scale``."""
    K = p.shape[-1]
    rows = torch.where(keep, p * (lp - log_s[..., :K]), 0.0).sum(-1)
    if tail_term is not None:
        rows = rows + tail_term
    if hard is not None:
        rows = rows - call.hard_label_weight * hard   # hard: log_softmax(c(z))[target], 0 on ignored rows
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    return total * token_mean_scale(target, rows.numel(), call.ignore_index, num_items_in_batch, total.device)


def topk_loss(student, teacher_ids, teacher_log_probs, call: dc.TopkCall, reduction, num_items_in_batch):
    """The loss of both public top-k ops once ``call`` is checked: ``student`` (``_LogitRows``, ``HeadRows`` or the
    vocab-parallel rows) gives the K-class log-probs and, with ``tail``, ``log s_tail``."""
    target, shape = call.target, tuple(call.lead)
    fold = call.hard_label_weight != 0.0 and call.temperature == 1.0
    classes, p, lp, keep = _classes(teacher_ids, teacher_log_probs, target, call.ignore_index, fold)
    dc.check_topk_ranges(classes, target, call, fold)
    dc.check_teacher_values(teacher_ids, teacher_log_probs, target, call.ignore_index, call.tail)
    second_pass = call.hard_label_weight != 0.0 and not fold   # the hard label at temperature 1
    tail = _tail_inputs(teacher_ids, lp, keep, target, call) if call.tail else None
    if student.compacts:   # the tokens any pass needs
        needed = (classes != call.ignore_index).any(-1).reshape(-1)
        if second_pass:
            needed = needed | (target.reshape(-1) != call.ignore_index)
        if tail is not None:
            needed = needed | tail[2]
        student.select(needed)
    log_s = student.log_probs(classes, call.opts).reshape(classes.shape)
    hard = None
    if call.hard_label_weight != 0.0:
        hard = student.log_probs(target[..., None], call.hard_opts).reshape(shape) if second_pass else log_s[..., -1]
    tail_term = mass = None
    if tail is not None:
        p_tail, mass, active, excluded = tail
        tail_term = _tail_term(student.log_tail(excluded), p_tail, active, call)
        mass = mass.reshape(shape)
    loss = _loss(log_s, p, lp, keep, target, hard, tail_term, call, reduction, num_items_in_batch)
    if not call.return_stats:
        return loss
    if mass is None:
        mass = torch.where(keep, lp.double().exp(), 0.0).sum(-1).float()
    student_mass = torch.where(keep, log_s.detach()[..., :p.shape[-1]].exp(), 0.0).sum(-1)
    return TopkDistillationOutput(loss, mass.reshape(shape), student_mass.reshape(shape))


@public_op("logits")
def topk_distillation_loss(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
                           teacher_log_probs: torch.Tensor, target: Optional[torch.Tensor] = None, *,
                           temperature: float = 1.0, hard_label_weight: float = 0.0, ignore_index: int = -100,
                           reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                           student_softcap: Optional[float] = None, logit_scale: float = 1.0,
                           tail: bool = False, return_stats: bool = False,
                           backend: Optional[str] = None) -> Union[torch.Tensor, TopkDistillationOutput]:
    """Forward KL from stored top-k teacher log-probs to the student, over the teacher's K classes.

    Per token ``sum_k p_k (log p_k - log s[id_k])``, ``p_k = exp(teacher_log_probs_k)`` as stored (axolotl's
    top-k ``kd`` loss), ``s = softmax(c(a z_s) / T)``; ``tail=True`` adds the (K+1)-th bin ``p_tail log(p_tail
    / s_tail)``; plus ``hard_label_weight * CE(c(a z_s), target)``. Semantics: docs/contract.md, "Distillation
    losses".

    Args:
        student_logits: ``(..., V)`` float32 / bfloat16 / float16; receives the gradient.
        teacher_ids: ``(..., K)`` int64 / int32 in [0, V); ``ignore_index`` marks padding.
        teacher_log_probs: ``(..., K)`` float, natural-log probabilities; ``-inf`` marks padding. Constant.
        target: None or ``(...)`` int64 / int32, the hard labels; ``ignore_index`` tokens add 0.
        temperature: finite > 0, applied to the student only.
        hard_label_weight: finite; != 0 needs a target.
        ignore_index: the ignored target / id value.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        num_items_in_batch: the mean's denominator (int or one-element tensor), if given.
        student_softcap: None or > 0.
        logit_scale: finite > 0, multiplies the student's logits.
        tail: bool; adds the teacher's and student's mass outside the K classes as one more bin.
        return_stats: bool; returns :class:`fusedce.TopkDistillationOutput` ``(loss, teacher_mass, student_mass)``.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.

    Returns:
        fp32 scalar, or ``(...)`` for ``"none"`` (or the stats tuple).

    Raises:
        TypeError: non-float logits or log-probs, non-integer ids or target, an option of the wrong kind.
        ValueError: shapes, devices, an option out of range, a positive teacher log-prob, or (``tail``) a
            teacher whose K probabilities sum above 1.
        IndexError: a teacher id or target outside [0, V) and not ``ignore_index`` (host sync).
        RuntimeError: a backend without the K-class op (``"cute"``).
    """
    call = dc.checked_topk("student_logits", student_logits, None, None, teacher_ids, teacher_log_probs, target,
                           temperature=temperature, hard_label_weight=hard_label_weight, ignore_index=ignore_index,
                           reduction=reduction, num_items_in_batch=num_items_in_batch,
                           student_softcap=student_softcap, logit_scale=logit_scale, backend=backend,
                           tail=tail, return_stats=return_stats)

    return topk_loss(_LogitRows(call, student_logits), teacher_ids, teacher_log_probs, call, reduction,
                      num_items_in_batch)


@public_op("linear", linear=(("student_hidden", "student_weight", "student_bias"),))
def linear_topk_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                                  teacher_ids: torch.Tensor, teacher_log_probs: torch.Tensor,
                                  target: Optional[torch.Tensor] = None, *,
                                  student_bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                                  hard_label_weight: float = 0.0, ignore_index: int = -100,
                                  reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                                  student_softcap: Optional[float] = None, logit_scale: float = 1.0,
                                  tail: bool = False, return_stats: bool = False,
                                  method: str = "auto", chunk_size: Optional[int] = None,
                                  backend: Optional[str] = None, deterministic: Optional[bool] = None
                                  ) -> Union[torch.Tensor, TopkDistillationOutput]:
    """:func:`topk_distillation_loss` of ``student_hidden @ student_weight.T + student_bias``, without BT x V logits.

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16.
        student_weight: ``(V, H)``, the hidden's dtype.
        teacher_ids, teacher_log_probs, target: as :func:`topk_distillation_loss`, and so are the options.
        student_bias: None or ``(V,)``, the hidden's dtype.
        method, chunk_size, deterministic: as :func:`fusedce.linear_token_log_probs`.

    Returns:
        As :func:`topk_distillation_loss`; gradients of the student's hidden, weight and bias in their dtypes.

    Raises:
        The errors of :func:`topk_distillation_loss` and of the student's head (shapes, dtypes, devices,
        ``method``, ``chunk_size``, ``deterministic``).
    """
    call = dc.checked_topk("student_hidden", student_hidden, student_weight, student_bias, teacher_ids,
                           teacher_log_probs, target, temperature=temperature, hard_label_weight=hard_label_weight,
                           ignore_index=ignore_index, reduction=reduction, num_items_in_batch=num_items_in_batch,
                           student_softcap=student_softcap, logit_scale=logit_scale, backend=backend,
                           method=method, chunk_size=chunk_size, deterministic=deterministic, tail=tail,
                           return_stats=return_stats)

    student = HeadRows(call, student_hidden, student_weight, student_bias, method, chunk_size)
    return topk_loss(student, teacher_ids, teacher_log_probs, call, reduction, num_items_in_batch)
