"""Σπ² (``actor.calculate_sum_pi_squared``, the optimal-token-baseline's sum of squared probabilities)
with fused kernels in verl's FSDP/HF engine (``FSDPEngineWithLMHead``), which raises
``NotImplementedError`` for that combination (its fused kernels form no logits).

``prepare_model_inputs`` (wrapped): when the micro-batch asks for both, the model's inputs get
``fusedce_sum_pi_squared=True``, which the plugin's forward wrapper (``head.wrap_forward``) takes: the fused
call computes Σπ² with the log-probs and the forward's output carries it. ``prepare_model_outputs``
(wrapped): verl's own code runs on a shallow copy of the micro-batch that does not ask for Σπ² (so it
does not raise), then Σπ² gets the log-probs' layout (packed: squeezed, gathered over the Ulysses group,
unpadded, nested by the sequence offsets; padded: the valid positions, nested), as verl lays out the
non-fused path's Σπ². The caller's micro-batch is not modified.
"""
from __future__ import annotations

import functools

import torch

from fusedce.integrations.verl.head import SUM_PI_SQUARED


def _both(micro_batch) -> bool:
    from verl.utils import tensordict_utils as tu
    return bool(tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False)) and \
        bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False))


def wrap_inputs(original):
    @functools.wraps(original)
    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = original(self, micro_batch=micro_batch)
        if _both(micro_batch):
            model_inputs[SUM_PI_SQUARED] = True
        return model_inputs, output_args
    prepare_model_inputs._fusedce_verl = True
    return prepare_model_inputs


def wrap_outputs(original):
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        if not _both(micro_batch):
            return original(self, output, output_args, micro_batch, logits_processor_func)
        from verl.utils import tensordict_utils as tu
        batch = micro_batch.copy()
        tu.assign_non_tensor_data(batch, "calculate_sum_pi_squared", False)
        model_output = original(self, output, output_args, batch, logits_processor_func)
        values = getattr(output, "sum_pi_squared", None)
        if values is None:
            raise RuntimeError("fusedce.integrations.verl: calculate_sum_pi_squared with fused kernels needs the "
                               "model's forward to be verl's fused forward as the plugin wraps it (activate the "
                               "plugin before the model is built: actor_rollout_ref.model.external_lib)")
        offsets = micro_batch["input_ids"].offsets()
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            values = self._gather_and_unpad_packed(values.squeeze(0), output_args["pad_size"])
        else:
            lengths = offsets.diff()
            positions = torch.arange(values.shape[1], device=values.device)
            values = values[positions < lengths.unsqueeze(1)]
        model_output["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(values, offsets)
        return model_output
    prepare_model_outputs._fusedce_verl = True
    return prepare_model_outputs
