"""The tiled LM-head loss (``method="tiled"``) on Triton: launchers, torch custom ops, and ``TRITON_TILED`` (the
``TiledCE`` of ``backends/protocol.py``)."""
from __future__ import annotations

from typing import Optional

import torch
import triton

from ..layout import opt_contiguous, unit_stride
from fusedce.core.options import LossOptions
from . import tuning
from .kernels.tiled_backward import tiled_backward_kernel
from .kernels.tiled_backward_owned import tiled_grad_hidden_kernel, tiled_grad_weight_kernel
from .kernels.tiled_forward import tiled_forward_kernel
from .launch import INTERPRETED

Opt = Optional[torch.Tensor]


def _dot_meta(dtype: torch.dtype) -> dict:
    """DOT_PRECISION / UPCAST / ROUND_BF16 for inputs of ``dtype`` (see the module docstring)."""
    meta = {"DOT_PRECISION": "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
            else "ieee"}
    if INTERPRETED:
        meta.update(DOT_PRECISION="ieee", UPCAST=dtype != torch.float32, ROUND_BF16=dtype == torch.bfloat16)
    return meta


def _grid_meta(n_rows, n_cols, n_hidden, kernel, dtype):
    cfg = tuning.tiled_config(n_rows, n_cols, n_hidden, kernel, torch.empty((), dtype=dtype).element_size())
    meta = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_V=cfg["BLOCK_V"], BLOCK_H=cfg["BLOCK_H"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_dot_meta(dtype))
    if "maxnreg" in cfg:
        meta["maxnreg"] = cfg["maxnreg"]
    return cfg, meta


def tiled_forward_launch(hidden, weight, bias, target, w, weight_sum, opts: LossOptions, loss, lse, lse_lo,
                         predicted: Opt, target_logit, entropy: Opt, token_stats: Optional[tuple] = None):
    """``(kernel, grid, args, meta)`` of the tiled forward; ``token_stats``: buffers, or None."""
    (n_rows, n_hidden), n_cols = hidden.shape, weight.shape[0]
    dummy = loss
    cfg, meta = _grid_meta(n_rows, n_cols, n_hidden, "tiled_forward", hidden.dtype)
    args = (hidden, weight, dummy if bias is None else bias, target, dummy if w is None else w,
            dummy if weight_sum is None else weight_sum, loss, lse, lse_lo,
            dummy if predicted is None else predicted, target_logit, dummy if entropy is None else entropy,
            *(token_stats or (dummy,) * 3),
            n_rows, n_cols, n_hidden, hidden.stride(0), weight.stride(0), target.stride(0), opts.kernel_scalars())
    meta.update(FLAGS=opts.kernel_flags(w is not None), HAS_BIAS=bias is not None,
                COMPUTE_STATS=predicted is not None, COMPUTE_ENTROPY=entropy is not None)
    if token_stats is not None:
        meta["COMPUTE_TOKEN_STATS"] = True
    return tiled_forward_kernel, (triton.cdiv(n_rows, cfg["BLOCK_N"]),), args, meta


def _backward_parts(kernel, hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse: Opt,
                    grad_entropy: Opt, entropy: Opt, opts: LossOptions):
    """``(cfg, meta, inputs, sizes)``: the backward kernels' shared parameter list around their outputs."""
    (n_rows, n_hidden), n_cols = hidden.shape, weight.shape[0]
    cfg, meta = _grid_meta(n_rows, n_cols, n_hidden, kernel, hidden.dtype)
    opt = lambda t: lse if t is None else t   # noqa: E731 - a dummy pointer for an absent tensor
    inputs = (hidden, weight, opt(bias), target, opt(w), opt(weight_sum), lse, lse_lo, grad_row, opt(grad_lse),
              opt(grad_entropy), opt(None if grad_entropy is None else entropy))
    sizes = (n_rows, n_cols, n_hidden, hidden.stride(0), weight.stride(0), target.stride(0), grad_row.stride(0),
             0 if grad_lse is None else grad_lse.stride(0), 0 if grad_entropy is None else grad_entropy.stride(0),
             opts.kernel_scalars())
    meta.update(FLAGS=opts.kernel_flags(w is not None), HAS_BIAS=bias is not None,
                HAS_GRAD_LSE=grad_lse is not None, HAS_GRAD_ENTROPY=grad_entropy is not None)
    return cfg, meta, inputs, sizes


