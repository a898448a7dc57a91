"""Integrations with the rest of a training stack, on top of the library: ``hf`` (Hugging Face causal-LM
patch) and ``trl`` (TRL's fused-head and distillation trainers). Import the subpackage you need."""
