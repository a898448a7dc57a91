"""RL log-probs and entropy: the public ops (``log_probs.py``), the internal K-class op (``kclass.py``), their
LM-head Functions and the ``top_k`` / ``top_p`` truncation (``truncat*.py``)."""
