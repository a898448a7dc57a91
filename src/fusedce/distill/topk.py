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
    """The K-class target of the student op: the teacher's ids, ``ignore_index`` on padding entries
    (``teacher_log_probs == -inf`` or an id equal to ``ignore_index``) and on every entry of an ignored token; with
    ``fold_target`` the hard label as a (K+1)-th class."""
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
    """``(p_tail, teacher_mass)`` per token fp32: ``teacher_mass = sum_k p_k`` over the kept entries and ``p_tail =
    max(0, 1 - teacher_mass)``, summed in float64 from the stored log-probs (O(BT K); the subtraction is then exact
    to the input's own precision)."""
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
    """``(p_tail, teacher_mass, active, excluded)`` per token (flat): the teacher's tail and mass
    (``_teacher_tail``), the tokens whose tail term counts (non-ignored, ``p_tail > 0``) and the (N, K)
    classes to exclude from the student's tail (-1: none; all -1 on the inactive tokens)."""
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
    """The student given as its LM head: the tokens it needs are kept once (``select``: the call's one
    compaction, one host sync, skipped where ``compact_rows`` skips it), then every pass (the K classes,
    the hard label at temperature 1, the tail) runs on those rows and scatters its results back (0
    elsewhere: what the passes give an ignored token). The passes on the kept rows are ``class_log_probs``
    and ``kept_log_tail`` (the vocab-parallel form, ``distributed/topk_distill.py``, replaces those two)."""
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
    """Per token ``sum_k p_k (lp_k - log_s_k)`` over the kept entries (+ the tail term, fp32 ``(...)`` or
    None; + the hard-label CE), reduced with the distillation losses' one mean rule
    (``core/reduction.token_mean_scale``)."""
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
    """The reduced loss of both public ops (or ``TopkDistillationOutput`` with ``call.return_stats``),
    once their arguments are checked (``call``): ``student`` (``_LogitRows`` / ``HeadRows``, or the
    vocab-parallel forms' rows, ``distributed/topk_distill.py``) gives the
    internal K-class op's fp32 ``(N, K)`` log-probs (``rl/kclass.py``) and, with ``tail=True``, the
    student's ``log s_tail`` (``distill/tail.py``)."""
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

    Per token: ``sum_k p_k (log p_k - log s[id_k])`` with ``p_k = exp(teacher_log_probs_k)`` as stored
    (not renormalized: without ``tail`` the teacher's mass outside the K classes contributes nothing,
    axolotl's convention), ``s = softmax(c(a z_s) / T)``, ``c(x) = softcap * tanh(x / softcap)``
    (``student_softcap``, when given), ``a`` = ``logit_scale``; with ``tail=True`` plus ``p_tail log(p_tail
    / s_tail)`` (the module docstring: the (K+1)-th bin); plus ``hard_label_weight * CE(c(a z_s),
    target)`` (no temperature). No ``T**2`` factor (as TRL and axolotl).

    Args:
        student_logits: ``(..., V)`` float32 / bfloat16 / float16; never modified; receives the gradient.
        teacher_ids: ``(..., K)`` int64 / int32, classes in [0, V); an entry equal to ``ignore_index``
            is padding, as is one whose log-prob is ``-inf`` (its id is then never read). Constant.
        teacher_log_probs: ``(..., K)`` float (any float dtype, read in fp32), natural-log probabilities
            (<= 0); ``-inf`` marks padding (TRL's servers pad with -inf): such entries contribute 0,
            whatever their id. Constant (never receives a gradient). A kept value > 1e-6 (+inf
            included) is a ``ValueError`` (probabilities or logits passed), and so, with ``tail``, is a
            token whose K probabilities sum above 1 by more than its dtype's rounding
            (``core/options/distill.teacher_mass_slack``); one host sync, skipped under torch.compile /
            CUDA-graph capture as the target-range check. NaN is not checked and gives a NaN loss.
        target: None (every token counts) or ``(...)`` int64 / int32: tokens equal to ``ignore_index``
            contribute 0 and get exactly zero gradient; the hard labels.
        temperature: finite, > 0, with a normal fp32 inverse (``core/options/schema.check_temperature``,
            the one temperature check of the RL and distillation ops), applied to the student (the
            teacher's log-probs are used as given).
        hard_label_weight: finite; != 0 needs a target. At ``temperature == 1`` the hard label is the
            (K+1)-th class of the same pass; otherwise it takes a second pass at temperature 1.
        ignore_index: default -100. reduction: ``"mean"`` (``sum / D``, ``D`` = the non-ignored tokens,
            all tokens without a target, or ``num_items_in_batch``; 0.0 for ``D = 0``:
            ``core/reduction.token_mean_scale``, the rule of every distillation loss), ``"sum"``,
            ``"none"`` (fp32 ``(...)``).
        num_items_in_batch: replaces the mean's denominator (int or one-element tensor).
        student_softcap: None or > 0, applied after ``logit_scale`` and before the temperature.
        logit_scale: the student's logits are first multiplied by it (as in :func:`fusedce.cross_entropy`;
            the teacher comes as log-probs, so it has no scale); > 0, inside the kernels (no copy).
        tail: bool; True adds the (K+1)-th bin ``p_tail log(p_tail / s_tail)``, ``p_tail = max(0, 1 -
            sum_k p_k)``, ``s_tail`` the student's mass outside the set of kept ids, from its row
            statistics with those classes masked (never by subtraction; ``distill/tail.py``, PyTorch ops
            on every backend: one more read of ``student_logits`` forward and one backward).
        return_stats: bool; True returns :class:`fusedce.TopkDistillationOutput` ``(loss, teacher_mass,
            student_mass)``: per token ``sum_k p_k`` and ``sum_k s[id_k]`` over the kept entries, fp32
            ``(...)``, no gradient, 0 on ignored tokens (with ``tail`` True or False).
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.

    Returns:
        fp32 scalar, or ``(...)`` for ``"none"`` (or the stats tuple above); exact backward for every
        reduction (through the internal K-class op of :func:`fusedce.token_log_probs`, ``rl/kclass.py``,
        and with ``tail`` the tail pass's explicit gradient: one ``student_logits``-shaped gradient).

    Raises:
        TypeError: non-float logits / teacher log-probs, non-integer ids or target, an option of the
            wrong kind (``tail`` / ``return_stats`` not a bool). ``tail=`` given to the dense
            :func:`fusedce.distillation_loss` is a ``TypeError`` pointing here.
        ValueError: shapes (``teacher_*`` not ``(..., K)`` with the student's leading shape, K = 0, a
            target of another shape), devices, ``temperature`` not finite > 0, ``hard_label_weight != 0``
            without a target, a bad ``reduction`` / ``num_items_in_batch`` / softcap / ``logit_scale``;
            ``teacher_log_probs`` with a positive value, or (``tail=True``) not normalized, naming the
            first such position.
        IndexError: a teacher id (of a non-padding entry of a non-ignored token) or a target neither
            ``ignore_index`` nor in [0, V) (one host sync; skipped under torch.compile / CUDA-graph
            capture, where such an entry gives a NaN loss).
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
    """:func:`topk_distillation_loss` of ``student_hidden @ student_weight.T + student_bias`` without
    ever allocating BT x V logits.

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16; ``student_weight`` ``(V, H)`` and
            ``student_bias`` (optional) ``(V,)`` of the same dtype (logits in fp32 from the operands'
            values, as the linear ops; the loss math in fp32).
        teacher_ids: as :func:`topk_distillation_loss`, and so are ``teacher_log_probs``, ``target``,
            ``temperature``, ``hard_label_weight``, ``ignore_index``, ``reduction``,
            ``num_items_in_batch``, ``student_softcap``, ``logit_scale`` (inside the kernels), ``tail``,
            ``return_stats`` and ``backend``. The tail pass (``distill/tail.py``) recomputes the logits
            in blocks of fewer than V classes whichever ``method``: one more head matmul forward and
            three backward (``grad_hidden``, ``grad_weight``, ``grad_bias`` accumulated in fp32), on the
            tokens the call keeps (below).
        method, chunk_size, deterministic: as :func:`fusedce.linear_token_log_probs` with a ``(..., K)``
            target (``"chunked"``: one chunk of logits at a time; ``"tiled"``: vocabulary tiles, plus
            gathers of the K teacher classes' weight rows). Tokens no pass needs (ignored; or all K
            entries padding, no hard label and no tail) cost no matmul FLOPs: one compaction for every
            pass (one host sync per call, skipped under torch.compile / CUDA-graph capture).

    Returns:
        As :func:`topk_distillation_loss`; gradients of the student's hidden, weight and bias in their
        dtypes.

    Raises:
        The errors of :func:`topk_distillation_loss`, and of :func:`fusedce.linear_distillation_loss` for
        the student's head (``student_hidden`` / ``student_weight`` / ``student_bias`` shapes, dtypes and
        devices), ``method``, ``chunk_size`` and ``deterministic``.
    """
    call = dc.checked_topk("student_hidden", student_hidden, student_weight, student_bias, teacher_ids,
                           teacher_log_probs, target, temperature=temperature, hard_label_weight=hard_label_weight,
                           ignore_index=ignore_index, reduction=reduction, num_items_in_batch=num_items_in_batch,
                           student_softcap=student_softcap, logit_scale=logit_scale, backend=backend,
                           method=method, chunk_size=chunk_size, deterministic=deterministic, tail=tail,
                           return_stats=return_stats)

    student = HeadRows(call, student_hidden, student_weight, student_bias, method, chunk_size)
    return topk_loss(student, teacher_ids, teacher_log_probs, call, reduction, num_items_in_batch)
