"""``python -m fusedce.tools.inspect`` = ``fusedce inspect``."""
import sys

from .report import main

sys.exit(main())
