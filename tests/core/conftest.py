"""Fixtures of the ``tests/core`` walks over every public op (``public_ops.CALLS``)."""
from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo process group for the vocabulary-parallel ops (made unless one exists; destroyed
    after the module if made here)."""
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