def tiled_backward_launch(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse: Opt,
                          grad_entropy: Opt, entropy: Opt, opts: LossOptions, grad_hidden: Opt, grad_weight: Opt,
                          grad_bias: Opt):
    """``(kernel, grid, args, meta)`` of the atomic tiled backward; ``grad_*``: zeroed fp32 buffers or None."""
    cfg, meta, inputs, sizes = _backward_parts("tiled_backward", hidden, weight, bias, target, w, weight_sum, lse,
                                               lse_lo, grad_row, grad_lse, grad_entropy, entropy, opts)
    dummy = lse
    args = inputs + tuple(dummy if t is None else t for t in (grad_hidden, grad_weight, grad_bias)) + sizes
    meta.update(NEED_GRAD_HIDDEN=grad_hidden is not None, NEED_GRAD_WEIGHT=grad_weight is not None,
                NEED_GRAD_BIAS=grad_bias is not None)
    grid = (triton.cdiv(hidden.shape[0], cfg["BLOCK_N"]), triton.cdiv(weight.shape[0], cfg["BLOCK_V"]))
    return tiled_backward_kernel, grid, args, meta


def tiled_grad_hidden_launch(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse: Opt,
                             grad_entropy: Opt, entropy: Opt, opts: LossOptions, grad_hidden):
    """``(kernel, grid, args, meta)`` of the deterministic grad_hidden kernel (zeroed (n, H) fp32 buffer)."""
    cfg, meta, inputs, sizes = _backward_parts("tiled_grad_hidden", hidden, weight, bias, target, w, weight_sum,
                                               lse, lse_lo, grad_row, grad_lse, grad_entropy, entropy, opts)
    return (tiled_grad_hidden_kernel, (triton.cdiv(hidden.shape[0], cfg["BLOCK_N"]),),
            inputs + (grad_hidden,) + sizes, meta)


def tiled_grad_weight_launch(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse: Opt,
                             grad_entropy: Opt, entropy: Opt, opts: LossOptions, grad_weight: Opt, grad_bias: Opt):
    """``(kernel, grid, args, meta)`` of the deterministic grad_weight / grad_bias kernel (fp32 buffers or None)."""
    cfg, meta, inputs, sizes = _backward_parts("tiled_grad_weight", hidden, weight, bias, target, w, weight_sum,
                                               lse, lse_lo, grad_row, grad_lse, grad_entropy, entropy, opts)
    args = inputs + tuple(lse if t is None else t for t in (grad_weight, grad_bias)) + sizes
    meta.update(NEED_GRAD_WEIGHT=grad_weight is not None, NEED_GRAD_BIAS=grad_bias is not None)
    return tiled_grad_weight_kernel, (triton.cdiv(weight.shape[0], cfg["BLOCK_V"]),), args, meta


def tiled_backward_launches(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse: Opt,
                            grad_entropy: Opt, entropy: Opt, opts: LossOptions, grad_hidden: Opt, grad_weight: Opt,
                            grad_bias: Opt, deterministic: bool) -> list:
    """The launches of one tiled backward: atomic, or (``deterministic``) grad_hidden and / or grad_weight."""
    common = (hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, grad_entropy, entropy,
              opts)
    if not deterministic:
        return [tiled_backward_launch(*common, grad_hidden, grad_weight, grad_bias)]
    launches = []
    if grad_hidden is not None:
        launches.append(tiled_grad_hidden_launch(*common, grad_hidden))
    if grad_weight is not None or grad_bias is not None:
        launches.append(tiled_grad_weight_launch(*common, grad_weight, grad_bias))
    return launches


def run_launches(launches) -> None:
    """Launch each ``(kernel, grid, args, meta)`` in order (one place, so tests can see what runs)."""
    for kernel, grid, args, meta in launches:
        kernel[grid](*args, **meta)


