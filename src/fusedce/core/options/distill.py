"""The distillation losses' scalar options: ``DistillOptions`` and their checks (tensors: ``distill/checks.py``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from fusedce.core.options.schema import FP32_NORMAL, check_temperature, fp32_range, integer_option, real_option
from fusedce.core.options.schema import REDUCTIONS


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """The checked scalar options, passed to the backends' row ops as keywords (``kwargs()``)."""

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
    """``hard_label_weight`` checked (for all four distillation losses): a finite real >= 0 within fp32."""
    value = fp32_range("hard_label_weight", real_option("hard_label_weight", value))
    if not value >= 0.0:
        raise ValueError(f"hard_label_weight must be >= 0 (the weight of the hard-label cross-entropy added to the "
                         f"divergence; a negative one would push the student away from the labels), got {value}")
    return value


def distill_options(beta, temperature, hard_label_weight, ignore_index, reduction, student_softcap, teacher_softcap,
            target) -> DistillOptions:
    """The checked ``DistillOptions``: ``ValueError`` for a value outside its domain, ``TypeError`` for one of the
    wrong kind."""
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


# The top-k teacher's value checks: a log-prob is <= 0 in any dtype, so a value above this slack is a
# probability or a logit.
LOG_PROB_SLACK = 1e-6


def teacher_mass_slack(dtype: torch.dtype, k: int) -> float:
    """How far above 1 ``sum_k exp(lp_k)`` of K log-probs stored in ``dtype`` can come by rounding alone:
    ``log K eps / 2`` (``sum_k p_k |lp_k| <= log K``) plus the fp32 exponentials' roundings."""
    eps = torch.finfo(dtype).eps
    return 0.5 * eps * max(1.0, math.log(max(k, 1))) + k * 2.0 ** -23
