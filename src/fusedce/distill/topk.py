"""Distillation from stored top-k teacher log-probs (offline knowledge distillation): the teacher is
given as ``teacher_ids (..., K)`` and ``teacher_log_probs (..., K)`` per token, as axolotl's ``kd``
datasets and TRL's teacher servers store them, instead of a teacher model.

Built on the K-class RL op (``token_log_probs`` / ``linear_token_log_probs`` with a ``(..., K)``
target): the student's ``log s[id_k]`` at the temperature come from one pass of its row statistics
(chunked or tiled by the existing methods, no new kernel), and autograd carries ``d loss / d log s_k
= -p_k / D`` into that op's exact backward. The teacher tensors are constants.

Convention for the teacher's remaining mass. Per non-ignored token, with ``p_k = exp(teacher_log_probs_k)``
AS STORED (not renormalized) and ``s = softmax(c(z_s) / T)`` over the whole vocabulary::

    loss = sum_k p_k (log p_k - log s[id_k])   (+ hard_label_weight * CE(c(z_s), target), no temperature)

The mass ``1 - sum_k p_k`` the teacher put outside its top k contributes nothing, and nothing pulls
the student's mass outside the K classes toward it: the forward KL restricted to the K terms. This is
axolotl's top-k ``kd`` loss (``integrations/kd/topk_logprob/forward_kl.py``: student log-softmax over
the full vocabulary at ``kd_temperature``, gathered at the teacher's ids, ``sum p_k (log p_k - log
s_k)`` over the valid entries, no ``T**2``; its docstring asks for teacher log-probs already
renormalized over the k, which is then the caller's choice here too). TRL's ``ServerDistillationTrainer``
(experimental, TRL 1.16) instead defaults to a (K+1)-th "tail" bucket ``log(1 - sum p_k)`` on both sides
(``loss_add_tail=True``), or renormalizes both over the K (``loss_add_tail=False``); neither is this
loss. With all the teacher's mass in the K classes (``sum_k p_k = 1``) the three agree up to the
student's own tail. The value can be negative when the student puts more mass than the teacher on the
K classes.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from fusedce.core.entrance import public_op
from fusedce.core import validation as val
from fusedce.core.options import REDUCTIONS
from fusedce.rl.log_probs import linear_token_log_probs, token_log_probs
from fusedce.core.options.checks import fp32_range, integer_option, real_option
from fusedce.core.reduction import _given, mean_scale


def _options(temperature, hard_label_weight, ignore_index, reduction, target, num_items_in_batch, device):
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    temperature = real_option("temperature", temperature)
    if not temperature > 0.0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    hard_label_weight = fp32_range("hard_label_weight", real_option("hard_label_weight", hard_label_weight))
    if hard_label_weight != 0.0 and target is None:
        raise ValueError(f"hard_label_weight = {hard_label_weight} needs a target (the hard labels); got target=None")
    val.check_num_items(num_items_in_batch, device)
    return temperature, hard_label_weight, integer_option("ignore_index", ignore_index)


def _check_teacher(teacher_ids, teacher_log_probs, lead, device) -> None:
    """``teacher_ids`` int64 / int32 and ``teacher_log_probs`` float, both ``(*lead, K)`` on ``device``."""
    for name, t in (("teacher_ids", teacher_ids), ("teacher_log_probs", teacher_log_probs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if teacher_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"teacher_ids must be int64 or int32, got {teacher_ids.dtype}")
    if not teacher_log_probs.is_floating_point():
        raise TypeError(f"teacher_log_probs must be a float tensor, got {teacher_log_probs.dtype}")
    if tuple(teacher_ids.shape) != tuple(teacher_log_probs.shape):
        raise ValueError(f"teacher_ids {tuple(teacher_ids.shape)} and teacher_log_probs "
                         f"{tuple(teacher_log_probs.shape)} must have the same shape (..., K)")
    if teacher_ids.dim() != len(lead) + 1 or tuple(teacher_ids.shape[:-1]) != tuple(lead):
        raise ValueError(f"teacher_ids / teacher_log_probs of shape {tuple(teacher_ids.shape)} must be (..., K) "
                         f"with (...) = the student's leading shape {tuple(lead)}")
    if teacher_ids.shape[-1] == 0:
        raise ValueError("teacher_ids / teacher_log_probs have K = 0 classes per token; K >= 1 is needed")
    for name, t in (("teacher_ids", teacher_ids), ("teacher_log_probs", teacher_log_probs)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but the student is on {device}")


def _check_hard_target(target, lead, device, n_classes: int, ignore_index: int, hard_label_weight: float) -> None:
    """``target``: None or int ``(*lead)`` on ``device``; its range is checked here only when the student
    op will not see it (``hard_label_weight == 0``: it only masks tokens), else by that op."""
    if target is None:
        return
    val.check_target(target, lead, device)
    if hard_label_weight == 0.0:
        val.check_target_range(target, n_classes, ignore_index)


def _checked(name, student, shape_error, teacher_ids, teacher_log_probs, target, temperature, hard_label_weight,
             ignore_index, reduction, num_items_in_batch):
    """The checks both public ops start with: ``student`` (their logits or hidden states, ``name``) a float
    tensor of at least one dimension (else ``ValueError(shape_error)``), the scalar options, the teacher's
    top-K. Returns ``(lead, temperature, hard_label_weight, ignore_index)``, ``lead`` the leading shape."""
    val.check_float(name, student)
    if student.dim() < 1:
        raise ValueError(shape_error)
    lead = student.shape[:-1]
    options = _options(temperature, hard_label_weight, ignore_index, reduction, target, num_items_in_batch,
                       student.device)
    _check_teacher(teacher_ids, teacher_log_probs, lead, student.device)
    return (lead, *options)


def _classes(teacher_ids, teacher_log_probs, target, ignore_index: int, fold_target: bool):
    """The K-class target of the student op: the teacher's ids, ``ignore_index`` on padding entries
    (``teacher_log_probs == -inf`` or an id equal to ``ignore_index``) and on every entry of an ignored
    token; with ``fold_target`` the hard label as a (K+1)-th class. Also ``(p (..., K) fp32, 0 on the
    masked entries; teacher log-probs fp32; the entry mask)``. No host sync."""
    ids = teacher_ids.long()
    lp = teacher_log_probs.detach().float()
    keep = (lp != float("-inf")) & (ids != ignore_index)
    if target is not None:
        keep = keep & (target != ignore_index)[..., None]
    classes = torch.where(keep, ids, ignore_index)
    if fold_target:
        classes = torch.cat([classes, target.long()[..., None]], dim=-1)
    return classes, torch.where(keep, lp.exp(), 0.0), lp, keep


def _loss(log_s, p, lp, keep, target, hard, hard_label_weight, ignore_index, reduction, num_items_in_batch):
    """Per token ``sum_k p_k (lp_k - log_s_k)`` over the kept entries (+ the hard-label CE), reduced."""
    K = p.shape[-1]
    rows = torch.where(keep, p * (lp - log_s[..., :K]), 0.0).sum(-1)
    if hard is not None:
        rows = rows - hard_label_weight * hard   # hard: log_softmax(c(z))[target], 0 on ignored rows
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        denominator = _given(num_items_in_batch, total.device)
    elif target is not None:
        denominator = (target != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.full((), float(rows.numel()), dtype=torch.float32, device=total.device)
    return total * mean_scale(denominator)


def _student_log_probs(op, classes, target, temperature, hard_label_weight, fold_target: bool, **kw):
    """``(log_s (..., K[+1]), hard log-prob (...) or None)``: one call of the K-class op, plus a
    one-class call at temperature 1 for the hard label when it could not be folded in."""
    try:
        log_s = op(classes, temperature=temperature, **kw)
    except val.TargetOutOfRange as error:   # the hard label was checked before: a teacher id is out of range
        position, teacher_k = error.position, classes.shape[-1] - (1 if fold_target else 0)
        if not position or position[-1] >= teacher_k:
            raise
        raise IndexError(f"teacher_ids{list(position)} = {error.value} is out of range: expected a class in "
                         f"[0, {error.n_classes}) (V = {error.n_classes}), or ignore_index={error.ignore_index} "
                         "(or a -inf log-prob) for a padding entry") from None
    if hard_label_weight == 0.0:
        return log_s, None
    if fold_target:
        return log_s, log_s[..., -1]
    return log_s, op(target, temperature=1.0, **kw)


def _topk_loss(op, teacher_ids, teacher_log_probs, target, temperature, hard_label_weight, ignore_index, reduction,
               num_items_in_batch):
    """The reduced loss of both public ops, once their arguments are checked: ``op(classes, temperature)``
    gives the student's log-probs of ``classes`` (``token_log_probs`` on logits or on the LM head)."""
    fold = hard_label_weight != 0.0 and temperature == 1.0
    classes, p, lp, keep = _classes(teacher_ids, teacher_log_probs, target, ignore_index, fold)
    log_s, hard = _student_log_probs(op, classes, target, temperature, hard_label_weight, fold)
    return _loss(log_s, p, lp, keep, target, hard, hard_label_weight, ignore_index, reduction, num_items_in_batch)