# ---------------------------------------------------------------- custom ops

def _forward_buffers(hidden, stats: bool, entropy: bool):
    n = hidden.shape[0]
    f = lambda k: hidden.new_empty(k, dtype=torch.float32)   # noqa: E731
    return (f(n), f(n), f(n), hidden.new_empty(n if stats else 0, dtype=torch.int64), f(n),
            f(n if entropy else 0))


@torch.library.custom_op("fusedce::tiled_forward", mutates_args=())
def tiled_forward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Opt, target: torch.Tensor, w: Opt,
                     weight_sum: Opt, ignore_index: int, scalars: list[float], stats: bool, entropy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, lse, lse_lo, predicted, target_logit, entropy)``, (n,) each ((0,) when not asked)."""
    out = _forward_buffers(hidden, stats, entropy)
    if hidden.shape[0]:
        kernel, grid, args, meta = tiled_forward_launch(
            unit_stride(hidden), unit_stride(weight), opt_contiguous(bias), target, opt_contiguous(w),
            None if weight_sum is None else weight_sum.reshape(1).float(),
            LossOptions.from_op_args(ignore_index, scalars), *out[:3], out[3] if stats else None, out[4],
            out[5] if entropy else None)
        kernel[grid](*args, **meta)
    return out


@tiled_forward_op.register_fake
def _(hidden, weight, bias, target, w, weight_sum, ignore_index, scalars, stats, entropy):
    return _forward_buffers(hidden, stats, entropy)


def _grad_shapes(hidden, weight, needs_h, needs_w, needs_b):
    n, hd = hidden.shape
    v = weight.shape[0]
    return (n, hd) if needs_h else (0,), (v, hd) if needs_w else (0,), (v,) if needs_b else (0,)


@torch.library.custom_op("fusedce::tiled_backward", mutates_args=())
def tiled_backward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Opt, target: torch.Tensor, w: Opt,
                      weight_sum: Opt, lse: torch.Tensor, lse_lo: torch.Tensor, grad_row: torch.Tensor,
                      grad_lse: Opt, grad_entropy: Opt, entropy: Opt, ignore_index: int, scalars: list[float],
                      needs_h: bool, needs_w: bool, needs_b: bool, accum_dtype: torch.dtype, deterministic: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad_hidden, grad_weight, grad_bias)`` ((0,) when not asked), fp32 accumulation, atomic or, with
    ``deterministic``, one owner per gradient row (bitwise reproducible)."""
    sh, sw, sb = _grad_shapes(hidden, weight, needs_h, needs_w, needs_b)
    acc_h = hidden.new_zeros(sh, dtype=torch.float32)
    acc_w = hidden.new_zeros(sw, dtype=torch.float32)
    acc_b = hidden.new_zeros(sb, dtype=torch.float32)
    if hidden.shape[0] and weight.shape[0]:
        run_launches(tiled_backward_launches(
            unit_stride(hidden), unit_stride(weight), opt_contiguous(bias), target, opt_contiguous(w),
            None if weight_sum is None else weight_sum.reshape(1).float(), lse.contiguous(), lse_lo.contiguous(),
            grad_row, grad_lse, grad_entropy, opt_contiguous(entropy), LossOptions.from_op_args(ignore_index, scalars),
            acc_h if needs_h else None, acc_w if needs_w else None, acc_b if needs_b else None, deterministic))
    return acc_h.to(hidden.dtype), acc_w.to(accum_dtype), acc_b.to(accum_dtype)


@tiled_backward_op.register_fake
def _(hidden, weight, bias, target, w, weight_sum, lse, lse_lo, grad_row, grad_lse, grad_entropy, entropy,
      ignore_index, scalars, needs_h, needs_w, needs_b, accum_dtype, deterministic):
    sh, sw, sb = _grad_shapes(hidden, weight, needs_h, needs_w, needs_b)
    return (hidden.new_empty(sh), hidden.new_empty(sw, dtype=accum_dtype), hidden.new_empty(sb, dtype=accum_dtype))

