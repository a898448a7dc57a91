"""``patch_verl()`` / ``unpatch_verl()``: what the plugin replaces in verl 0.9.1 (``version.py`` checks it
first), each a module or class attribute, restored by ``unpatch_verl``:

- ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` and
  ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``: fusedce's (``functions.py``). verl's HF
  forwards import them inside their bodies, so the module attributes are what they call.
- ``verl.models.mcore.model_forward_fused.linear_cross_entropy`` (called by ``fused_output_processor``, the
  Megatron hook route, and by ``_fused_GPTModel_forward``, the legacy forward route) and
  ``verl.models.mcore.model_forward_1f1b_overlap.linear_cross_entropy``: the same function (those modules
  imported it by name), over verl's tensor-parallel group (``tensor_parallel.py``). Only where they import
  (megatron-core installed).
- ``forward_with_torch_backend`` / ``forward_with_triton_backend`` of ``verl.models.transformers.dense_common``
  and of the multimodal modules that import: wrapped (``head.wrap_forward``) so that the fused call knows
  its model's head transform. ``patch_forward_with_backends`` imports them when a model is built, so a model
  built before the plugin activated keeps verl's forwards (activate it first: ``external_lib`` does).
- ``FSDPEngineWithLMHead.prepare_model_inputs`` / ``prepare_model_outputs``: wrapped for Σπ² (``engine.py``).
- ``MegatronEngineWithLMHead.forward_step`` and ``model_forward_fused.postprocess_thd_engine``: wrapped for Σπ²
  on the Megatron engine (``megatron_engine.py``; where megatron-core imports).
"""
from __future__ import annotations

import importlib

from fusedce.integrations.verl import engine, functions, head, megatron_engine, options, version

_VLM = ("verl.models.transformers.qwen2_vl", "verl.models.transformers.qwen3_vl", "verl.models.transformers.glm4v",
        "verl.models.transformers.qwen3_5")
_MCORE = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")
_saved: list = []   # while patched: (owner, attribute, original value)


def _set(owner, name: str, value) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def patch_verl() -> list:
    """Activate the plugin (idempotent): check the installed verl (``version.check_verl``), read
    ``$FUSEDCE_VERL`` (``options``), replace verl's fused log-prob + entropy functions (module docstring).
    Returns the replaced attributes' names (``"module:attribute"``).

    Raises:
        ImportError: verl is not installed.
        RuntimeError: verl is not 0.9.1, or a piece's source differs from what the plugin was written against.
        ValueError: a bad ``$FUSEDCE_VERL``.
    """
    if _saved:
        return names()
    version.check_verl()
    options.load_env()
    from verl.utils.experimental import torch_functional
    from verl.utils.kernel import linear_cross_entropy as kernel
    from verl.models.transformers import dense_common
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    try:
        _set(torch_functional, "FusedLinearForPPO", functions.FusedLinearForPPO)
        _set(kernel, "linear_cross_entropy", functions.linear_cross_entropy)
        for module in [dense_common] + [m for m in map(_module, _VLM) if m is not None]:
            for name in ("forward_with_torch_backend", "forward_with_triton_backend"):
                if hasattr(module, name):
                    _set(module, name, head.wrap_forward(getattr(module, name)))
        for module in filter(None, map(_module, _MCORE)):
            _set(module, "linear_cross_entropy", functions.linear_cross_entropy)
        fused, megatron = _module(_MCORE[0]), _module("verl.workers.engine.megatron.transformer_impl")
        if fused is not None and megatron is not None:
            _set(fused, "postprocess_thd_engine", megatron_engine.wrap_postprocess(fused.postprocess_thd_engine))
            lm_head = megatron.MegatronEngineWithLMHead
            _set(lm_head, "forward_step", megatron_engine.wrap_forward_step(lm_head.forward_step))
        _set(FSDPEngineWithLMHead, "prepare_model_inputs",
             engine.wrap_inputs(FSDPEngineWithLMHead.prepare_model_inputs))
        _set(FSDPEngineWithLMHead, "prepare_model_outputs",
             engine.wrap_outputs(FSDPEngineWithLMHead.prepare_model_outputs))
    except BaseException:
        unpatch_verl()
        raise
    return names()


def unpatch_verl() -> None:
    """Restore what :func:`patch_verl` replaced (no-op if not active); the options return to their defaults."""
    while _saved:
        owner, name, value = _saved.pop()
        setattr(owner, name, value)
    options.OPTIONS.clear()
    options.OPTIONS.update(options.DEFAULTS)


def names() -> list:
    """``"module:attribute"`` of each replaced attribute (empty when not active)."""
    return [f"{getattr(o, '__module__', None) if isinstance(o, type) else o.__name__}:"
            f"{o.__name__ + '.' if isinstance(o, type) else ''}{n}" for o, n, _ in _saved]


def is_patched() -> bool:
    return bool(_saved)
