"""Cross-entropy: ``cross_entropy`` and ``linear_cross_entropy`` (``ce/functional.py``), probability targets
(``ce/probs_targets.py``), the linear cross-entropy's autograd Function (``linear_function.py``) and the
modules (``ce/modules.py``)."""