@public_op("logits")
def topk_distillation_loss(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
                           teacher_log_probs: torch.Tensor, target: Optional[torch.Tensor] = None, *,
                           temperature: float = 1.0, hard_label_weight: float = 0.0, ignore_index: int = -100,
                           reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                           student_softcap: Optional[float] = None, backend: Optional[str] = None) -> torch.Tensor:
    """Forward KL from stored top-k teacher log-probs to the student, over the teacher's K classes.

    Per token: ``sum_k p_k (log p_k - log s[id_k])`` with ``p_k = exp(teacher_log_probs_k)`` as stored
    (not renormalized: the teacher's mass outside the K classes contributes nothing, axolotl's
    convention; module docstring: TRL's tail-bucket alternative), ``s = softmax(c(z_s) / T)``, ``c(x)
    = softcap * tanh(x / softcap)`` (``student_softcap``, when given); plus ``hard_label_weight *
    CE(c(z_s), target)`` (no temperature). No ``T**2`` factor (as TRL and axolotl).

    Args:
        student_logits: ``(..., V)`` float32 / bfloat16 / float16; never modified; receives the gradient.
        teacher_ids: ``(..., K)`` int64 / int32, classes in [0, V); an entry equal to ``ignore_index``
            is padding, as is one whose log-prob is ``-inf`` (its id is then never read). Constant.
        teacher_log_probs: ``(..., K)`` float (any float dtype, read in fp32), natural-log probabilities;
            ``-inf`` marks padding (TRL's servers pad with -inf): such entries contribute 0, whatever
            their id. Constant (never receives a gradient). NaN / +inf are not checked (no host
            sync) and give a NaN loss.
        target: None (every token counts) or ``(...)`` int64 / int32: tokens equal to ``ignore_index``
            contribute 0 and get exactly zero gradient; the hard labels.
        temperature: finite, > 0, applied to the student (the teacher's log-probs are used as given).
        hard_label_weight: finite; != 0 needs a target. At ``temperature == 1`` the hard label is the
            (K+1)-th class of the same pass; otherwise it takes a second pass at temperature 1.
        ignore_index: default -100. reduction: ``"mean"`` (over non-ignored tokens, all tokens without a
            target, or ``num_items_in_batch``; 0.0 for 0), ``"sum"``, ``"none"`` (fp32 ``(...)``).
        num_items_in_batch: replaces the mean's denominator (int or one-element tensor).
        student_softcap: None or > 0, applied before the temperature.
        backend: ``"auto"`` / ``"torch"`` / ``"triton"``; None reads ``$FUSEDCE_BACKEND``.

    Returns:
        fp32 scalar, or ``(...)`` for ``"none"``; exact backward for every reduction (through
        :func:`fusedce.token_log_probs`'s K-class form: one ``student_logits``-shaped gradient).

    Raises:
        TypeError: non-float logits / teacher log-probs, non-integer ids or target.
        ValueError: shapes (``teacher_*`` not ``(..., K)`` with the student's leading shape, K = 0, a
            target of another shape), devices, ``temperature`` not finite > 0, ``hard_label_weight != 0``
            without a target, a bad ``reduction`` / ``num_items_in_batch`` / softcap.
        IndexError: a teacher id (of a non-padding entry of a non-ignored token) or a target neither
            ``ignore_index`` nor in [0, V) (the ops' host sync; skipped under torch.compile / CUDA-graph
            capture, where such an entry gives a NaN loss).
        RuntimeError: a backend without the K-class op (``"cute"``).
    """
    lead, temperature, hard_label_weight, ignore_index = _checked(
        "student_logits", student_logits, "student_logits must have at least one dimension (the classes, last)",
        teacher_ids, teacher_log_probs, target, temperature, hard_label_weight, ignore_index, reduction,
        num_items_in_batch)
    device = student_logits.device
    _check_hard_target(target, lead, device, student_logits.shape[-1], ignore_index, hard_label_weight)

    def op(t, temperature):
        return token_log_probs(student_logits, t, temperature=temperature, softcap=student_softcap,
                               ignore_index=ignore_index, backend=backend)

    return _topk_loss(op, teacher_ids, teacher_log_probs, target, temperature, hard_label_weight, ignore_index,
                      reduction, num_items_in_batch)


