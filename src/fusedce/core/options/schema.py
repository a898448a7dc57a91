"""The loss options' one description (``LossOptions``: every field's default, doc and check) and the
constructors that check call arguments into it (``loss_options``, ``log_prob_options``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import List, NamedTuple, Optional, Tuple, TypedDict

import torch

from fusedce.core.options import checks
from fusedce.core.options.checks import FP32_NORMAL, check_temperature, fp32_range


def _option(default, doc: str, check):
    """A field of ``LossOptions``: its default, its documentation (the public docstrings show it) and
    ``check(name, value) -> value`` (raises ``TypeError`` / ``ValueError``; returns the normalized value)."""
    return field(default=default, metadata={"doc": doc, "check": check})


def _ignore_index(name, value):
    value = checks.integer_option(name, value)
    if not checks.INT64_RANGE[0] <= value <= checks.INT64_RANGE[1]:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def _unit_interval(name, value):
    value = checks.real_option(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def _fp32_real(name, value):
    return checks.fp32_range(name, checks.real_option(name, value))


def _nonnegative_fp32(name, value):
    value = _fp32_real(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (a z-loss coefficient: a negative one rewards a large lse), got {value}")
    return value


def _positive_or_none(name, value):
    if value is None:
        return None
    return _positive_normal(name, value)


def _positive_normal(name, value):
    value = checks.real_option(name, value)
    if not checks.FP32_NORMAL[0] <= value <= checks.FP32_NORMAL[1]:   # the kernels multiply in fp32
        raise ValueError(f"{name} must be a finite number > 0, a normal fp32 number (in "
                         f"[{checks.FP32_NORMAL[0]:.3g}, {checks.FP32_NORMAL[1]:.3g}]), got {value}")
    return value


class LossScalars(NamedTuple):
    """The options' runtime scalars as every kernel takes them: ONE tuple argument (``scalars``; Triton
    and the CuTe DSL pass a NamedTuple's fields as separate kernel parameters), fp32 except
    ``ignore_index``. Changing a value does not recompile."""

    ignore_index: int
    label_smoothing: float
    softcap: float            # 1.0 when unused (HAS_SOFTCAP off)
    logit_scale: float
    lse_square_scale: float


class LossFlags(NamedTuple):
    """The code paths the element-wise options select, as every kernel takes them: ONE constexpr
    argument (``FLAGS``), so adding a flag changes no kernel's parameter list. ``HAS_WEIGHT`` comes
    from the class-weight tensor, the others from the options."""

    HAS_WEIGHT: bool
    HAS_SMOOTHING: bool
    HAS_SOFTCAP: bool


@dataclass(frozen=True)
class LossOptions:
    """The per-row loss options: the one description of them. A new option is a field here (default,
    doc, check), plus, if the kernels need it, a ``LossScalars`` / ``LossFlags`` field and a line in
    ``kernel_scalars`` / ``kernel_flags`` (and ``selecting``); every other form is derived here:

    - ``checked(**values)``: the validated options (the checks of the public functions and modules);
      the public signatures list the fields (``options.with_loss_options``);
    - ``op_args()`` / ``from_op_args()``: the torch custom ops' arguments, ``(ignore_index: int,
      scalars: list[float])``, and back (a custom op cannot take this dataclass; a list keeps the ops'
      schemas unchanged when an option is added);
    - ``kernel_scalars()`` / ``kernel_flags(has_weight)``: the kernels' two option arguments.

    Semantics (per row, in fp32): ``x`` the logits, ``z = softcap * tanh(logit_scale * x / softcap)``
    (``z = logit_scale * x`` without softcap), then the cross-entropy of ``z`` with ``label_smoothing``,
    plus the z-loss ``lse_square_scale * lse(z)**2``; with ``use_token_scaling`` the row's whole loss is
    multiplied by ``p_t = softmax(z)[t]``, detached.
    """

    ignore_index: int = _option(
        -100, "target value of ignored rows: they contribute nothing and get zero gradient. An integer "
        "in int64 (``TypeError`` for a float or a bool: nothing is rounded).", _ignore_index)
    label_smoothing: float = _option(
        0.0, "eps in [0, 1]; ``F.cross_entropy``'s formula (Szegedy et al. 2016).", _unit_interval)
    lse_square_scale: float = _option(
        0.0, "z-loss coefficient: adds ``lse_square_scale * lse**2`` per row (PaLM, Chowdhery et al. "
        "2022), not class-weighted; a finite number >= 0 within fp32's range.", _nonnegative_fp32)
    softcap: Optional[float] = _option(
        None, "if set (a finite number > 0, a normal fp32 number), the loss is taken on ``softcap * "
        "tanh(z / softcap)`` (Gemma 2 logit soft-capping).", _positive_or_none)
    logit_scale: float = _option(
        1.0, "the logits are first multiplied by it, before softcap (Cohere's ``logit_scale``; Granite "
        "divides by ``logits_scaling``: pass ``1 / logits_scaling``); a positive normal fp32 number.",
        _positive_normal)
    use_token_scaling: bool = _option(
        False, "each non-ignored row's loss (and its z-loss stat) is multiplied by ``p_t = softmax(z)[t]``, "
        "detached (Dynamic Fine-Tuning, Wu et al. 2025; Liger's flag, TRL's ``loss_type=\"dft\"``); the "
        "denominators are unchanged. A bool.", checks.check_flag)

    @classmethod
    def checked(cls, **values) -> "LossOptions":
        """The options from keyword values (missing ones take their defaults), each checked by its
        field's check: ``TypeError`` for an unknown name or a value of the wrong kind, ``ValueError``
        for one outside its domain; numbers are normalized (``numpy`` / one-element tensors to float)."""
        for name in values:
            if name not in _CHECKS:
                raise TypeError(f"unexpected keyword argument {name!r}: neither a parameter of this function nor "
                                f"a loss option (the loss options are {sorted(_CHECKS)})")
        return cls(**{name: check(name, values[name]) for name, check in _CHECKS.items() if name in values})

    def op_args(self) -> Tuple[int, List[float]]:
        """``(ignore_index, scalars)``: every other field as a float, in field order (``softcap=None``
        travels as 0.0, which no valid softcap is; booleans as 0.0 / 1.0)."""
        return self.ignore_index, [float(getattr(self, name) or 0.0) for name, _ in _KINDS[1:]]

    @classmethod
    def from_op_args(cls, ignore_index: int, scalars: List[float]) -> "LossOptions":
        """Inverse of ``op_args`` (each value back to its field's type: a float 0.0 is ``None`` for an
        optional field, 0.0 / 1.0 a bool for a bool field)."""
        values: dict = {}
        for (name, kind), value in zip(_KINDS[1:], scalars):
            values[name] = bool(value) if kind == "bool" else (value or None) if kind == "optional" else value
        return cls(ignore_index=ignore_index, **values)

    def kernel_scalars(self) -> LossScalars:
        """The kernels' runtime scalars (softcap 1.0 when unused)."""
        return LossScalars(self.ignore_index, self.label_smoothing, 1.0 if self.softcap is None else self.softcap,
                           self.logit_scale, self.lse_square_scale)

    def kernel_flags(self, has_weight: bool) -> LossFlags:
        """The kernels' constexpr flags (``has_weight``: class weights are given)."""
        return LossFlags(has_weight, self.label_smoothing > 0.0, self.softcap is not None)

    @classmethod
    def selecting(cls, flags: LossFlags, **values) -> "LossOptions":
        """Example options whose ``kernel_flags(flags.HAS_WEIGHT)`` are ``flags`` (the inverse of
        ``kernel_flags``; the offline compile report enumerates the flag combinations through it), with
        ``values`` for the options no flag selects."""
        return cls(label_smoothing=0.1 if flags.HAS_SMOOTHING else 0.0,
                   softcap=30.0 if flags.HAS_SOFTCAP else None, **values)

    def kept(self, target: torch.Tensor) -> torch.Tensor:
        """bool of ``target``'s shape: the rows that count (target != ignore_index), for code that holds the options."""
        return target != self.ignore_index


