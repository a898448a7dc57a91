"""The source check of the patches that reproduce another library's code: a SHA-256 fingerprint of each
piece's source, so that a release that changes them is refused."""
from __future__ import annotations

import hashlib
import inspect


def fingerprint(obj) -> str:
    """The first 16 hex digits of the SHA-256 of ``obj``'s source."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def check_sources(patch: str, installed: str, objects: dict, expected: dict) -> None:
    """``RuntimeError`` (naming ``patch``, e.g. ``"fusedce.patch_trl"``, the piece and both fingerprints)
    unless every ``objects[name]``'s source fingerprint equals ``expected[name]``; ``installed`` names the
    library and version in the message (``"TRL 1.16.0"``)."""
    for name, obj in objects.items():
        try:
            found = fingerprint(obj)
        except (OSError, TypeError) as err:
            raise RuntimeError(f"{patch} cannot read the source of {name} to check it: {err}") from err
        if found != expected[name]:
            raise RuntimeError(f"{patch}: {name} in the installed {installed} differs from the one fusedce "
                               f"reproduces (source fingerprint {found}, expected {expected[name]}); refusing to "
                               "patch")
