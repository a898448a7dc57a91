"""The one checked call of each distillation op (``checked_distill``, ``checked_topk``): every argument check
before any kernel, returning a frozen dataclass of the normalized arguments."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from fusedce import backends
from fusedce.core import validation as val
from fusedce.core.hints import distill_swap_hint
from fusedce.core.options import (REDUCTIONS, LossOptions, check_chunk_size, check_temperature, deterministic_mode,
                                  log_prob_options)
from fusedce.core.options.schema import check_flag, integer_option
from fusedce.core.options.distill import (LOG_PROB_SLACK, DistillOptions, distill_options, hard_label_weight_option,
                                         teacher_mass_slack)
from fusedce.lm_head.head import check_method, resolve_method


def check_pair(student: torch.Tensor, teacher: torch.Tensor, s_name: str, t_name: str) -> None:
    """The two models' tensors of the same tokens: leading shapes equal, one device (``ValueError``)."""
    if tuple(student.shape[:-1]) != tuple(teacher.shape[:-1]):
        raise ValueError(f"{s_name} {tuple(student.shape)} and {t_name} {tuple(teacher.shape)} must cover the "
                         f"same tokens: their leading shapes (all but the last dimension) differ")
    if student.device != teacher.device:
        raise ValueError(f"{t_name} is on {teacher.device} but {s_name} is on {student.device}")


def check_head(hidden, weight, bias, model: str, sharded: bool = False) -> None:
    """One model's ``hidden`` (..., H), ``weight`` (V, H), ``bias`` (V,) or None: float tensors of one dtype on one
    device, H > 0, V > 0; ``sharded``: a vocabulary slice, which may be empty."""
    h_name, w_name, b_name = f"{model}_hidden", f"{model}_weight", f"{model}_bias"
    if sharded:
        w_name, b_name = "weight_shard", "bias_shard"
    val.check_float(h_name, hidden)
    val.check_float(w_name, weight)
    if hidden.dim() < 1 or weight.dim() != 2:
        swapped = (f"; they look swapped: {h_name} is the hidden states (..., H), {w_name} the LM head's weight "
                   "(V, H)") if hidden.dim() == 2 else ""
        raise ValueError(f"{h_name} must be (..., H) and {w_name} (V, H); got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}{swapped}")
    val.check_nonzero(h_name, hidden.shape, -1, "H")
    if not sharded:
        val.check_nonzero(w_name, weight.shape, 0, "V")
    if hidden.shape[-1] != weight.shape[1]:
        transposed = ("; it looks transposed: the LM head is (V, H), the nn.Linear layout"
                      if weight.shape[0] == hidden.shape[-1] else "")
        raise ValueError(f"{h_name}.shape[-1] = {hidden.shape[-1]} must equal {w_name}.shape[1] = {weight.shape[1]}"
                         + transposed)
    if weight.device != hidden.device:
        raise ValueError(f"{w_name} is on {weight.device} but {h_name} is on {hidden.device}")
    val.check_vector(b_name, bias, weight.shape[0], hidden.device)
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise TypeError(f"{h_name}, {w_name} and {b_name} must share a dtype; got {hidden.dtype}, {weight.dtype}"
                        f"{'' if bias is None else ', ' + str(bias.dtype)}")


def check_vocab(student_v: int, teacher_v: int, what: str, hint: str = "") -> None:
    if student_v != teacher_v:
        raise ValueError(f"the student's and the teacher's heads must have the same vocabulary size V: {what} "
                         f"gives V = {student_v} for the student and {teacher_v} for the teacher" + hint)


def check_target(target, shape, device: torch.device, n_classes: int, ignore_index: int):
    """None, or an int64 / int32 tensor of ``shape`` on ``device`` (``TypeError`` / ``ValueError``), whose non-ignored
    values lie in [0, V) (``IndexError``; the one host sync, skipped under torch.compile / CUDA-graph capture)."""
    if target is None:
        return None
    val.check_target(target, shape, device)
    target = val.widen_target(target, ignore_index)
    val.check_target_range(target, n_classes, ignore_index)
    return target.reshape(-1)


def row_ops(backend, device: torch.device):
    """``(distill_rows, tiled_distill, name)`` of the chosen backend: whatever ``backends.get`` raises, a
    ``RuntimeError`` for a backend without distillation kernels (``"cute"``, ``Capabilities.distill``)."""
    impl = backends.get(backend, device, distill=True)
    return impl.distill_rows, impl.tiled_distill, impl.NAME


def check_logit_scale(name: str, value) -> float:
    """A ``logit_scale`` of a distillation op: the domain of the loss option of the same name
    (``LossOptions``: a finite real > 0 within fp32), its messages naming ``name``."""
    try:
        return LossOptions.checked(logit_scale=value).logit_scale
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("logit_scale", name, 1)) from None


