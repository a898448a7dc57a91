"""Integrations with the rest of a training stack, on top of the library: ``hf`` (Hugging Face causal-LM
patch), ``trl`` (TRL's fused-head and distillation trainers) and ``megatron`` (Megatron-core's ``GPTModel``
under tensor parallelism). Import the subpackage you need."""
