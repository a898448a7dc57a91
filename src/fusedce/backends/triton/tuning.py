"""Launch configurations of the Triton cross-entropy kernels (one function per kernel)."""
from __future__ import annotations

import triton

MAX_BLOCK_V = 4096


MAX_REGISTERS = 128


def forward_config(n_cols: int) -> dict:
    block = min(MAX_BLOCK_V, triton.next_power_of_2(max(n_cols, 16)))
    return {"BLOCK_V": block, "num_warps": 8 if block >= 2048 else 4, "maxnreg": MAX_REGISTERS}


def backward_config(n_cols: int) -> dict:
    block = min(MAX_BLOCK_V, triton.next_power_of_2(max(n_cols, 16)))
    return {"BLOCK_V": block, "num_warps": 8 if block >= 2048 else 4, "maxnreg": MAX_REGISTERS}


# ---------------------------------------------------------------- tiled LM head (method="tiled")
# From the static sm_90 / sm_100 register and spill report, not GPU timing: docs/internals.md.
TILED_BLOCK_N = 64
TILED_BLOCK_V = 128
TILED_BLOCK_H = 64
TILED_BACKWARD_MAX_REGISTERS = 255


def tiled_config(n_rows: int, n_cols: int, n_hidden: int, kernel: str, elem_size: int = 2) -> dict:
    """Tiles and launch options of the tiled ``kernel`` for inputs of ``elem_size`` bytes."""
    if elem_size >= 4:
        cfg = {"BLOCK_N": TILED_BLOCK_N, "BLOCK_V": TILED_BLOCK_V // 2, "BLOCK_H": TILED_BLOCK_H // 4,
               "num_warps": 8, "num_stages": 2}
    else:
        cfg = {"BLOCK_N": TILED_BLOCK_N, "BLOCK_V": TILED_BLOCK_V, "BLOCK_H": TILED_BLOCK_H, "num_warps": 8,
               "num_stages": 3}
    if kernel != "tiled_forward":
        cfg["maxnreg"] = TILED_BACKWARD_MAX_REGISTERS
    if elem_size < 4 and kernel == "tiled_grad_hidden":
        cfg["BLOCK_H"] = TILED_BLOCK_H // 2
    if elem_size < 4 and kernel == "tiled_grad_weight":
        cfg["BLOCK_V"] = TILED_BLOCK_V // 2
    return cfg


# ---------------------------------------------------------------- distillation (kernels/distill_*.py)
# Two logits streams per block, so half the cross-entropy forward's block (docs/internals.md).
DISTILL_ROWS_BLOCK = 2048


def distill_rows_config(n_cols: int) -> dict:
    """BLOCK_N rows x BLOCK_V columns and num_warps of ``distill_rows_kernel``."""
    block_v = min(DISTILL_ROWS_BLOCK, triton.next_power_of_2(max(n_cols, 16)))
    return {"BLOCK_N": max(1, min(16, DISTILL_ROWS_BLOCK // block_v)), "BLOCK_V": block_v,
            "num_warps": 8 if block_v >= 1024 else 4, "maxnreg": MAX_REGISTERS}


# Tiled: the cross-entropy's tiles halved, as both heads' logits tiles are live (docs/internals.md).
_DISTILL_AS_CE = {"distill_tiled_stats": "tiled_forward", "distill_tiled_jsd": "tiled_forward",
                  "distill_tiled_grad": "tiled_backward", "distill_tiled_grad_hidden": "tiled_grad_hidden",
                  "distill_tiled_grad_weight": "tiled_grad_weight"}


def distill_tiled_config(kernel: str, elem_size: int = 2) -> dict:
    """Tiles and launch options of the tiled distillation ``kernel`` (``elem_size``: the larger head's)."""
    cfg = tiled_config(0, 0, 0, _DISTILL_AS_CE[kernel], elem_size)
    cfg["maxnreg"] = TILED_BACKWARD_MAX_REGISTERS
    if elem_size < 4:
        cfg["BLOCK_V"] = TILED_BLOCK_V // 2    # two 64 x 64 fp32 logits tiles, as one 64 x 128 of the CE's
    else:
        cfg["BLOCK_N"] = TILED_BLOCK_N // 2    # fp32 FMA dots hold their operands in registers too
    return cfg
