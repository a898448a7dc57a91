"""The scalar options of the distillation losses (``fusedce.distillation_loss``,
``linear_distillation_loss``): ``DistillOptions`` and their checks (the tensor checks: ``distill/checks.py``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from fusedce.core.options.schema import FP32_NORMAL, check_temperature, fp32_range, integer_option, real_option
from fusedce.core.options.schema import REDUCTIONS


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """The checked scalar options, passed to the backends' row ops as keywords (``kwargs()``); the Triton
    launches read them as ``backends/triton/distill_launch.DistillKnobs`` (these fields and ``has_target``)."""

    beta: float
    temperature: float
    hard_label_weight: float
    ignore_index: int
    student_softcap: Optional[float]
    teacher_softcap: Optional[float]

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


def _softcap(name: str, value) -> Optional[float]:
    if value is None:
        return None
    value = real_option(name, value)
    if not value > 0.0:
        raise ValueError(f"{name} must be None or a number > 0, got {value}")
    return fp32_range(name, value, FP32_NORMAL[0])


def hard_label_weight_option(value) -> float:
    """``hard_label_weight`` checked (the one check of the four distillation losses): a finite real >= 0 in
    fp32's range (``TypeError`` / ``ValueError`` otherwise)."""
    value = fp32_range("hard_label_weight", real_option("hard_label_weight", value))
    if not value >= 0.0:
        raise ValueError(f"hard_label_weight must be >= 0 (the weight of the hard-label cross-entropy added to the "
                         f"divergence; a negative one would push the student away from the labels), got {value}")
    return value


def distill_options(beta, temperature, hard_label_weight, ignore_index, reduction, student_softcap, teacher_softcap,
            target) -> DistillOptions:
    """``ValueError`` for ``beta`` outside [0, 1], a ``temperature`` that is not a finite number > 0 (or
    whose inverse is not a normal fp32 number), a non-finite or negative ``hard_label_weight`` or one != 0 without a
    target, a softcap <= 0, an unknown ``reduction``; ``TypeError`` for a value of the wrong kind."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    beta = real_option("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1] (0: forward KL(teacher || student), 1: reverse KL), got {beta}")
    temperature = check_temperature(temperature)
    hard_label_weight = hard_label_weight_option(hard_label_weight)
    if hard_label_weight != 0.0 and target is None:
        raise ValueError(f"hard_label_weight = {hard_label_weight} needs a target (the hard labels); got target=None")
    return DistillOptions(beta, temperature, hard_label_weight,
                          integer_option("ignore_index", ignore_index), _softcap("student_softcap", student_softcap),
                          _softcap("teacher_softcap", teacher_softcap))


# The top-k teacher's value checks (``distill/checks.check_teacher_values``). A log-prob from a
# log_softmax is <= 0 and rounding to any dtype keeps the sign, so a value above this is not a log-prob
# (a probability or a logit); the slack only spares an upstream formula that lands a hair above 0.
LOG_PROB_SLACK = 1e-6


def teacher_mass_slack(dtype: torch.dtype, k: int) -> float:
    """How far above 1 ``sum_k exp(lp_k)`` of K normalized log-probs stored in ``dtype`` can come by
    rounding alone: rounding ``lp_k`` (half an ulp, ``eps / 2 |lp_k|``) moves ``p_k`` by at most ``p_k
    |lp_k| eps / 2``, and ``sum_k p_k |lp_k|`` is at most the entropy of K bins, ``log K``; plus the K
    fp32 exponentials' roundings (``2^-23`` each, with room). bfloat16, K = 20: 0.012; float32, K = 20:
    2.6e-6."""
    eps = torch.finfo(dtype).eps
    return 0.5 * eps * max(1.0, math.log(max(k, 1))) + k * 2.0 ** -23
