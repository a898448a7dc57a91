"""``fusedce bench``: the stock PyTorch cross-entropy, the peers' fused heads and every fusedce path on one
device, and a CPU memory sweep of the fused LM head; one job per file (docs/internals.md)."""
