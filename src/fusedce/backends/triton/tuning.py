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
#
# Chosen by reasoning and by the static sm_90 / sm_100 report (``fusedce inspect --kernel tiled_forward
# --kernel tiled_backward --kernel tiled_grad_hidden --kernel tiled_grad_weight``: registers, spills,
# wgmma), not by GPU timing (none was available; re-tune on a
# lent H100 / H200):
# - BLOCK_N = 64 tokens: the weight is streamed once per token tile, so its arithmetic intensity is
#   2 BLOCK_N / s FLOP per byte (64 for bf16), served from L2 since the concurrent token tiles walk the
#   vocabulary in the same order; 64 rather than 128 keeps n / BLOCK_N programs >= the 132 SMs of an H100
#   from n = 8192 tokens on (the forward's grid is over token tiles only).
# - BLOCK_V = 128 classes: the fp32 logits tile (64 x 128) is 32 registers per thread at 8 warps (room for
#   the epilogue's temporaries without spilling) and each wgmma is 64 x 128 x 16; in the backward it is also
#   the grad_hidden atomic factor (4 H V / BLOCK_V bytes per token).
# - BLOCK_H = 64: two 16-byte bf16 rows per operand load per thread, 3 pipeline stages of (64 + 128) x 64
#   bf16 operands = 72 KiB of shared memory.
# - fp32 inputs: their dots are IEEE fp32 (FMA, no tensor cores) unless torch allows TF32; FMA dots hold
#   their operands in registers, and with the bf16 tiles ptxas spilled (fp32 forward with every option 64 B,
#   backward 800 B at 255 registers; BLOCK_H = 32: 4-24 B at 128; 4 warps: worse), so fp32 uses
#   BLOCK_V = 64, BLOCK_H = 16 and 2 stages: no spills (the backward with every option: see maxnreg).
# - backward kernels: ``maxnreg = 255``. Without it ptxas (Triton 3.9) held the atomic backward at 128
#   registers in some configurations and spilled (sm_100 bf16 without options 32 B, the main B200
#   training case; every option in fp32: sm_90 24 B, sm_100 32 B); with 255 allowed it takes 128-238
#   and spills nothing. The price on sm_100: one CTA of 8 warps per SM where two fitted (its 98 KiB of
#   shared memory allowed two); with no GPU timing either way, the report's rule (no spills) decides.
# - deterministic backward (``tiled_grad_hidden`` / ``tiled_grad_weight``, bf16 / fp16): each program also
#   holds its accumulator tile through a read-modify-write next to the logits tile; with the tiles above,
#   ptxas spilled at 255 registers with every option (sm_100: grad_hidden 24 B, grad_weight 1264 B;
#   sm_90: grad_weight 204 B). grad_hidden uses BLOCK_H = 32 (its logits tile stays 64 x 128; sm_100 230
#   registers) and grad_weight BLOCK_V = 64 (sm_100 220, sm_90 224): no spills. fp32 keeps its tiles.
# Under the interpreter (CPU tests) the same tiles, which the tests shrink to exercise several tiles.
TILED_BLOCK_N = 64
TILED_BLOCK_V = 128
TILED_BLOCK_H = 64
TILED_BACKWARD_MAX_REGISTERS = 255


def tiled_config(n_rows: int, n_cols: int, n_hidden: int, kernel: str, elem_size: int = 2) -> dict:
    """Tiles and launch options of ``kernel`` ("tiled_forward", "tiled_backward", or the deterministic
    backward's "tiled_grad_hidden" / "tiled_grad_weight") for inputs of ``elem_size`` bytes (see the
    comment above)."""
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
#
# Rows (``distill_rows``): two logits streams (student and teacher) per block instead of one, so half the
# cross-entropy forward's block: 2048 columns at 8 warps (8 values per thread per stream per iteration,
# one 128-bit bf16 load each). Small vocabularies put several rows in a program (BLOCK_N x BLOCK_V <= 2048)
# so that a program still moves a few KiB. Chosen by reasoning and the static sm_90 report (``fusedce
# inspect --kernel distill_rows``: registers, spills), not by GPU timing.
DISTILL_ROWS_BLOCK = 2048


def distill_rows_config(n_cols: int) -> dict:
    """BLOCK_N rows x BLOCK_V columns and num_warps of ``distill_rows_kernel``."""
    block_v = min(DISTILL_ROWS_BLOCK, triton.next_power_of_2(max(n_cols, 16)))
    return {"BLOCK_N": max(1, min(16, DISTILL_ROWS_BLOCK // block_v)), "BLOCK_V": block_v,
            "num_warps": 8 if block_v >= 1024 else 4, "maxnreg": MAX_REGISTERS}


# Tiled (``distill_tiled_*``): the tiles of the tiled cross-entropy (``tiled_config``), with both heads'
# logits tiles live at once in every kernel (the student's and the teacher's: twice the fp32 epilogue
# registers of the cross-entropy kernels). Kernels: "distill_tiled_stats" (and "distill_tiled_jsd", same
# tiles), "distill_tiled_grad" (atomics), "distill_tiled_grad_hidden" / "distill_tiled_grad_weight"
# (deterministic). Set by the static sm_90 report (``fusedce inspect --kernel distill_tiled_stats ...``),
# not by GPU timing: with the cross-entropy's tiles, the variants with every option (hard label at T != 1,
# both softcaps, both biases) sat at 255 registers and spilled 8-32 B on sm_90 (grad_hidden / grad_weight,
# bf16 and fp32) and up to 224 B on sm_100; halving the tile (bf16: BLOCK_V 128 -> 64; fp32: BLOCK_N
# 64 -> 32) gives 130-255 registers and no spills in any of them on sm_90 and sm_100.
_DISTILL_AS_CE = {"distill_tiled_stats": "tiled_forward", "distill_tiled_jsd": "tiled_forward",
                  "distill_tiled_grad": "tiled_backward", "distill_tiled_grad_hidden": "tiled_grad_hidden",
                  "distill_tiled_grad_weight": "tiled_grad_weight"}


def distill_tiled_config(kernel: str, elem_size: int = 2) -> dict:
    """Tiles and launch options of the tiled distillation ``kernel`` for inputs of ``elem_size`` bytes
    (the larger of the two heads' element sizes)."""
    cfg = tiled_config(0, 0, 0, _DISTILL_AS_CE[kernel], elem_size)
    cfg["maxnreg"] = TILED_BACKWARD_MAX_REGISTERS
    if elem_size < 4:
        cfg["BLOCK_V"] = TILED_BLOCK_V // 2    # two 64 x 64 fp32 logits tiles, as one 64 x 128 of the CE's
    else:
        cfg["BLOCK_N"] = TILED_BLOCK_N // 2    # fp32 FMA dots hold their operands in registers too
    return cfg
