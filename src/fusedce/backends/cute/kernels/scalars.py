"""The loss options' runtime scalars as every CuTe kernel takes them: ONE ``scalars`` argument, a
``options.LossScalars`` of CuTe DSL scalars (the DSL passes a NamedTuple's fields as separate kernel parameters; a
new value does not recompile)."""
import typing

from cutlass import Float32, Int64

from fusedce.core.options import LossScalars

_FIELD_TYPES = typing.get_type_hints(LossScalars)


def dsl_scalars(values: LossScalars) -> LossScalars:
    """``values`` as DSL scalars, field by field from ``LossScalars``' annotations: ``Int64`` for an
    int field (``ignore_index``), ``Float32`` otherwise."""
    return LossScalars(*(Int64(v) if _FIELD_TYPES[name] is int else Float32(v)
                         for name, v in zip(LossScalars._fields, values)))
