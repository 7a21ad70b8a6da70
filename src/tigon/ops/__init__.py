"""Functional API. Each op runs Triton kernels on CUDA (or on CPU under TRITON_INTERPRET=1) and the
pure-PyTorch reference otherwise; see `tigon.ops._library` for the dispatch rule."""

from ._library import backend_for, dispatch_counts
from .rms_norm import add_rms_norm, rms_norm

__all__ = ["add_rms_norm", "backend_for", "dispatch_counts", "rms_norm"]
