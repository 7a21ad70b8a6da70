"""Tigon: fused Triton kernels for Hugging Face LLM training and inference.

    import tigon
    tigon.patch(model)      # swap in the fused pieces; tigon.unpatch(model) restores
    tigon.generate(model, input_ids, max_new_tokens=64)   # ring-buffer KV cache, CUDA-graph decoding
    tigon.quantize(model, "int4", group_size=128)          # 4- or 8-bit weights (tigon.quant), in place

Importing tigon is cheap: no CUDA initialisation, no kernel compilation. Submodules load on first use.
Layers, lowest first (each imports only those below it; tests/test_layering.py reads the imports):
ops (torch + Triton) < memory, modules, optim, quant (4- and 8-bit weights), metrics < hf < compat, decode (the
inference wing) < api (patch/unpatch) < this package < cli (the `tigon` command and its demo).
"""

import importlib

from . import _log

__version__ = "0.1.0"
__all__ = ["ops", "modules", "memory", "optim", "quant", "hf", "decode", "metrics", "patch", "unpatch", "generate",
           "DecodeSettings", "quantize", "__version__"]


def __getattr__(name):
    # a missing optional package (transformers for patch and generate) surfaces as the extra to install
    with _log.requires_extra(f"tigon.{name}"):
        if name in ("ops", "modules", "memory", "optim", "quant", "hf", "decode", "metrics"):
            return importlib.import_module(f"tigon.{name}")
        if name == "quantize":  # round-to-nearest 4- and 8-bit weights (tigon.quant.quantize)
            return importlib.import_module("tigon.quant").quantize
        if name in ("patch", "unpatch"):
            return getattr(importlib.import_module("tigon.api"), name)
        if name == "PatchReport":
            return importlib.import_module("tigon.hf.patching").PatchReport
        if name in ("generate", "DecodeSettings"):
            return getattr(importlib.import_module("tigon.decode"), name)
    raise AttributeError(f"module 'tigon' has no attribute {name!r}")
