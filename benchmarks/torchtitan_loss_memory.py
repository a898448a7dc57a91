"""Peak CPU memory of torchtitan 0.3.0's default chunked loss (``ChunkedLossWrapper``, 8 chunks, +
``CrossEntropyLoss``) vs ``fusedce.integrations.torchtitan.FusedLinearCrossEntropy``, forward + backward,
fp32, one process.

Method: each variant runs in a FRESH process; the peak resident set size (``ru_maxrss``) after the step
minus the resident set size just before it (inputs, head and the hidden states' producer already
allocated, one warm-up step at a tiny shape already run so that code and thread pools are loaded). The
children run with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc: every block over 128 KiB is its own mapping,
returned when freed; without it glibc's dynamic threshold keeps freed blocks of up to 32 MiB in the heap and
RSS overstates), so the peak RSS follows the peak of live tensors: logits chunks, softmax, gradients (the
weight's and hidden states' gradient buffers too, the same in every variant). ``tracemalloc`` is not used: torch's CPU
allocator bypasses Python's.

Usage: ``python benchmarks/torchtitan_loss_memory.py [--tokens 2048] [--hidden 256] [--vocab 32000]``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

VARIANTS = ["stock_chunked_8", "stock_full_logits", "fusedce_default", "fusedce_chunk_256"]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _one(variant: str, tokens: int, hidden: int, vocab: int) -> dict:
    import torch
    import torch.nn as nn
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from fusedce.integrations.torchtitan import FusedLinearCrossEntropy
    torch.set_num_threads(1)

    def build():
        if variant.startswith("stock"):
            chunks = 8 if variant == "stock_chunked_8" else 1
            return ChunkedLossWrapper.Config(num_chunks=chunks, loss_fn=CrossEntropyLoss.Config()).build()
        return FusedLinearCrossEntropy.Config(chunk_size=256 if variant.endswith("256") else None).build()

    def step(t, h, v):
        head = nn.Linear(h, v, bias=False)
        x = torch.randn(1, t, h, requires_grad=True)
        labels = torch.randint(0, v, (1, t))
        loss_fn = build()
        loss_fn.set_lm_head(head)
        return head, x, labels, loss_fn

    head, x, labels, loss_fn = step(64, 16, 128)     # warm-up at a tiny shape
    loss_fn(x * 1.0, labels, torch.tensor(64))[0].backward()
    head, x, labels, loss_fn = step(tokens, hidden, vocab)
    pred = x * 1.0
    before = _rss_mib()
    loss, _ = loss_fn(pred, labels, torch.tensor(tokens))
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "loss": float(loss), "peak_step_mib": round(peak - before, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--variant")
    a = p.parse_args()
    if a.variant:
        print(json.dumps(_one(a.variant, a.tokens, a.hidden, a.vocab)))
        return
    full = a.tokens * a.vocab * 4 / 2**20
    print(f"T={a.tokens} H={a.hidden} V={a.vocab}: full fp32 logits = {full:.1f} MiB")
    for v in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", v, "--tokens", str(a.tokens),
                              "--hidden", str(a.hidden), "--vocab", str(a.vocab)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
