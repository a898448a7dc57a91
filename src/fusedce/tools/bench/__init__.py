"""``fusedce bench``: the stock PyTorch cross-entropy (on logits, and fused with the LM head) and the
peers' fused heads (torch's ``F.linear_cross_entropy``, TRL's) against every fusedce path on one device,
and a CPU memory sweep of the fused LM head.

Files, one job each (imports go down this list, never up):

- ``shapes.py``      named LLM shapes (H, V) and ``--shapes`` parsing
- ``machine.py``     what machine a result came from (CPU model, GPU name, versions)
- ``inputs.py``      the tensors a path consumes (real from the cache, or synthetic), SFT label masking
- ``real_input.py``  SmolLM2-135M hidden states on King James Bible text, cached under ``.cache/``
- ``parity.py``      float64 references, compared chunk by chunk (no BT x V float64 tensor)
- ``peers.py``       other libraries' fused heads: torch's ``F.linear_cross_entropy``, TRL's ``ChunkedLogProbFunction``
- ``paths.py``       the registry: ops (cross_entropy, linear_cross_entropy) and paths (who computes them)
- ``harness.py``     timing, peak memory and parity of one path; ``run_isolated`` runs it in a fresh process
- ``sweep.py``       the CPU memory sweep: stock vs fused linear cross-entropy, memory over inputs + .grad
- ``distill.py``     the distillation row: stock full-logits JSD vs ``linear_distillation_loss`` on the real input
- ``worker.py``      the fresh process: ``python -m fusedce.tools.bench.worker`` (JSON spec in, JSON result out)
- ``goals.py``       fusedce against the peers: chunked faster and leaner, tiled the least memory
- ``report.py``      rich tables, JSON and PNG; ``report_sweep.py`` the sweep's table and panels,
  ``report_distill.py`` the distillation table
- ``command.py``     the ``bench`` subcommand: arguments and orchestration

Scripts reuse ``harness.measure`` / ``harness.run_isolated`` with their own paths: adding a path is one
``paths.register(BenchPath(...))`` entry.
"""
