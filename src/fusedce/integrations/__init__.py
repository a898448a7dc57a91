"""Integrations with the rest of a training stack: ``distributed`` (vocab-parallel loss over
``torch.distributed``). Import the submodule you need; nothing is imported here."""
