"""RL log-probs and entropy: the public ``token_log_probs`` / ``linear_token_log_probs`` (``rl/log_probs.py``),
the internal K-class op (``kclass.py``) and their LM-head Functions (``linear_head.py``, ``kclass_head.py``,
``kclass_head_tiled.py``); ``top_k`` / ``top_p``: ``truncation_checks.py``, ``truncated_rows.py``,
``truncated_head.py``."""
