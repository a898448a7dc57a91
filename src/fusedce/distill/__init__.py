"""Teacher-student distillation: the full-teacher losses (``distill/distillation.py``), the top-k teacher
(``topk.py``), their tensor checks (``checks.py``) and the LM-head Function (``linear_head.py``)."""
