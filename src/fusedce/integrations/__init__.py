"""Integrations with the rest of a training stack: ``distributed`` (vocab-parallel loss over
``torch.distributed``) and ``hf`` (Hugging Face causal-LM patch). Import the submodule you need."""
