"""The tools around the library: the ``fusedce`` command (``cli.py``) and its subcommands (``bench/``,
``inspect/``, ``finetune/``); the library never imports them."""
