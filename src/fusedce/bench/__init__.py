"""``fusedce bench``: the stock PyTorch cross-entropy against every fusedce path on one device.

Files, one job each (imports go down this list, never up):

- ``shapes.py``      named LLM shapes (H, V) and ``--shapes`` parsing
- ``machine.py``     what machine a result came from (CPU model, GPU name, versions)
- ``inputs.py``      the tensors a path consumes (real from the cache, or synthetic), SFT label masking
- ``real_input.py``  SmolLM2-135M hidden states on King James Bible text, cached under ``.cache/``
- ``parity.py``      float64 references, compared chunk by chunk (no BT x V float64 tensor)
- ``paths.py``       the registry: ops (what is measured) and paths (who computes it)
- ``harness.py``     timing, peak memory and parity of one path; ``run_isolated`` runs it in a fresh process
- ``worker.py``      the fresh process: ``python -m fusedce.bench.worker`` (JSON spec in, JSON result out)
- ``report.py``      rich table, JSON and PNG
- ``command.py``     the ``bench`` subcommand: arguments and orchestration

Scripts reuse ``harness.measure`` / ``harness.run_isolated`` with their own paths: adding a path is one
``paths.register(Path(...))`` entry.
"""
