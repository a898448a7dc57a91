"""Distillation on Triton: the backend row ops ``distill_rows`` (logits in memory) and ``tiled_distill`` (no
logits of either model), as torch custom ops with fakes so that ``torch.compile`` traces them.

Layering as for the cross-entropy ops: ``kernels/distill_math.py`` (the formulas, once) ->
``kernels/distill_rows.py``, ``distill_tiled_stats.py``, ``distill_tiled_grad.py`` (the kernels, with
their passes and bytes / FLOPs per token) -> ``distill_launch.py`` (grid, arguments and meta-parameters
in one place; ``fusedce inspect`` compiles exactly these) -> the custom ops ``fusedce::distill_rows`` /
``fusedce::tiled_distill`` here (allocate + launch; a gradient not asked for comes back as a (0,)
tensor) -> ``distill_rows`` / ``tiled_distill`` (the typed entry points of the backend boundary, same
signatures as ``backends/pytorch``'s). No autograd here: the caller multiplies its upstream gradient into
``grad_factor`` before the call (forward and gradient are one call, as the fused chunk).

Passes over V per row: beta = 0 (forward KL) or beta = 1 (reverse KL): one for the loss (both lse's and
the divergence in one online pass), two with the gradient; 0 < beta < 1: two for the loss (the
generalized JSD's ``log m`` needs the normalized probabilities), three with the gradient (its row sum
``sum s g`` is the second pass's ``(1 - beta) KL(s || m)``). In the tiled form each pass recomputes both
heads' logits tiles, and ``deterministic`` runs the gradient pass as two kernels (one owner per gradient
row, no atomics: bitwise identical run to run) instead of one with fp32 atomics.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..layout import unit_stride
from .distill_launch import DistillKnobs, Heads, rows_launch, tiled_grad_launches, tiled_stats_launches

Opt = Optional[torch.Tensor]


def _check_options(beta, temperature, hard_label_weight, target, student_softcap, teacher_softcap) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hard_label_weight != 0.0 and target is None:
        raise ValueError("hard_label_weight != 0 needs a target")
    for name, cap in (("student_softcap", student_softcap), ("teacher_softcap", teacher_softcap)):
        if cap is not None and not cap > 0.0:
            raise ValueError(f"{name} must be > 0 or None, got {cap}")


def _check_rows(n: int, target: Opt, grad_factor: Opt) -> None:
    if target is not None and (target.shape != (n,) or target.is_floating_point()):
        raise ValueError(f"target must be an integer tensor of shape ({n},), got {tuple(target.shape)} "
                         f"{target.dtype}")
    if grad_factor is not None and (grad_factor.shape != (n,) or not grad_factor.is_floating_point()):
        raise ValueError(f"grad_factor must be a float tensor of shape ({n},), got {tuple(grad_factor.shape)} "
                         f"{grad_factor.dtype}")


def _knobs(target, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap):
    return DistillKnobs(float(beta), float(temperature), float(hard_label_weight), int(ignore_index),
                        None if student_softcap is None else float(student_softcap),
                        None if teacher_softcap is None else float(teacher_softcap), target is not None)


def _run(launches) -> None:
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)


# ---------------------------------------------------------------- rows (logits in memory)

@torch.library.custom_op("fusedce::distill_rows", mutates_args=())
def distill_rows_op(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: Opt, grad_factor: Opt,
                    beta: float, temperature: float, hard_label_weight: float, ignore_index: int,
                    student_softcap: Optional[float], teacher_softcap: Optional[float]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_rows (n,) fp32, grad (n, V) student's dtype, or (0,) without grad_factor)``."""
    loss, grad = _rows_buffers(student_logits, grad_factor is not None)
    if student_logits.shape[0] and student_logits.shape[1]:
        knobs = _knobs(target, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap)
        _run([rows_launch(unit_stride(student_logits), unit_stride(teacher_logits), target, grad_factor, knobs, loss,
                          grad if grad_factor is not None else None)])
    else:   # no rows or no classes: nothing to launch
        loss.zero_()
        grad.zero_()
    return loss, grad


def _new_rows(like: torch.Tensor, shape) -> torch.Tensor:
    """An uninitialized fp32 buffer that the kernels write whole (tests poison it through this function)."""
    return like.new_empty(shape, dtype=torch.float32)


