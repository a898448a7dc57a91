"""Static GPU report of the Triton kernels, no GPU needed (``fusedce inspect``): ``compile.py`` compiles one
launch offline, ``report.py`` builds the table."""
from .report import main

__all__ = ["main"]
