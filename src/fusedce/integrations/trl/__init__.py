"""TRL: ``patch_trl`` (its fused-head trainers, ``patch.py`` and ``forward.py``) and
``patch_distillation_trainer`` (its distillation trainers, ``distill.py`` and ``distill_loss.py``).
The folder's name shadows nothing: inside it, ``import trl`` is the TRL package (absolute imports)."""
