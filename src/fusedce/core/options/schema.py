"""The loss options' one description (``LossOptions``: every field's default, doc and check), the checks of
scalar option values (numbers, integers, flags) and the constructors that check call arguments into it
(``loss_options``, ``log_prob_options``). Imports nothing of fusedce."""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass, field, fields
from typing import List, NamedTuple, Optional, Tuple, TypedDict

import torch



INT32_RANGE = (-2 ** 31, 2 ** 31 - 1)
INT64_RANGE = (-2 ** 63, 2 ** 63 - 1)
FP32_NORMAL = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)   # positive normal fp32
SYMBOLIC = (torch.SymInt, torch.SymFloat)   # Python scalars traced by torch.compile


def finite(value) -> bool:
    """``math.isfinite`` written as comparisons, which torch.compile traces on symbolic floats too."""
    return -math.inf < value < math.inf


def integer_option(name: str, value) -> int:
    """An integer option (``ignore_index``, ``chunk_size``): a Python / NumPy integer or a one-element
    integer tensor (anything ``operator.index`` accepts), never a bool or a float: ``TypeError``."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def real_option(name: str, value) -> float:
    """A finite real option (``label_smoothing``, ``lse_square_scale``, ``softcap``): a Python / NumPy
    number or a one-element real tensor. ``TypeError`` for anything else (a string, a bool),
    ``ValueError`` for NaN or an infinity."""
    if isinstance(value, torch.Tensor):
        if torch.compiler.is_compiling():   # its value would be an unbacked symbol that no check can read
            raise TypeError(f"{name}: pass a Python number under torch.compile, not a tensor")
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be a real number, got a tensor of shape {tuple(value.shape)} "
                            f"and dtype {value.dtype}")
        if value.requires_grad:   # it would silently become a constant
            raise TypeError(f"{name} is a constant of the loss: a tensor that requires grad is not supported")
    elif isinstance(value, bool) or not isinstance(value, (numbers.Real,) + SYMBOLIC):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    value = value if isinstance(value, SYMBOLIC) else float(value)
    if not finite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def fp32_range(name: str, value: float, lowest: float = 0.0) -> float:
    """``value`` itself when the kernels' fp32 math can hold it: ``ValueError`` when ``|value|`` exceeds
    fp32's largest finite number (it would become inf: NaN rows, e.g. ``inf * 0`` on ignored rows) or
    is non-zero below ``lowest``."""
    if abs(value) > FP32_NORMAL[1] or (value != 0 and abs(value) < lowest):
        bound = (f"0 or have a magnitude in [{lowest:.3g}, {FP32_NORMAL[1]:.3g}]" if lowest else
                 f"at most {FP32_NORMAL[1]:.3g} in magnitude")
        raise ValueError(f"{name} must be {bound} (the fp32 math of the kernels), got {value}")
    return value


def check_flag(name: str, value) -> bool:
    """A boolean option (``return_stats``, ``use_token_scaling``): ``TypeError`` unless a bool (a string
    such as ``"no"`` would otherwise count as True); returns it."""
    if not isinstance(value, bool):
        kind = type(value)
        raise TypeError(f"{name} must be a Python bool, got {value!r} ({kind.__module__}.{kind.__qualname__})")
    return value


def deterministic_mode(deterministic) -> bool:
    """The ``deterministic`` keyword of the linear ops resolved: None follows
    ``torch.are_deterministic_algorithms_enabled()`` (a host flag: no sync; torch.compile guards on it),
    a bool is taken as given; anything else is a ``TypeError``."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        kind = type(deterministic)
        raise TypeError(f"deterministic must be None or a Python bool, got {deterministic!r} "
                        f"({kind.__module__}.{kind.__qualname__})")
    return deterministic


def check_temperature(temperature) -> float:
    """The one check of a ``temperature`` (RL log-probs, distillation, top-k distillation): a real number
    (``real_option``: ``TypeError`` for a string or a bool, ``ValueError`` for NaN or an infinity) > 0
    whose inverse is a normal fp32 number, since the kernels multiply by ``1 / temperature``
    (``ValueError``, one message). Returns it as a float."""
    temperature = real_option("temperature", temperature)
    if not temperature > 0.0 or not FP32_NORMAL[0] <= 1.0 / temperature <= FP32_NORMAL[1]:
        raise ValueError(f"temperature must be a finite number > 0 whose inverse is a normal fp32 number (the "
                         f"kernels multiply by 1 / temperature), got {temperature}")
    return temperature


def check_chunk_size(chunk_size) -> None:
    """None or a positive integer (``TypeError`` for a float or a bool, ``ValueError`` for < 1)."""
    if chunk_size is not None and integer_option("chunk_size", chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")


def check_accum_dtype(accum_dtype) -> None:
    """``accum_dtype`` must be a floating-point ``torch.dtype`` (``TypeError``)."""
    if not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be a floating-point torch.dtype, got {accum_dtype!r}")


def _option(default, doc: str, check):
    """A field of ``LossOptions``: its default, its documentation (the public docstrings show it) and
    ``check(name, value) -> value`` (raises ``TypeError`` / ``ValueError``; returns the normalized value)."""
    return field(default=default, metadata={"doc": doc, "check": check})


def _ignore_index(name, value):
    value = integer_option(name, value)
    if not INT64_RANGE[0] <= value <= INT64_RANGE[1]:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def _unit_interval(name, value):
    value = real_option(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def _fp32_real(name, value):
    return fp32_range(name, real_option(name, value))


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
    value = real_option(name, value)
    if not FP32_NORMAL[0] <= value <= FP32_NORMAL[1]:   # the kernels multiply in fp32
        raise ValueError(f"{name} must be a finite number > 0, a normal fp32 number (in "
                         f"[{FP32_NORMAL[0]:.3g}, {FP32_NORMAL[1]:.3g}]), got {value}")
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
    """The per-row loss options, their one description: each field's default, doc and check; ``checked``,
    ``op_args`` / ``from_op_args`` (the custom ops' arguments) and ``kernel_scalars`` / ``kernel_flags`` are
    derived from the fields (``docs/architecture.md``, "Adding a loss option"; semantics: ``docs/contract.md``)."""

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
        "denominators are unchanged. A bool.", check_flag)

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
