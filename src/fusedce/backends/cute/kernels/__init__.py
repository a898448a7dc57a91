"""CuTe DSL kernels (``@cute.kernel`` only; importing this package imports ``cutlass``)."""
