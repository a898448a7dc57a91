"""@triton.jit kernels only; launchers live one level up (``launch.py``)."""