@public_op("linear", linear=(("student_hidden", "student_weight", "student_bias"),))
def linear_topk_distillation_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                                  teacher_ids: torch.Tensor, teacher_log_probs: torch.Tensor,
                                  target: Optional[torch.Tensor] = None, *,
                                  student_bias: Optional[torch.Tensor] = None, temperature: float = 1.0,
                                  hard_label_weight: float = 0.0, ignore_index: int = -100,
                                  reduction: str = "mean", num_items_in_batch: Union[int, torch.Tensor, None] = None,
                                  student_softcap: Optional[float] = None, method: str = "auto",
                                  chunk_size: Optional[int] = None, backend: Optional[str] = None,
                                  deterministic: Optional[bool] = None) -> torch.Tensor:
    """:func:`topk_distillation_loss` of ``student_hidden @ student_weight.T + student_bias`` without
    ever allocating BT x V logits.

    Args:
        student_hidden: ``(..., H)`` float32 / bfloat16 / float16; ``student_weight`` ``(V, H)`` and
            ``student_bias`` (optional) ``(V,)`` of the same dtype (logits in that dtype with fp32
            accumulation, as ``F.linear``; the loss math in fp32).
        teacher_ids: as :func:`topk_distillation_loss`, and so are ``teacher_log_probs``, ``target``,
            ``temperature``, ``hard_label_weight``, ``ignore_index``, ``reduction``,
            ``num_items_in_batch``, ``student_softcap`` and ``backend``.
        method, chunk_size, deterministic: as :func:`fusedce.linear_token_log_probs` with a ``(..., K)``
            target (``"chunked"``: one chunk of logits at a time; ``"tiled"``: vocabulary tiles, plus
            gathers of the K teacher classes' weight rows). Tokens with no class left (ignored, or all
            K entries padding, and no hard label) cost no matmul FLOPs (one host sync per call).

    Returns:
        As :func:`topk_distillation_loss`; gradients of the student's hidden, weight and bias in their
        dtypes.

    Raises:
        The errors of :func:`topk_distillation_loss` and of :func:`fusedce.linear_token_log_probs` (head
        shapes, ``method``, ``chunk_size``).
    """
    lead, temperature, hard_label_weight, ignore_index = _checked(
        "student_hidden", student_hidden, "student_hidden must be (..., H)", teacher_ids, teacher_log_probs, target,
        temperature, hard_label_weight, ignore_index, reduction, num_items_in_batch)
    device = student_hidden.device
    val.check_float("student_weight", student_weight)
    if student_weight.dim() != 2:
        raise ValueError(f"student_weight must be (V, H), got {tuple(student_weight.shape)}")
    _check_hard_target(target, lead, device, student_weight.shape[0], ignore_index, hard_label_weight)

    def op(t, temperature):
        return linear_token_log_probs(student_hidden, student_weight, t, student_bias, temperature=temperature,
                                      softcap=student_softcap, ignore_index=ignore_index, chunk_size=chunk_size,
                                      method=method, backend=backend, deterministic=deterministic)

    return _topk_loss(op, teacher_ids, teacher_log_probs, target, temperature, hard_label_weight, ignore_index,
                      reduction, num_items_in_batch)