# The fields as constants (torch.compile traces these, not ``dataclasses.fields`` of a class): each
# option's check, and its kind for ``from_op_args``.
_CHECKS = {f.name: f.metadata["check"] for f in fields(LossOptions)}
_KINDS = tuple((f.name, "bool" if f.type in ("bool", bool) else "optional" if f.default is None else "number")
               for f in fields(LossOptions))
LOSS_OPTION_NAMES = tuple(_CHECKS)   # the fields' names, in order


class LossOptionValues(TypedDict, total=False):
    """The loss options as keyword arguments, for static type checkers (``**options:
    Unpack[LossOptionValues]`` in the public signatures; at run time ``options.with_loss_options``
    builds the signatures from ``LossOptions`` itself). Mirrors its fields (a test checks it)."""

    ignore_index: int
    label_smoothing: float
    lse_square_scale: float
    softcap: Optional[float]
    logit_scale: float
    use_token_scaling: bool


REDUCTIONS = ("mean", "sum", "none")


def loss_options(reduction, **options) -> LossOptions:
    """Check ``reduction`` (``ValueError`` unless one of ``REDUCTIONS``) and the loss options
    (``LossOptions.checked``: ``TypeError`` for an unknown name or a value of the wrong kind,
    ``ValueError`` for one outside its domain)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return LossOptions.checked(**options)


def log_prob_options(ignore_index, temperature, softcap, logit_scale=1.0) -> LossOptions:
    """The ``LossOptions`` whose cross-entropy is ``-log_softmax(z / temperature)[t]`` with ``z =
    softcap * tanh(logit_scale * x / softcap)`` (``z = logit_scale * x`` without softcap): logit scale
    ``logit_scale / temperature`` and softcap ``softcap / temperature``, since ``(c / T) tanh((s x / T) /
    (c / T)) = (c tanh(s x / c)) / T``. ``TypeError`` / ``ValueError`` as ``loss_options``; ``ValueError``
    for a temperature that is not a finite number > 0 or a ``logit_scale / temperature`` that is not a
    normal fp32 number."""
    temperature = check_temperature(temperature)
    logit_scale = LossOptions.checked(logit_scale=logit_scale).logit_scale
    scale = logit_scale * (1.0 / temperature)   # exactly 1 / temperature for logit_scale = 1
    if not FP32_NORMAL[0] <= scale <= FP32_NORMAL[1]:
        raise ValueError(f"temperature must lie in [{1 / FP32_NORMAL[1]:.3g}, {1 / FP32_NORMAL[0]:.3g}] times "
                         f"logit_scale, so that logit_scale / temperature is a normal fp32 number (the kernels "
                         f"multiply by it), got temperature={temperature}, logit_scale={logit_scale}")
    opts = LossOptions.checked(ignore_index=ignore_index, softcap=softcap, logit_scale=scale)
    if opts.softcap is not None:
        capped = opts.softcap * (1.0 / temperature)
        opts = dataclasses.replace(opts, softcap=fp32_range("softcap / temperature", capped, FP32_NORMAL[0]))
    return opts