def _rows_buffers(student_logits: torch.Tensor, with_grad: bool):
    n = student_logits.shape[0]
    grad = (student_logits.new_empty(student_logits.shape) if with_grad
            else student_logits.new_empty(0))
    return _new_rows(student_logits, n), grad


@distill_rows_op.register_fake
def _(student_logits, teacher_logits, target, grad_factor, beta, temperature, hard_label_weight, ignore_index,
      student_softcap, teacher_softcap):
    return _rows_buffers(student_logits, grad_factor is not None)


def distill_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, target: Opt, grad_factor: Opt, *,
                 beta: float, temperature: float, hard_label_weight: float, ignore_index: int,
                 student_softcap: Optional[float], teacher_softcap: Optional[float]
                 ) -> Tuple[torch.Tensor, Opt]:
    """Per-row distillation loss and its student-logit gradient (the formulas: ``kernels/distill_math.py``,
    oracle ``tests/references/reference64_distill.py``).

    Args:
        student_logits, teacher_logits: (N, V), any float dtypes (may differ), any row stride (a last dim
            that is not stride 1 is copied once). Upcast to fp32 after loading.
        target: (N,) int64 or None (no row ignored; ``hard_label_weight`` must then be 0). Targets out of
            [0, V) on non-ignored rows are the caller's to reject (not checked here: no host sync).
        grad_factor: (N,) float (any stride) or None (no gradient computed).
        beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap: as
            ``fusedce.distillation_loss`` (softcap None: none).
    Returns:
        ``(loss_rows, grad_student_logits)``: (N,) fp32, 0 on ignored rows; (N, V) contiguous in the
        student's dtype, ``grad_factor[r] * d loss_rows[r] / d student_logits[r, :]`` (exactly 0 on ignored
        rows), or None without ``grad_factor``. New tensors; the inputs are not written.
    Raises:
        ValueError: shapes that do not match, ``beta`` outside [0, 1], ``temperature <= 0``, a softcap
            <= 0, ``hard_label_weight != 0`` without a target.
    """
    if student_logits.dim() != 2 or teacher_logits.shape != student_logits.shape:
        raise ValueError(f"student and teacher logits must both be (N, V), got {tuple(student_logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}")
    _check_rows(student_logits.shape[0], target, grad_factor)
    _check_options(beta, temperature, hard_label_weight, target, student_softcap, teacher_softcap)
    loss, grad = torch.ops.fusedce.distill_rows(student_logits, teacher_logits, target, grad_factor, float(beta),
                                                float(temperature), float(hard_label_weight), int(ignore_index),
                                                student_softcap, teacher_softcap)
    return loss, (grad if grad_factor is not None else None)


# ---------------------------------------------------------------- tiled (no logits)

