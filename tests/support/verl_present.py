"""Whether the real verl imports here (shared by the tests of tests/verl/)."""


def verl_importable() -> bool:
    """Whether ``import verl`` gives the real package: not installed, installed without its dependencies
    (the main .venv holds verl 0.9.1 with --no-deps for the bench: ray is missing), or only this folder
    (``tests/verl``, a namespace package "verl" where ``tests`` is on the path) all say no."""
    import sys
    had = "verl" in sys.modules
    try:
        import verl
    except ImportError:
        return False
    if getattr(verl, "__file__", None) is None:
        if not had:
            sys.modules.pop("verl", None)   # not the package: leave no namespace module behind
        return False
    return True
