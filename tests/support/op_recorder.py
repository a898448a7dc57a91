"""``OpRecorder``: a TorchDispatchMode recording what every op allocates and the FLOPs of every matmul (the linear
ops' memory and tiled tests)."""
import torch
from torch._library.custom_ops import OPDEFS
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.addmm_, aten.bmm, aten.baddbmm}


def _storage(t):
    return t.untyped_storage().data_ptr()


class OpRecorder(TorchDispatchMode):
    """Records the size (elements) of every tensor an op allocates and the FLOPs of every matmul.

    The PyTorch backend's loops are custom ops (``fusedce_torch::*``) whose Python implementations run
    ATen ops: the recorder runs those implementations itself, under the recorder, so that every block
    they allocate is seen (a mode does not see inside an op it dispatches). Modes are per thread, so
    while recording the intra-op thread count is 1: the block loops (``backends/pytorch/launch.run``) then run in
    the calling thread."""

    def __init__(self):
        super().__init__()
        self.largest, self.largest_op, self.flops, self.sizes = 0, None, 0, []

    def __enter__(self):
        self._threads = getattr(self, "_threads", []) + [torch.get_num_threads()]   # re-entered below
        torch.set_num_threads(1)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_num_threads(self._threads.pop())
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "fusedce_torch":   # a torch-backend loop: record what its body allocates
            with self:
                out = OPDEFS[func.name()]._init_fn(*args, **kwargs)
            return out
        out = func(*args, **kwargs)
        # views and in-place / out= results share an input's storage: not an allocation
        inputs = {_storage(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage(t) not in inputs:
                # The Triton interpreter copies kernel arguments to and fro as raw uint8 storage: count
                # those in 4-byte units (an fp32 chunk of logits is then chunk x V, as it is).
                n = t.numel() // 4 if t.dtype == torch.uint8 else t.numel()
                self.sizes.append(n)
                if n > self.largest:
                    self.largest, self.largest_op = n, f"{func} -> {tuple(t.shape)} {t.dtype}"
        if func.overloadpacket in MATMULS:
            a, b = args[-2], args[-1]             # mm(a, b) / addmm(c, a, b)
            self.flops += 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return out