@torch.library.custom_op("fusedce::tiled_distill", mutates_args=())
def tiled_distill_op(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: Opt,
                     teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: Opt,
                     target: Opt, grad_factor: Opt, beta: float, temperature: float, hard_label_weight: float,
                     ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                     deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss_rows, grad_hidden, grad_weight, grad_bias)``; a gradient not computed is (0,)."""
    n, n_cols = student_hidden.shape[0], student_weight.shape[0]
    with_grad = grad_factor is not None
    loss = _new_rows(student_hidden, n)
    sh, sw, sb = _tiled_grad_shapes(student_hidden, student_weight, student_bias, with_grad)
    acc_h = student_hidden.new_zeros(sh, dtype=torch.float32)
    acc_w = student_hidden.new_zeros(sw, dtype=torch.float32)
    acc_b = student_hidden.new_zeros(sb, dtype=torch.float32)
    if n and n_cols:
        knobs = _knobs(target, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap)
        heads = Heads(unit_stride(student_hidden), unit_stride(student_weight),
                      None if student_bias is None else student_bias.contiguous(), unit_stride(teacher_hidden),
                      unit_stride(teacher_weight), None if teacher_bias is None else teacher_bias.contiguous())
        stats = _new_rows(student_hidden, (4, n))
        _run(tiled_stats_launches(heads, target, knobs, loss, stats))
        if with_grad:
            _run(tiled_grad_launches(heads, target, knobs, stats, grad_factor, acc_h, acc_w,
                                     acc_b if student_bias is not None else None, bool(deterministic)))
    else:
        loss.zero_()
    return loss, acc_h.to(student_hidden.dtype), acc_w, acc_b


def _tiled_grad_shapes(student_hidden, student_weight, student_bias, with_grad: bool):
    if not with_grad:
        return (0,), (0,), (0,)
    return (tuple(student_hidden.shape), tuple(student_weight.shape),
            (student_weight.shape[0],) if student_bias is not None else (0,))


@tiled_distill_op.register_fake
def _(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target,
      grad_factor, beta, temperature, hard_label_weight, ignore_index, student_softcap, teacher_softcap,
      deterministic):
    sh, sw, sb = _tiled_grad_shapes(student_hidden, student_weight, student_bias, grad_factor is not None)
    return (student_hidden.new_empty(student_hidden.shape[0], dtype=torch.float32), student_hidden.new_empty(sh),
            student_hidden.new_empty(sw, dtype=torch.float32), student_hidden.new_empty(sb, dtype=torch.float32))


def tiled_distill(student_hidden: torch.Tensor, student_weight: torch.Tensor, student_bias: Opt,
                  teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, teacher_bias: Opt,
                  target: Opt, grad_factor: Opt, *, beta: float, temperature: float, hard_label_weight: float,
                  ignore_index: int, student_softcap: Optional[float], teacher_softcap: Optional[float],
                  deterministic: bool) -> Tuple[torch.Tensor, Opt, Opt, Opt]:
    """Per-row distillation loss of two linear heads and the student head's gradients, with no logits of
    either model in memory (tiles of both heads' logits formed on chip: ``kernels/distill_tiled_*.py``).

    Args:
        student_hidden: (N, H); student_weight: (V, H) in student_hidden's dtype; student_bias: (V,) or
            None. teacher_hidden: (N, Ht); teacher_weight: (V, Ht) in teacher_hidden's dtype (H, Ht and the
            two heads' dtypes may differ; V must match); teacher_bias: (V,) or None. fp32 / bf16 / fp16.
        target, grad_factor, beta, temperature, hard_label_weight, ignore_index, student_softcap,
            teacher_softcap: as ``distill_rows``.
        deterministic: the gradient pass without atomics (bitwise identical run to run; one more
            recompute of both heads' logits).
    Returns:
        ``(loss_rows (N,) fp32, grad_hidden, grad_weight, grad_bias)``, the gradients already multiplied
        by ``grad_factor`` per row: grad_hidden (N, H) in student_hidden's dtype, grad_weight (V, H) and
        grad_bias (V,) in fp32 (the tiled cross-entropy op's default ``accum_dtype``), grad_bias None
        without a student bias; all three None without ``grad_factor``. Besides these, only (N,)- and
        (4, N)-sized fp32 buffers are allocated (the gradients' fp32 accumulators when N x H in fp32 is
        not the result). Logits are rounded to each head's dtype once (as ``F.linear``), then fp32 math.
    Raises:
        ValueError: mismatched shapes or dtypes (as listed), and the option errors of ``distill_rows``.
    """
    n, hs = student_hidden.shape if student_hidden.dim() == 2 else (None, None)
    if (student_hidden.dim() != 2 or student_weight.dim() != 2 or student_weight.shape[1] != hs
            or teacher_hidden.dim() != 2 or teacher_weight.dim() != 2 or teacher_hidden.shape[0] != n
            or teacher_weight.shape != (student_weight.shape[0], teacher_hidden.shape[1])):
        raise ValueError(f"expected student (N, H) x (V, H) and teacher (N, Ht) x (V, Ht), got "
                         f"{tuple(student_hidden.shape)} x {tuple(student_weight.shape)} and "
                         f"{tuple(teacher_hidden.shape)} x {tuple(teacher_weight.shape)}")
    for name, h, w, b in (("student", student_hidden, student_weight, student_bias),
                          ("teacher", teacher_hidden, teacher_weight, teacher_bias)):
        if w.dtype != h.dtype or (b is not None and (b.dtype != h.dtype or b.shape != (w.shape[0],))):
            raise ValueError(f"the {name}'s weight (and bias, shape (V,)) must have its hidden states' dtype "
                             f"{h.dtype}")
    _check_rows(n, target, grad_factor)
    _check_options(beta, temperature, hard_label_weight, target, student_softcap, teacher_softcap)
    loss, gh, gw, gb = torch.ops.fusedce.tiled_distill(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, target,
        grad_factor, float(beta), float(temperature), float(hard_label_weight), int(ignore_index),
        student_softcap, teacher_softcap, bool(deterministic))
    if grad_factor is None:
        return loss, None, None, None
    return loss, gh, gw, (gb if student_bias is not None else None)
