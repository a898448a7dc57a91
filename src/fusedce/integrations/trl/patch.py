"""``fusedce.patch_trl()`` / ``unpatch_trl()``: TRL's fused-LM-head trainers compute their head through fusedce
(``forward.py``)."""
from __future__ import annotations

import gc
import types
from typing import Optional

from fusedce.core.entrance import public_op
from fusedce.integrations.sources import check_sources
from fusedce.integrations.trl import forward
from fusedce.lm_head import invariant
from fusedce.lm_head.head import check_logits_dtype

SUPPORTED_TRL = "1.16"
# sha256 (first 16 hex digits) of inspect.getsource of what fusedce reproduces, in TRL 1.16.0
FINGERPRINTS = {
    "trl.trainer.utils.add_fused_lm_head": "422d009f04b66659",
    "trl.trainer.utils.FusedCausalLMOutput": "5ccdd6e41dcb9f2c",
    "trl.kernels.chunked_logprob.ChunkedLogProbFunction.forward": "1d8220b44273cdf3",
    "trl.kernels.chunked_logprob._torch_transform": "0ea3691ec3682163",
}
_CLOSURE = ("backbone_attr", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale", "original_forward",
            "outputs", "temperature", "text_config")


def _trampoline_factory(backbone_attr, cast_lm_head_to_fp32, final_logit_softcapping, logit_scale,
                        original_forward, outputs, temperature, text_config):
    def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                       **kwargs):
        # Runs with TRL's module globals (a function's globals are its own, not its code's): only
        # builtins and the closure are used here.
        impl = __import__("fusedce.integrations.trl.forward", fromlist=("forward",))
        settings = impl.Settings(backbone_attr, cast_lm_head_to_fp32, final_logit_softcapping, logit_scale,
                                 original_forward, outputs, temperature, text_config)
        return impl.forward(self, settings, args, kwargs, fused_lm_head, labels, shift_labels, num_items_in_batch)
    return _fused_forward


TRAMPOLINE = _trampoline_factory(*_CLOSURE).__code__
_state: Optional[dict] = None   # while patched: the function, its original code, TRL's inner code


def _trl_utils():
    try:
        import trl
        from trl.trainer import utils
    except ImportError as err:
        raise ImportError("fusedce.patch_trl needs TRL (pip install 'fusedce[hf]')") from err
    return trl, utils


def check_trl(trl, utils) -> types.CodeType:
    """The installed TRL is the one fusedce was written against: ``RuntimeError`` otherwise (naming the
    difference). Returns TRL's ``_fused_forward`` code object."""
    version = str(getattr(trl, "__version__", "unknown"))
    if version.split(".")[:2] != SUPPORTED_TRL.split("."):
        raise RuntimeError(f"fusedce.patch_trl was written against TRL {SUPPORTED_TRL}.x and TRL {version} is "
                           "installed: its fused LM head may differ, so fusedce refuses to replace it (install "
                           f"trl=={SUPPORTED_TRL}.* or run TRL's own head)")
    from trl.kernels import chunked_logprob
    objects = {"trl.trainer.utils.add_fused_lm_head": utils.add_fused_lm_head,
               "trl.trainer.utils.FusedCausalLMOutput": utils.FusedCausalLMOutput,
               "trl.kernels.chunked_logprob.ChunkedLogProbFunction.forward":
                   chunked_logprob.ChunkedLogProbFunction.forward,
               "trl.kernels.chunked_logprob._torch_transform": chunked_logprob._torch_transform}
    check_sources("fusedce.patch_trl", f"TRL {version}", objects, FINGERPRINTS)
    inner = [c for c in utils.add_fused_lm_head.__code__.co_consts
             if isinstance(c, types.CodeType) and c.co_name == "_fused_forward"]
    # co_flags & 0xFF: the calling convention (varargs, keywords, nested); higher bits are __future__ flags
    if len(inner) != 1 or inner[0].co_freevars != _CLOSURE or (inner[0].co_flags ^ TRAMPOLINE.co_flags) & 0xFF or \
            inner[0].co_varnames[:7] != TRAMPOLINE.co_varnames[:7]:
        raise RuntimeError("fusedce.patch_trl: TRL's add_fused_lm_head does not hold the _fused_forward closure "
                           "fusedce replaces (free variables or signature differ); refusing to patch")
    return inner[0]


def _swap_closures(old: types.CodeType, new: types.CodeType) -> int:
    """Give every live function whose code is ``old`` the code ``new``; returns how many."""
    count = 0
    for obj in gc.get_referrers(old):
        if isinstance(obj, types.FunctionType) and obj.__code__ is old:
            obj.__code__ = new
            count += 1
    return count


@public_op("integration")
def patch_trl(*, batch_invariant: bool = False, logits_dtype: str = "float32") -> None:
    """Make TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``: SFT, GRPO, RLOO, DPO, KTO) compute
    through :func:`fusedce.linear_token_log_probs`, with TRL's outputs and semantics.

    Process-wide, before or after a trainer is built; idempotent; :func:`unpatch_trl` undoes it. Details:
    docs/integrations.md (Training stacks, TRL).

    Args:
        batch_invariant, logits_dtype: as :func:`fusedce.linear_token_log_probs`, for every fused call until
            the next ``patch_trl``.

    Raises:
        TypeError / ValueError: a bad ``batch_invariant`` / ``logits_dtype``.
        ImportError: TRL is not installed.
        RuntimeError: the installed TRL is not 1.16.x, or the source of the pieces reproduced differs.
    """
    global _state
    invariant.check(batch_invariant)
    forward.OPTIONS.update(batch_invariant=batch_invariant, logits_dtype=check_logits_dtype(logits_dtype))
    trl, utils = _trl_utils()
    function = utils.add_fused_lm_head
    if _state is not None and function.__code__ is _state["patched"]:
        return
    inner = check_trl(trl, utils)
    original = function.__code__
    patched = original.replace(co_consts=tuple(TRAMPOLINE if c is inner else c for c in original.co_consts))
    function.__code__ = patched
    _state = {"function": function, "original": original, "patched": patched, "inner": inner}
    _swap_closures(inner, TRAMPOLINE)


@public_op("integration")
def unpatch_trl() -> None:
    """Undo :func:`patch_trl` (no-op if not patched): TRL's own fused head again, also for the models
    patched in between."""
    global _state
    if _state is None:
        return
    _state["function"].__code__ = _state["original"]
    _swap_closures(TRAMPOLINE, _state["inner"])
    _state = None
    forward.OPTIONS.update(batch_invariant=False, logits_dtype="float32")


def is_patched() -> bool:
    """Whether :func:`patch_trl` is in effect."""
    return _state is not None
