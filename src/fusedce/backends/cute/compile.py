"""Compile one CuTe kernel variant (``variants.KernelKey``) with fake tensors: no GPU, no driver."""
from __future__ import annotations

from fusedce.core.options import LossOptions
from .variants import ITEMSIZE, KernelKey


def _dtypes():
    import cutlass
    return {"fp32": cutlass.Float32, "bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


def _kernel(key: KernelKey):
    from .kernels.ce_backward import CEBackward
    from .kernels.ce_chunk import CEChunk
    from .kernels.ce_chunk_onchip import CEChunkOnChip
    from .kernels.ce_forward import CEForward
    from .tuning import BACKWARD_UNROLL, THREADS
    if key.kind == "forward":
        return CEForward(key.vec, THREADS, key.loss, *key.features)
    if key.kind == "backward":
        return CEBackward(key.vec, THREADS, BACKWARD_UNROLL, key.loss, *key.features)
    if key.kind == "onchip":
        return CEChunkOnChip(key.vec, THREADS, key.cluster, key.loss, *key.features)
    return CEChunk(key.vec, THREADS, key.loss, *key.features)


def fake_args(key: KernelKey) -> tuple:
    """The kernel's arguments as fake tensors (dynamic BT and V; V and the row stride divisible by
    ``vec``; the logits ``vec * itemsize`` bytes aligned) and placeholder scalars (the default options'),
    in call order."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    from .kernels.scalars import dsl_scalars

    rt = cute.runtime
    dt = _dtypes()[key.dtype]
    vec, f = key.vec, key.feature
    rows, cols = cute.sym_int(), cute.sym_int(divisibility=vec)
    align = vec * ITEMSIZE[key.dtype]

    def logits():
        return rt.make_fake_tensor(dt, (rows, cols), stride=(cute.sym_int64(divisibility=vec), 1),
                                   assumed_align=align)

    def vector(dtype=Float32):
        return rt.make_fake_compact_tensor(dtype, (rows,))

    has_weight = key.loss.HAS_WEIGHT
    weight = rt.make_fake_compact_tensor(Float32, (cols,), assumed_align=min(16, 4 * vec)) if has_weight else None
    wsum = rt.make_fake_compact_tensor(Float32, (1,)) if has_weight else None
    target = vector(cutlass.Int64)
    scalars = dsl_scalars(LossOptions().kernel_scalars())
    stream = rt.make_fake_stream()
    if key.kind == "forward":
        pred = vector(cutlass.Int64) if f["stats"] else None
        return (logits(), target, weight, wsum, vector(), vector(), vector(), pred, scalars, stream)
    if key.kind == "backward":
        grad_lse = vector() if f["grad_lse"] else None
        return (logits(), logits(), target, weight, wsum, vector(), vector(), vector(), grad_lse, scalars, stream)
    pred = vector(cutlass.Int64) if f["stats"] else None     # chunk and onchip: the same arguments
    return (logits(), target, weight, wsum, vector(), vector() if f["zloss"] else None, vector(), vector(),
            vector(), pred, vector() if f["dft"] else None, scalars, stream)


def compile_key(key: KernelKey, options: str = ""):
    """``cute.compile`` of one variant for ``$CUTE_DSL_ARCH``."""
    import cutlass.cute as cute
    return cute.compile(_kernel(key), *fake_args(key), options=options)
