"""Integrations with the rest of a training stack: ``hf``, ``trl``, ``megatron``, ``torchtitan``, ``verl``.
Import the subpackage you need."""
