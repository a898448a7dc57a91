"""The Hugging Face patch's loss: ``linear_cross_entropy`` of the LM head's pieces (recorded inside the head's
call, ``hf_call``) against the labels shifted as transformers' ``ForCausalLMLoss`` shifts them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusedce.ce.functional import linear_cross_entropy
from fusedce.core import validation as val
from fusedce.core.dtensor import replicated_to_local
from fusedce.core.hints import shifted_labels_hint
from fusedce.core.options import check_flag
from fusedce.integrations.hf.head import LogitTransform
from fusedce.integrations.hf.output import bad_label_message
from fusedce.integrations.hf.token_weights import flat_token_weights


def causal_loss(model: nn.Module, loss_options: dict, transform: LogitTransform, hidden, weight, bias, labels,
                shift_labels, num_items, token_scaling, token_weights=None) -> torch.Tensor:
    """``linear_cross_entropy`` (with the patch's ``loss_options``) of the head's pieces: ``hidden`` (..., H),
    ``weight`` (V, H), ``bias``, for the family's post-head ``transform``; the targets are ``labels`` shifted by one
    as Hugging Face's ``ForCausalLMLoss`` does, or ``shift_labels`` as given."""
    for name, given in (("labels", labels), ("shift_labels", shift_labels)):
        if isinstance(given, torch.Tensor) and (given.is_floating_point() or given.is_complex()
                                                or given.dtype == torch.bool):
            raise TypeError(f"{type(model).__name__}: {name} must be integer token ids (int64 / int32), got "
                            f"{given.dtype} of shape {tuple(given.shape)}; pass {name}.long() if they hold ids")
    options = dict(loss_options)
    if transform.softcap is not None:
        options["softcap"] = transform.softcap
    if transform.scale != 1.0:
        options["logit_scale"] = transform.scale
    if token_scaling is not None:
        check_flag("use_token_scaling", token_scaling)
        options = {**options, "use_token_scaling": token_scaling}
    ignore_index = options.get("ignore_index", -100)
    given_shifted = shift_labels is not None
    token_weights = flat_token_weights(token_weights, shift_labels if given_shifted else labels, given_shifted,
                                       weight.device)
    if shift_labels is None:  # Hugging Face's ForCausalLMLoss: pad one ignored label, drop the first
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    n_classes = transform.width(weight.shape[0])
    if n_classes < weight.shape[0]:  # the family keeps logits[..., :n_classes] (a padded head): those rows
        weight = weight[:n_classes]  # (a view; the padded rows get a zero gradient, as in the stock model)
        bias = None if bias is None else bias[:n_classes]
    hidden = hidden.to(weight.device)
    target = shift_labels.to(weight.device).reshape(-1)
    positions, hidden = tuple(hidden.shape[:-1]), hidden.reshape(-1, hidden.shape[-1])
    if hidden.shape[0] != target.shape[0]:
        shifted = "" if given_shifted else shifted_labels_hint(tuple(labels.shape), positions)
        raise ValueError(f"{type(model).__name__}: " + (shifted or (
                         f"the labels give {target.shape[0]} targets after the "
                         f"shift but the model kept {hidden.shape[0]} positions (logits_to_keep?); with "
                         "logits_to_keep=k pass the labels of the kept positions only, labels[..., -k:] (or "
                         "shift_labels of that shape)")))
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(hidden.device)
    # under autocast, linear_cross_entropy casts hidden / head to the autocast dtype as F.linear would
    try:
        loss = linear_cross_entropy(hidden, weight, target, bias, num_items_in_batch=num_items,
                                    token_weights=token_weights, **options)
    except val.TargetOutOfRange as err:  # name the user's element, not the flattened shifted target's
        raise IndexError(bad_label_message(err, shift_labels.shape, given_shifted)) from None
    # a head sharded over the vocabulary (transformers' tp_plan: a Shard(0) DTensor weight) gives a replicated
    # DTensor loss; the stock model's is a plain tensor (its head gathers the logits)
    return replicated_to_local(loss)
