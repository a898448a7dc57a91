"""Launch configuration of the CuTe kernels, and the rule that keeps ``backend="auto"`` off them."""
from __future__ import annotations

import os
from typing import Optional

THREADS = 256
BACKWARD_UNROLL = 2
ONCHIP_SLICE_BYTES = 96 * 1024
ONCHIP_CLUSTERS = (1, 2, 4, 8)

AUTO_PICKS_CUTE = False          # flip only with the GPU evidence above
VERIFIED_ON_GPU = None           # e.g. "H200, 2026-01-01, benchmarks/gpu_check.sh: parity ok"


def onchip_cluster(n_cols: int, itemsize: int, full_width: bool) -> Optional[int]:
    """CTAs per row for the on-chip chunk kernel (the rule above), or None: use ``ce_chunk``."""
    if not full_width or n_cols == 0 or os.environ.get("FUSEDCE_CUTE_ONCHIP", "1") == "0":
        return None
    row_bytes = n_cols * itemsize
    return next((c for c in ONCHIP_CLUSTERS if -(-row_bytes // c) <= ONCHIP_SLICE_BYTES), None)
