"""The installed megatron-core is the one ``patch_megatron`` was written against, or ``RuntimeError``."""
from __future__ import annotations

import dataclasses
import importlib

from fusedce.integrations.sources import check_sources

_GPT = "megatron.core.models.gpt.gpt_model.GPTModel"
_LM = "megatron.core.models.common.language_module.language_module.LanguageModule"
_MTP = "megatron.core.transformer.multi_token_prediction"
POSTPROCESS, FORWARD = f"{_GPT}._postprocess", f"{_GPT}.forward"
LOSS, SCALE = f"{_LM}.compute_language_model_loss", f"{_LM}._scale_logits"
LAYER = "megatron.core.tensor_parallel.layers.ColumnParallelLinear.forward"
MTP_LOSS, ACCEPTANCE = f"{_MTP}.process_mtp_loss", f"{_MTP}._compute_mtp_acceptance_counts"


@dataclasses.dataclass(frozen=True)
class Release:
    """What a megatron-core release offers at the head; ``fingerprints``: sha256 (first 16 hex digits) of
    ``inspect.getsource`` of each piece the patch relies on, in the release ``tested``."""

    tested: str
    output_processor: bool      # GPTModel.forward(..., output_processor=...) (0.18+)
    scale_logits: bool          # LanguageModule._scale_logits, MuP (0.17+)
    acceptance_counts: bool     # process_mtp_loss counts argmax hits of each MTP head (0.19)
    fingerprints: dict


RELEASES = {
    "0.16": Release("0.16.1", False, False, False, {
        POSTPROCESS: "a5f7de0bfb1cad97", LOSS: "86cf8e890a0f9c9b", LAYER: "3f9d98f23b319c03"}),
    "0.17": Release("0.17.0", False, True, False, {
        POSTPROCESS: "4ae592221f4fd816", LOSS: "86cf8e890a0f9c9b", LAYER: "3f9d98f23b319c03",
        SCALE: "8eb5ca0ddad585c9", MTP_LOSS: "0a0fdf623bd095c1"}),
    "0.18": Release("0.18.0", True, True, False, {
        POSTPROCESS: "de4dbfb0d7d41088", FORWARD: "ecf2ffcb318347f6", LOSS: "7ab354400f220b50",
        LAYER: "8de69f2acd5f7e9b", SCALE: "8eb5ca0ddad585c9", MTP_LOSS: "55b7a80ffcbc078c"}),
    "0.19": Release("0.19.2", True, True, True, {
        POSTPROCESS: "41700c5f809c197c", FORWARD: "ecf2ffcb318347f6", LOSS: "cfdd820917a28309",
        LAYER: "dac5d6cfeaa44ba6", SCALE: "8eb5ca0ddad585c9", MTP_LOSS: "7a459bac5884e8bf",
        ACCEPTANCE: "cf771eb0e275b108"}),
}
SUPPORTED = ", ".join(f"{r.tested}" for r in RELEASES.values())


def megatron_core():
    """The ``megatron.core`` package, or ``ImportError`` saying how to install it."""
    try:
        import megatron.core
        from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: F401  (importable: checked here)
    except ImportError as err:
        raise ImportError("fusedce.patch_megatron needs megatron-core (tested: "
                          f"{SUPPORTED}; pip install --no-deps 'megatron-core==0.16.1' on Python 3.11, "
                          "or 'fusedce[megatron]')") from err
    return megatron.core


def resolve(qualified: str):
    """The object a dotted ``module.Class.attribute`` name refers to."""
    parts = qualified.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(qualified)


def installed_version() -> str:
    core = megatron_core()
    return str(getattr(getattr(core, "package_info", None), "__version__", "unknown"))


def check_megatron() -> Release:
    """The installed release's ``Release``; ``RuntimeError`` unless it is 0.16 .. 0.19 with the pieces'
    sources unchanged (naming the difference); ``ImportError`` if it is not installed."""
    version = installed_version()
    release = RELEASES.get(".".join(version.split(".")[:2]))
    if release is None:
        raise RuntimeError(f"fusedce.patch_megatron was written against megatron-core {SUPPORTED} and "
                           f"megatron-core {version} is installed: its GPTModel loss path may differ, so fusedce "
                           "refuses to replace it (install one of those releases or leave the model unpatched)")
    pieces = {}
    for name in release.fingerprints:
        try:
            pieces[name] = resolve(name)
        except (ImportError, AttributeError) as err:
            raise RuntimeError(f"fusedce.patch_megatron: megatron-core {version} has no {name} ({err}), which "
                               f"megatron-core {release.tested} has; refusing to patch") from err
    check_sources("fusedce.patch_megatron", f"megatron-core {version}", pieces, release.fingerprints)
    return release
