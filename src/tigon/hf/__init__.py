"""Hugging Face integration: the family table, patch()/unpatch(), the fused-loss CausalLM forward."""

from .patch import PatchReport, patch, unpatch

__all__ = ["PatchReport", "patch", "unpatch"]
