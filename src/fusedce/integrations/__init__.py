"""Integrations with the rest of a training stack: ``distributed`` (vocab-parallel loss over
``torch.distributed``), ``hf`` (Hugging Face causal-LM patch), ``trl_patch`` (TRL's fused-head trainers)
and ``trl_distill`` (TRL's distillation trainers). Import the submodule you need."""
