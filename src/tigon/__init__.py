"""Tigon: fused Triton kernels for Hugging Face LLM training and inference.

Importing tigon is cheap: no CUDA initialisation, no kernel compilation. Submodules load on first use.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["ops", "modules", "memory", "__version__"]


def __getattr__(name):
    if name in ("ops", "modules", "memory"):
        return importlib.import_module(f"tigon.{name}")
    raise AttributeError(f"module 'tigon' has no attribute {name!r}")
