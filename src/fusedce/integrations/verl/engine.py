"""Σπ² (``actor.calculate_sum_pi_squared``) with fused kernels in verl's FSDP/HF engine: the wrapped
``prepare_model_inputs`` asks the fused call for it, the wrapped ``prepare_model_outputs`` lays it out as verl
lays out the non-fused path's (docs/verl.md)."""
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
