"""Chunk size of the fused linear cross-entropy (one place).

Rule for ``chunk_size=None``: the chunk's logits (rows x V in hidden's dtype) may be as large as the
hidden states of the whole batch (BT x H, which the caller holds anyway), i.e. ``rows = BT * H / V``,
so the loss adds at most one hidden-sized buffer; but never fewer than ``MIN_ROWS`` rows, because each
chunk re-reads and re-writes the V x H weight-gradient accumulator (``grad_W += g_c.T @ h_c``): with
``rows`` rows that costs 2 * V * H * 4 bytes per chunk against 2 * rows * V * H FLOPs, so short chunks
make the loop bandwidth-bound. Measured on the 2-core x86-64 dev machine (BT=4096, H=576, V=49152,
fp32, fwd+bwd, median of 3, other jobs running): 512 rows 18.5 s, 1024 rows 18.4 s, 2048 rows 18.0 s,
4096 rows 18.2 s, stock ``F.linear`` + ``F.cross_entropy`` 17.8-18.4 s: flat from 512 rows on, so 1024
keeps a margin for GPUs (where short chunks also under-fill the matmuls) at a quarter of 2048's memory.
"""
MIN_ROWS = 1024


def chunk_rows(n_rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows per chunk for ``chunk_size=None`` (at least 1, at most ``n_rows``)."""
    rows = max(MIN_ROWS, -(-n_rows * hidden_size // max(vocab_size, 1)))
    return max(1, min(n_rows, rows))


def resolve_method(method: str) -> str:
    """``"auto"`` -> ``"chunked"``, on every device, until GPU measurements say otherwise: the tiled
    method trades one more matmul per token (4 instead of 3: its backward recomputes the logits) for
    O(BT + tiles) memory, and no GPU timing of the two exists yet (the CPU sweep of ``fusedce bench``
    has both; ``benchmarks/gpu_check.sh`` times both on its GPU shapes). Names are checked by
    ``validation.check_method``."""
    return "chunked" if method == "auto" else method