@dataclasses.dataclass(frozen=True)
class DistillCall:
    """The checked arguments of ``distillation_loss`` / ``linear_distillation_loss``."""

    opts: DistillOptions
    lead: tuple                      # the tokens' leading shape
    target: Optional[torch.Tensor]   # flat, int64-safe, range-checked; or None
    rows_op: Any                     # the backend's distill_rows
    tiled_op: Any                    # the backend's tiled_distill
    logit_scale: float
    teacher_logit_scale: float
    deterministic: bool = False
    backend: str = "torch"           # the backend's name (its ``NAME``)


def checked_distill(student, teacher, target, *, beta, temperature, hard_label_weight, ignore_index, reduction,
                    num_items_in_batch, student_softcap, teacher_softcap, logit_scale, teacher_logit_scale,
                    backend, heads=None, method=None, chunk_size=None, deterministic=None) -> DistillCall:
    """Every check of a dense distillation op, the target's range (the one host sync) last; ``heads`` given: the
    linear form."""
    if heads is None:
        s_name, t_name = "student_logits", "teacher_logits"
        val.check_float(s_name, student)
        val.check_float(t_name, teacher)
        if student.dim() < 1 or teacher.dim() < 1:
            raise ValueError("student_logits and teacher_logits must have at least one dimension (the classes, last)")
        val.check_nonzero(s_name, student.shape, -1, "V")
        n_classes = student.shape[-1]
        check_vocab(n_classes, teacher.shape[-1], "the logits' last dimension")
    else:
        s_name, t_name = "student_hidden", "teacher_hidden"
        (ws, bs), (wt, bt) = heads
        check_head(student, ws, bs, "student")
        check_head(teacher, wt, bt, "teacher")
        n_classes = ws.shape[0]
        check_vocab(n_classes, wt.shape[0], "weight.shape[0]",
                    distill_swap_hint(tuple(student.shape), tuple(ws.shape), tuple(teacher.shape), tuple(wt.shape),
                                      tuple(target.shape) if isinstance(target, torch.Tensor) else None))
    check_pair(student, teacher, s_name, t_name)
    if heads is not None:
        check_chunk_size(chunk_size)
        check_method(method, chunk_size)
        deterministic = deterministic_mode(deterministic)
    opts = distill_options(beta, temperature, hard_label_weight, ignore_index, reduction, student_softcap,
                           teacher_softcap, target)
    val.check_num_items(num_items_in_batch, student.device)
    scales = (check_logit_scale("logit_scale", logit_scale),
              check_logit_scale("teacher_logit_scale", teacher_logit_scale))
    rows_op, tiled_op, name = row_ops(backend, student.device)
    lead = tuple(student.shape[:-1])
    flat_target = check_target(target, lead, student.device, n_classes, opts.ignore_index)
    return DistillCall(opts, lead, flat_target, rows_op, tiled_op, *scales, bool(deterministic), name)


@dataclasses.dataclass(frozen=True)
class TopkCall:
    """The checked arguments of ``topk_distillation_loss`` / ``linear_topk_distillation_loss``."""

    lead: tuple                      # the tokens' leading shape
    n_classes: int                   # V
    temperature: float
    hard_label_weight: float
    ignore_index: int
    target: Optional[torch.Tensor]   # (*lead), int64-safe (its range: check_topk_ranges); or None
    opts: LossOptions                # the student's log-probs at the temperature (log_prob_options)
    hard_opts: Optional[LossOptions]   # ... at temperature 1 (the hard label), or None without one
    impl: Any                        # the backend (entropy=True: the K-class op)
    deterministic: bool = False
    tail: bool = False               # the (K+1)-th bin (``distill/tail.py``)
    return_stats: bool = False


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


