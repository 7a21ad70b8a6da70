"""Tigon: fused Triton kernels for Hugging Face LLM training and inference.

    import tigon
    tigon.patch(model)      # swap in the fused pieces; tigon.unpatch(model) restores
    tigon.generate(model, input_ids, max_new_tokens=64)   # ring-buffer KV cache, CUDA-graph decoding

Importing tigon is cheap: no CUDA initialisation, no kernel compilation. Submodules load on first use.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["ops", "modules", "memory", "hf", "metrics", "patch", "unpatch", "generate", "__version__"]


def __getattr__(name):
    if name in ("ops", "modules", "memory", "hf", "metrics"):
        return importlib.import_module(f"tigon.{name}")
    if name in ("patch", "unpatch", "PatchReport"):
        return getattr(importlib.import_module("tigon.hf.patch"), name)
    if name == "generate":
        return importlib.import_module("tigon.generation").generate
    raise AttributeError(f"module 'tigon' has no attribute {name!r}")
