"""Hugging Face integration: the family table, the patcher behind tigon.patch / tigon.unpatch (patching.py:
patch_hf_model / unpatch_hf_model, which leave out the decode step tigon.patch installs: call tigon.patch), the
fused-loss CausalLM forward."""

from .kernels import kernel_config  # imports the `kernels` package only when called
from .patching import PatchReport

__all__ = ["PatchReport", "kernel_config"]
