"""Integrations with the rest of a training stack, on top of the library: ``hf`` (Hugging Face causal-LM
patch), ``trl`` (TRL's fused-head and distillation trainers), ``megatron`` (Megatron-core's ``GPTModel``
under tensor parallelism) and ``torchtitan`` (a loss config for torchtitan 0.3.0 jobs). Import the subpackage you
need."""
