"""``patch_verl()`` / ``unpatch_verl()``: the verl 0.9.1 module and class attributes the plugin replaces or
wraps (the table in docs/verl.md), each restored by ``unpatch_verl``."""
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
    """Activate the plugin (idempotent); returns the replaced attributes' names (``"module:attribute"``).

    Raises:
        ImportError: verl is not installed.
        RuntimeError: verl is not 0.9.1, or a piece's source differs.
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
