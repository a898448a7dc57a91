"""Σπ² (``actor.calculate_sum_pi_squared``) with fused kernels in verl's Megatron engine
(``MegatronEngineWithLMHead.forward_step``), which raises ``NotImplementedError`` for that combination before
any fused call.

``forward_step`` (wrapped): when the micro-batch asks for both, verl's own ``forward_step`` runs on a shallow
copy that does not ask for Σπ² (so it does not raise), inside a ``head.Frame`` asking for it: the plugin's
fused call (``functions.compute``, over the tensor-parallel group) leaves Σπ² per token in the frame, and
``postprocess_thd_engine`` (wrapped, in ``model_forward_fused``'s namespace: the fused forward's layout step)
lays it out exactly as it lays out the log-probs (the same packed-sequence and context-parallel arguments, on
its first call of the frame: the log-probs'). The micro-batch's output then carries ``sum_pi_squared`` next
to ``log_probs``, as verl's non-fused path's. The caller's micro-batch is not modified. A pipeline stage
without the head (``post_process`` False) returns what verl's returns.
"""
from __future__ import annotations

import functools

from fusedce.integrations.hf.head import LogitTransform
from fusedce.integrations.verl import head

LAID_OUT = "sum_pi_squared_laid_out"


def _both(engine, batch) -> bool:
    from verl.utils import tensordict_utils as tu
    fused = tu.get_non_tensor_data(batch, key="use_fused_kernels", default=engine.engine_config.use_fused_kernels)
    return bool(fused) and bool(tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False))


def wrap_forward_step(original):
    @functools.wraps(original)
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch = next(batch_iter)
        if not _both(self, batch):
            return original(self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        from verl.utils import tensordict_utils as tu
        copy = batch.copy()
        tu.assign_non_tensor_data(copy, "calculate_sum_pi_squared", False)
        frame = head.Frame(LogitTransform(), True)   # megatron-core's GPTModel has no softcap / logit scale
        head.push(frame)
        try:
            output, post = original(self, iter([copy]), model, logits_processor_func, postprocess_micro_batch_func)
        finally:
            head.pop()
        if isinstance(output, dict):   # the stage holding the head
            if LAID_OUT not in frame.results:
                raise RuntimeError("fusedce.integrations.verl: calculate_sum_pi_squared with fused kernels on the "
                                   "Megatron engine needs verl's fused forward to call fusedce's function (activate "
                                   "the plugin before the engine builds its model: actor_rollout_ref.model."
                                   "external_lib)")
            output["sum_pi_squared"] = frame.results[LAID_OUT]
        return output, post
    forward_step._fusedce_verl = True
    return forward_step


def wrap_postprocess(original):
    @functools.wraps(original)
    def postprocess_thd_engine(output, *args, **kwargs):
        result = original(output, *args, **kwargs)
        frame = head.current()
        if frame is not None and "sum_pi_squared" in frame.results and LAID_OUT not in frame.results:
            raw = frame.results["sum_pi_squared"]
            frame.results[LAID_OUT] = original(raw.reshape(output.shape), *args, **kwargs)
        return result
    postprocess_thd_engine._fusedce_verl = True
    return postprocess_thd_engine
