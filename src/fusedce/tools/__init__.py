"""The tools around the library, apart from it: the ``fusedce`` command (``cli.py``) and its subcommands,
``tools/bench/`` (fused vs stock on real input), ``tools/inspect/`` (the static GPU report of the Triton and CuTe
kernels, no GPU needed) and ``tools/finetune/`` (a real fine-tune, stock vs patched). They import the library;
the library never imports them (``tests/test_layers.py``)."""
