"""Hugging Face integration: the family table, patch()/unpatch(), the fused-loss CausalLM forward."""

from .kernels import kernel_config  # imports the `kernels` package only when called
from .patch import PatchReport, patch, unpatch

__all__ = ["PatchReport", "kernel_config", "patch", "unpatch"]
