"""Static GPU report of the Triton kernels, no GPU needed (``fusedce inspect``).

- ``compile.py``: compile one launch for ``sm_<arch>`` offline and read its resource usage.
- ``report.py``: the configurations (dtype x V x flags), the table, ``main(argv)``.
"""
from .report import main

__all__ = ["main"]
