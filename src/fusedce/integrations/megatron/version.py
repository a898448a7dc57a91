"""The installed megatron-core is the one ``patch_megatron`` was written against, or ``RuntimeError``."""
from __future__ import annotations

from fusedce.integrations.sources import check_sources

SUPPORTED_MEGATRON = "0.16"
# sha256 (first 16 hex digits) of inspect.getsource of what the patch relies on, in megatron-core 0.16.1
_LOSS = "megatron.core.models.common.language_module.language_module.LanguageModule.compute_language_model_loss"
FINGERPRINTS = {
    "megatron.core.models.gpt.gpt_model.GPTModel._postprocess": "a5f7de0bfb1cad97",
    _LOSS: "86cf8e890a0f9c9b",
    "megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward": "3f9d98f23b319c03",
}


def megatron_core():
    """The ``megatron.core`` package, or ``ImportError`` saying how to install it."""
    try:
        import megatron.core
        from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401  (importable: checked here)
    except ImportError as err:
        raise ImportError("fusedce.patch_megatron needs megatron-core "
                          f"(pip install --no-deps 'megatron-core=={SUPPORTED_MEGATRON}.1', or 'fusedce[megatron]')"
                          ) from err
    return megatron.core


def pieces() -> dict:
    """{qualified name: object} of the megatron-core pieces the patch relies on (module docstring)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    return {"megatron.core.models.gpt.gpt_model.GPTModel._postprocess": GPTModel._postprocess,
            _LOSS: LanguageModule.compute_language_model_loss,
            "megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward": ColumnParallelLinear.forward}


def check_megatron() -> None:
    """``RuntimeError`` unless the installed megatron-core is 0.16.x with the pieces' sources unchanged
    (naming the difference); ``ImportError`` if it is not installed."""
    core = megatron_core()
    version = str(getattr(getattr(core, "package_info", None), "__version__", "unknown"))
    if version.split(".")[:2] != SUPPORTED_MEGATRON.split("."):
        raise RuntimeError(f"fusedce.patch_megatron was written against megatron-core {SUPPORTED_MEGATRON}.x and "
                           f"megatron-core {version} is installed: its GPTModel loss path may differ, so fusedce "
                           f"refuses to replace it (install megatron-core=={SUPPORTED_MEGATRON}.* or leave the model "
                           "unpatched)")
    check_sources("fusedce.patch_megatron", f"megatron-core {version}", pieces(), FINGERPRINTS)
