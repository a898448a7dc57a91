"""``fusedce.patch_distillation_trainer(trainer)``: TRL's distillation trainers compute their loss through
:func:`fusedce.linear_distillation_loss`, so neither the student's nor the teacher's logits exist."""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Optional

from fusedce.core.entrance import public_op
from fusedce.integrations.trl.distill_loss import Options, divergence_loss, gkd_loss
from fusedce.integrations.sources import check_sources
from fusedce.integrations.trl.patch import SUPPORTED_TRL

# sha256 (first 16 hex digits) of inspect.getsource of what fusedce reproduces or rebinds, in TRL 1.16.0
FINGERPRINTS = {
    "trl.trainer.distillation_trainer._chunked_divergence_loss": "550cb45191ab1654",
    "trl.trainer.distillation_trainer.DistillationTrainer._compute_loss": "9fc0021cbcc0b5e9",
    "trl.experimental.gkd.gkd_trainer.GKDTrainer.compute_loss": "6c602000b7955e81",
    "trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss": "fa445e28549d31b6",
}
_ATTR = "_fusedce_distillation"   # set on a patched trainer: (the patched method's name, Options)


def _trl():
    try:
        import trl
        from trl.trainer import distillation_trainer
    except ImportError as err:
        raise ImportError("fusedce.patch_distillation_trainer needs TRL (pip install 'fusedce[hf]')") from err
    return trl, distillation_trainer


def _gkd_module():
    try:
        from trl.experimental.gkd import gkd_trainer
    except ImportError:   # an install without the experimental trainers
        return None
    return gkd_trainer


def _check(trl, objects: dict) -> None:
    version = str(getattr(trl, "__version__", "unknown"))
    if version.split(".")[:2] != SUPPORTED_TRL.split("."):
        raise RuntimeError(f"fusedce.patch_distillation_trainer was written against TRL {SUPPORTED_TRL}.x and "
                           f"TRL {version} is installed: its distillation loss may differ, so fusedce refuses to "
                           f"replace it (install trl=={SUPPORTED_TRL}.* or run TRL's own loss)")
    check_sources("fusedce.patch_distillation_trainer", f"TRL {version}", objects, FINGERPRINTS)


def _not_overridden(trainer, base, name: str) -> None:
    if getattr(type(trainer), name) is not getattr(base, name):
        raise TypeError(f"{type(trainer).__name__} overrides {base.__name__}.{name}, which "
                        "fusedce.patch_distillation_trainer replaces: refusing to patch it")


def _distillation_compute_loss(module, options: Options):
    """TRL's ``DistillationTrainer._compute_loss`` with ``_chunked_divergence_loss`` resolved to
    fusedce's: the same code object over a copy of its module's globals."""
    original = module.DistillationTrainer._compute_loss
    scope = dict(vars(module))
    scope["_chunked_divergence_loss"] = functools.partial(divergence_loss, options=options)
    function = types.FunctionType(original.__code__, scope, original.__name__, original.__defaults__,
                                  original.__closure__)
    function.__kwdefaults__ = original.__kwdefaults__
    return function


def _gkd_compute_loss(original, options: Options):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:   # the caller wants the model outputs (logits): TRL's own loss
            return original(self, model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        return gkd_loss(self, model, inputs, num_items_in_batch, options)
    return compute_loss


@public_op("integration")
def patch_distillation_trainer(trainer, *, method: str = "auto", chunk_size: Optional[int] = None,
                               backend: Optional[str] = None, deterministic: Optional[bool] = None,
                               entropy: bool = True):
    """Make ``trainer`` (a TRL 1.16 ``DistillationTrainer`` or ``experimental.gkd.GKDTrainer``) compute its
    distillation loss with :func:`fusedce.linear_distillation_loss`, without either model's logits.

    Call it once before ``train()``; returns ``trainer``; idempotent; :func:`unpatch_distillation_trainer`
    undoes it. Details: docs/integrations.md (Training stacks, TRL).

    Args:
        trainer: the trainer object; only it is changed.
        method, chunk_size, backend, deterministic: as :func:`fusedce.linear_distillation_loss`.
        entropy: bool; False skips the student-entropy pass ``DistillationTrainer`` logs (NaN is logged).

    Raises:
        ImportError: TRL is not installed.
        RuntimeError: the installed TRL is not 1.16.x, or the source of a function reproduced differs.
        TypeError: ``trainer`` is neither trainer, or its class overrides the patched method.
    """
    trl, module = _trl()
    options = Options(method=method, chunk_size=chunk_size, backend=backend, deterministic=deterministic,
                      entropy=bool(entropy))
    gkd = _gkd_module()
    if isinstance(trainer, module.DistillationTrainer):
        _check(trl, {"trl.trainer.distillation_trainer._chunked_divergence_loss": module._chunked_divergence_loss,
                     "trl.trainer.distillation_trainer.DistillationTrainer._compute_loss":
                         module.DistillationTrainer._compute_loss})
        _not_overridden(trainer, module.DistillationTrainer, "_compute_loss")
        name, function = "_compute_loss", _distillation_compute_loss(module, options)
    elif gkd is not None and isinstance(trainer, gkd.GKDTrainer):
        _check(trl, {"trl.experimental.gkd.gkd_trainer.GKDTrainer.compute_loss": gkd.GKDTrainer.compute_loss,
                     "trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss":
                         gkd.GKDTrainer.generalized_jsd_loss})
        _not_overridden(trainer, gkd.GKDTrainer, "compute_loss")
        name, function = "compute_loss", _gkd_compute_loss(gkd.GKDTrainer.compute_loss, options)
    else:
        raise TypeError(f"fusedce.patch_distillation_trainer takes a trl.DistillationTrainer or a "
                        f"trl.experimental.gkd.GKDTrainer, not {type(trainer).__name__}")
    setattr(trainer, name, types.MethodType(function, trainer))
    setattr(trainer, _ATTR, (name, options))
    return trainer


@public_op("integration")
def unpatch_distillation_trainer(trainer):
    """Undo :func:`patch_distillation_trainer` on ``trainer`` (no-op if not patched): TRL's own loss
    again from the next step on. Returns ``trainer``."""
    state = trainer.__dict__.pop(_ATTR, None)
    if state is not None:
        trainer.__dict__.pop(state[0], None)
    return trainer


def distillation_options(trainer) -> Optional[dict]:
    """The fusedce options ``trainer`` was patched with (a dict), or None if it is not patched."""
    state = trainer.__dict__.get(_ATTR)
    return None if state is None else dataclasses.asdict(state[1])
