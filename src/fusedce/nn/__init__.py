"""Drop-ins for ``torch.nn`` names: ``fusedce.nn.functional`` (``linear_cross_entropy`` with torch's
signature; every other name is ``torch.nn.functional``'s own)."""
from . import functional  # noqa: F401

__all__ = ["functional"]
