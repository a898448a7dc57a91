"""Launchers of the CuTe kernels: validate -> pick the variant -> compile once (cached) -> launch into caller-supplied
buffers."""
from __future__ import annotations

import os
from typing import Optional

import torch

from fusedce.core.options import LossOptions
from .tuning import onchip_cluster
from .variants import ITEMSIZE, KernelKey, full_vec

_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_COMPILED: dict = {}


def ensure_arch(device: torch.device) -> None:
    """Set ``$CUTE_DSL_ARCH`` from the device unless the user set it (before ``cutlass`` is first imported)."""
    if "CUTE_DSL_ARCH" not in os.environ:
        major, minor = torch.cuda.get_device_capability(device)
        os.environ["CUTE_DSL_ARCH"] = f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def vec_for(dtype: str, n_cols: int, *tensors: torch.Tensor) -> int:
    """The vector width: the largest power of two, at most 16 bytes, dividing V, every row stride and base address."""
    vec, size = full_vec(dtype), ITEMSIZE[dtype]
    while vec > 1 and (n_cols % vec or any(t.stride(0) % vec or t.data_ptr() % (vec * size) for t in tensors)):
        vec //= 2
    return vec


def _compiled(key: KernelKey, device: torch.device):
    fn = _COMPILED.get(key)
    if fn is None:
        ensure_arch(device)
        from .compile import compile_key
        fn = _COMPILED[key] = compile_key(key)
    return fn


def _cute(t: Optional[torch.Tensor], align: int = 4):
    """A torch tensor as a CuTe tensor with dynamic layout (unit last stride), or None."""
    if t is None:
        return None
    from cutlass.cute.runtime import from_dlpack
    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


def _stream():
    import cuda.bindings.driver as cuda
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _scalars(opts: LossOptions):
    """The kernels' ``scalars`` argument (``kernels/scalars.py``)."""
    from .kernels.scalars import dsl_scalars
    return dsl_scalars(opts.kernel_scalars())


def _vec1(t: torch.Tensor) -> torch.Tensor:
    """(n,) fp32 contiguous (upstream gradients may be any float dtype and stride, e.g. stride 0)."""
    return t.to(torch.float32).contiguous()


def _weights(weight, weight_sum):
    if weight is None:
        return None, None
    return _cute(weight.to(torch.float32).contiguous(), 16), _cute(weight_sum.to(torch.float32).reshape(1))


def ce_forward(logits, target, weight, weight_sum, opts: LossOptions, loss, lse, lse_lo, predicted) -> None:
    """Fill ``loss``/``lse``/``lse_lo`` and ``predicted`` (or None) for ``logits`` (BT, V), unit last stride."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    dt = _DTYPE[logits.dtype]
    vec = vec_for(dt, n_cols, logits)
    key = KernelKey("forward", dt, vec, opts.kernel_flags(weight is not None), (predicted is not None,))
    fn = _compiled(key, logits.device)
    fn(_cute(logits, vec * ITEMSIZE[dt]), _cute(target.to(torch.int64).contiguous()), *_weights(weight, weight_sum),
       _cute(loss), _cute(lse), _cute(lse_lo), _cute(predicted), _scalars(opts), _stream())


def ce_backward(logits, target, weight, weight_sum, lse, lse_lo, grad_row, grad_lse, opts: LossOptions,
                grad) -> None:
    """Write d(sum_i grad_row[i] loss_i + grad_lse[i] lse_i)/d logits into ``grad`` (may be ``logits``)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0 or n_cols == 0:
        return
    dt = _DTYPE[logits.dtype]
    vec = vec_for(dt, n_cols, logits, grad)
    key = KernelKey("backward", dt, vec, opts.kernel_flags(weight is not None), (grad_lse is not None,))
    fn = _compiled(key, logits.device)
    align = vec * ITEMSIZE[dt]
    fn(_cute(logits, align), _cute(grad, align), _cute(target.to(torch.int64).contiguous()),
       *_weights(weight, weight_sum), _cute(lse.contiguous()), _cute(lse_lo.contiguous()), _cute(_vec1(grad_row)),
       _cute(None if grad_lse is None else _vec1(grad_lse)), _scalars(opts), _stream())


def ce_chunk_(logits, target, weight, weight_sum, grad_row, z_grad_row, opts: LossOptions, loss, lse, lse_lo,
              predicted, token_weight) -> None:
    """The fused chunk: the per-row results out and ``logits`` overwritten with their gradient."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    dt = _DTYPE[logits.dtype]
    vec = vec_for(dt, n_cols, logits)
    has_z = opts.lse_square_scale != 0.0
    features = (predicted is not None, has_z, token_weight is not None)
    cluster = onchip_cluster(n_cols, ITEMSIZE[dt], vec == full_vec(dt))
    kind = "chunk" if cluster is None else "onchip"
    key = KernelKey(kind, dt, vec, opts.kernel_flags(weight is not None), features, cluster or 1)
    fn = _compiled(key, logits.device)
    fn(_cute(logits, vec * ITEMSIZE[dt]), _cute(target.to(torch.int64).contiguous()),
       *_weights(weight, weight_sum), _cute(_vec1(grad_row)), _cute(_vec1(z_grad_row) if has_z else None),
       _cute(loss), _cute(lse), _cute(lse_lo), _cute(predicted), _cute(token_weight), _scalars(opts), _stream())