def checked_topk(name: str, student, weight, bias, teacher_ids, teacher_log_probs, target, *, temperature,
                 hard_label_weight, ignore_index, reduction, num_items_in_batch, student_softcap, logit_scale,
                 backend, method=None, chunk_size=None, deterministic=None, tail=False,
                 return_stats=False, sharded: bool = False) -> TopkCall:
    """Every check of a top-k distillation op but the value ranges (``check_topk_ranges``, ``check_teacher_values``);
    ``sharded``: the vocab-parallel slice, whose width the caller replaces by the global V."""
    linear = weight is not None
    tail = check_flag("tail", tail)
    return_stats = check_flag("return_stats", return_stats)
    val.check_float(name, student)
    if student.dim() < 1:
        raise ValueError(f"{name} must be (..., H)" if linear else
                         f"{name} must have at least one dimension (the classes, last)")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    temperature = check_temperature(temperature)
    hard_label_weight = hard_label_weight_option(hard_label_weight)
    if hard_label_weight != 0.0 and target is None:
        raise ValueError(f"hard_label_weight = {hard_label_weight} needs a target (the hard labels); got target=None")
    val.check_num_items(num_items_in_batch, student.device)
    ignore_index = integer_option("ignore_index", ignore_index)
    lead = tuple(student.shape[:-1])
    _check_teacher(teacher_ids, teacher_log_probs, lead, student.device)
    if linear:
        check_head(student, weight, bias, "student", sharded)
        check_chunk_size(chunk_size)
        check_method(method, chunk_size)
        deterministic = deterministic_mode(deterministic)
    n_classes = weight.shape[0] if linear else student.shape[-1]
    if target is not None:
        val.check_target(target, lead, student.device)
        target = val.widen_target(target, ignore_index)
    opts = log_prob_options(ignore_index, temperature, student_softcap, check_logit_scale("logit_scale", logit_scale))
    hard_opts = None if hard_label_weight == 0.0 else log_prob_options(ignore_index, 1.0, student_softcap, logit_scale)
    impl = backends.get(backend, student.device, entropy=True,
                        tiled=linear and resolve_method(method) == "tiled")
    return TopkCall(lead, n_classes, temperature, hard_label_weight, ignore_index, target, opts, hard_opts, impl,
                    bool(deterministic), tail, return_stats)


def check_teacher_values(teacher_ids, teacher_log_probs, target, ignore_index: int, tail: bool) -> None:
    """``ValueError`` naming ``teacher_log_probs`` for a kept value above ``LOG_PROB_SLACK`` and, with ``tail``, for
    a token whose kept probabilities sum above ``1 + teacher_mass_slack``."""
    if teacher_log_probs.numel() == 0 or not val.host_readable(teacher_log_probs, teacher_ids, target):
        return
    lp = teacher_log_probs.detach().float()
    keep = (lp != float("-inf")) & (teacher_ids != ignore_index)
    if target is not None:
        keep = keep & (target != ignore_index)[..., None]
    high = keep & (lp > LOG_PROB_SLACK)
    bad = high.any(-1)
    slack = teacher_mass_slack(teacher_log_probs.dtype, lp.shape[-1])
    if tail:
        mass = torch.where(keep & ~high, lp.double().exp(), 0.0).sum(-1)
        over = mass > 1.0 + slack
        bad = bad | over
    if not bool(bad.any()):   # the one sync
        return
    if bool(high.any()):   # (error paths only from here)
        pos = [int(i) for i in high.nonzero()[0]]
        raise ValueError(f"teacher_log_probs{pos} = {float(lp[tuple(pos)]):.6g} > 0: teacher_log_probs must be "
                         "natural-log probabilities (<= 0); these look like probabilities or logits "
                         "(pass .log() of the probabilities, or torch.log_softmax of the teacher's logits over the "
                         "vocabulary)")
    pos = [int(i) for i in over.nonzero()[0]]
    raise ValueError(f"teacher_log_probs{pos}: the teacher's K probabilities of this token sum to "
                     f"{float(mass[tuple(pos)]):.7g} > 1 + {slack:.2g} (rounding): with tail=True they must be "
                     "log-probs normalized over the whole vocabulary (the tail 1 - sum_k p_k would be negative); "
                     "take the log_softmax over all V classes before the top k, or use tail=False")


def check_topk_ranges(classes: torch.Tensor, target, call: TopkCall, folded: bool) -> None:
    """``IndexError`` for a hard label or a kept teacher id outside [0, V), in one host sync (skipped under capture)."""
    if classes.numel() == 0 or not val.host_readable(classes, target):
        return
    if target is not None and not folded:
        classes, folded = torch.cat([classes, target.long()[..., None]], dim=-1), True
    try:
        val.check_target_range(classes, call.n_classes, call.ignore_index)
    except val.TargetOutOfRange as error:
        if target is not None:
            val.check_target_range(target, call.n_classes, call.ignore_index)   # the target's own error first
        position, teacher_k = error.position, classes.shape[-1] - (1 if folded else 0)
        if not position or position[-1] >= teacher_k:   # the folded hard label
            raise val.TargetOutOfRange(
                f"target{list(position[:-1])} = {error.value} is out of range: expected ignore_index="
                f"{error.ignore_index} or a class in [0, {error.n_classes}) (V = {error.n_classes})",
                position[:-1], error.value, error.n_classes, error.ignore_index) from None
        raise IndexError(f"teacher_ids{list(position)} = {error.value} is out of range: expected a class in "
                         f"[0, {error.n_classes}) (V = {error.n_classes}), or ignore_index={error.ignore_index} "
                         "(or a -inf log-prob) for a padding entry") from None
