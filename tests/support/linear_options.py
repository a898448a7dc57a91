"""The linear ops' option matrix (``tests/linear/test_linear_options.py``, ``test_linear_tiled.py``) and a
non-unit upstream."""
import torch


# name -> (options, logit scale, ignore every k-th token, with class weights)
OPTIONS = {
    "plain": ({}, 2.0, 0, False),
    "ignore_-100": ({}, 2.0, 3, False),
    "ignore_-1": ({"ignore_index": -1}, 2.0, 3, False),
    "ignore_class_2": ({"ignore_index": 2}, 2.0, 3, False),   # also a valid class: only those rows drop
    "smoothing_0.1": ({"label_smoothing": 0.1}, 2.0, 3, False),
    "smoothing_1.0": ({"label_smoothing": 1.0}, 2.0, 3, False),
    "zloss_1e-2": ({"lse_square_scale": 1e-2}, 2.0, 3, False),
    "softcap_30": ({"softcap": 30.0}, 40.0, 3, False),         # |logits| ~ 40: tanh saturates
    "softcap_2": ({"softcap": 2.0}, 2.0, 3, False),
    "ce_weight": ({}, 2.0, 3, True),
    "num_items_int": ({"num_items_in_batch": 37}, 2.0, 3, False),
    "num_items_tensor": ({"num_items_in_batch": torch.tensor(29)}, 2.0, 3, False),
    "return_stats": ({"return_stats": True}, 2.0, 3, False),
    "smoothing+ce_weight": ({"label_smoothing": 0.2}, 2.0, 3, True),
    "everything": ({"ignore_index": -1, "label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 30.0,
                    "num_items_in_batch": torch.tensor(11), "return_stats": True}, 40.0, 3, True),
}


def _upstream(reduction, shape):
    """A non-unit upstream gradient: a scalar for mean/sum, a per-token random one for "none"."""
    return torch.randn(shape) if reduction == "none" else 3.7
