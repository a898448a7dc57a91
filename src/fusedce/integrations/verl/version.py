"""The installed verl is 0.9.1 with the source the plugin was written against (a SHA-256 fingerprint per
piece, ``integrations/sources.py``), or ``RuntimeError`` / ``ImportError``."""
from __future__ import annotations

import importlib

from fusedce.integrations.sources import check_sources

SUPPORTED_VERL = "0.9.1"
# sha256 (first 16 hex digits) of inspect.getsource of each piece, in verl 0.9.1: "module:qualified name"
FINGERPRINTS = {
    "verl.utils.experimental.torch_functional:FusedLinearForPPO": "ade3cc04678fe81c",
    "verl.utils.kernel.linear_cross_entropy:LinearCrossEntropy": "1486795b4ec098b0",
    "verl.models.transformers.dense_common:forward_with_torch_backend": "9dfa2d5c62a05668",
    "verl.models.transformers.dense_common:forward_with_triton_backend": "2f9e9e6399951ca8",
    "verl.models.transformers.monkey_patch:patch_forward_with_backends": "5dc0421dc19e38c7",
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_inputs": "e7a30a3b61b58c8b",
    "verl.workers.engine.fsdp.transformer_impl:FSDPEngineWithLMHead.prepare_model_outputs": "5239f536e8f617e3",
    "verl.models.mcore.model_forward_fused:fused_output_processor": "369cab7ebe251bd1",
    "verl.models.mcore.model_forward_fused:_fused_GPTModel_forward": "1a0e14f4ee93b934",
    "verl.models.mcore.model_forward_1f1b_overlap:gptmodel_forward_1f1b_overlap": "c1a60bbbc196c494",
    # Σπ² on the Megatron engine (megatron_engine.py): the step it wraps, the fused forward whose layout
    # step it repeats for Σπ², that layout step
    "verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.forward_step": "06c4b5945bcbc00d",
    "verl.models.mcore.model_forward_fused:fused_forward_model_engine": "87e023deafae3375",
    "verl.models.mcore.util:postprocess_thd_engine": "1b3b7a4ac1240b57",
}
# the pieces a CPU-only verl install may lack (their engine needs megatron-core)
OPTIONAL = ("verl.models.mcore.", "verl.workers.engine.megatron.")


def import_verl():
    """The ``verl`` package, or ``ImportError`` saying what the plugin needs."""
    try:
        import verl
    except ImportError as err:
        from importlib import metadata
        try:
            installed = metadata.version("verl")
        except metadata.PackageNotFoundError:
            installed = None
        how = (f"verl {installed} is installed but does not import (a dependency of its own missing?)"
               if installed else f"pip install verl=={SUPPORTED_VERL}")
        raise ImportError(f"fusedce.integrations.verl needs verl {SUPPORTED_VERL} ({how}); "
                          f"importing it failed: {err}") from err
    if getattr(verl, "__file__", None) is None:   # a folder named verl on sys.path (a namespace package)
        raise ImportError(f"fusedce.integrations.verl needs verl {SUPPORTED_VERL} "
                          f"(pip install verl=={SUPPORTED_VERL}); "
                          f"'import verl' found only the folder(s) {list(getattr(verl, '__path__', []))}")
    return verl


def resolve(key: str):
    """The object ``"module:qualified.name"`` names (``ImportError`` if its module does not import)."""
    module_name, _, path = key.partition(":")
    obj = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def pieces() -> dict:
    """{key: object} of the pieces present (the optional ones whose modules import)."""
    found = {}
    for key in FINGERPRINTS:
        try:
            found[key] = resolve(key)
        except ImportError:
            if not key.startswith(OPTIONAL):
                raise
    return found


def check_verl() -> dict:
    """``RuntimeError`` unless the installed verl is 0.9.1 with the pieces' sources the plugin was written
    against; returns ``pieces()``."""
    verl = import_verl()
    version = str(getattr(verl, "__version__", "unknown"))
    if version != SUPPORTED_VERL:
        raise RuntimeError(f"fusedce.integrations.verl was written against verl {SUPPORTED_VERL} and verl {version} is "
                           "installed: its fused log-prob functions may differ, so fusedce refuses to replace them "
                           f"(install verl=={SUPPORTED_VERL}, or run without actor_rollout_ref.model.external_lib="
                           "fusedce.integrations.verl)")
    found = pieces()
    check_sources("fusedce.integrations.verl", f"verl {version}", found, FINGERPRINTS)
    return found
