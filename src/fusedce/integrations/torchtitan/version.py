"""The torchtitan release this integration is written against (its loss, trainer and SPMD code)."""
from __future__ import annotations

from importlib import metadata

SUPPORTED_VERSION = "0.3.0"


def check_version() -> None:
    """``ImportError`` unless torchtitan ``SUPPORTED_VERSION`` is installed."""
    try:
        found = metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        raise ImportError(f"fusedce.integrations.torchtitan needs torchtitan=={SUPPORTED_VERSION} "
                          "(pip install torchtitan==" + SUPPORTED_VERSION + "); it is not installed") from None
    if found != SUPPORTED_VERSION:
        raise ImportError(f"fusedce.integrations.torchtitan supports torchtitan=={SUPPORTED_VERSION} only "
                          f"(its ChunkedLossWrapper / trainer contract); found torchtitan {found}")
