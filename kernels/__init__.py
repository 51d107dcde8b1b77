"""Attention over the paged KV cache and the small fused ops of the model, each with a torch reference."""
from kernels.dispatch import Ops, get_ops, leading_decodes

__all__ = ["Ops", "get_ops", "leading_decodes"]
