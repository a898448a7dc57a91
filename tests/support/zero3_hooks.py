"""``Zero3Hooks``: ZeRO-3's gather / release / re-gather hook pattern, emulated (``tests/hf/test_hf_zero3.py``,
``test_trl_patch.py``)."""
import torch


class Zero3Hooks:
    """ZeRO-3's gather / release / re-gather pattern on every module of ``root``'s subtree that owns
    parameters. ``counts``: pre-hook, hook and backward re-gather calls."""

    def __init__(self, root: torch.nn.Module):
        self.full, self.counts = {}, {"pre": 0, "post": 0, "regather": 0}
        for module in root.modules():
            params = list(module.parameters(recurse=False))
            if not params:
                continue
            self.full[module] = [p.data for p in params]
            self._release(module)
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post)

    def _gather(self, module):
        for p, data in zip(module.parameters(recurse=False), self.full[module]):
            p.data = data

    def _release(self, module):
        for p in module.parameters(recurse=False):
            p.data = torch.empty(0, dtype=p.dtype)

    def _pre(self, module, args):
        self.counts["pre"] += 1
        self._gather(module)

    def _post(self, module, args, out):
        self.counts["post"] += 1
        self._release(module)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            def regather(grad):
                self.counts["regather"] += 1
                self._gather(module)   # stays gathered: the weight gradient accumulates into its shape
                return grad
            out.register_hook(regather)
