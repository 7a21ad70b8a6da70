"""Quantized weights in: QuantLinear, round-to-nearest `quantize`, and the checkpoint importers (GPTQ, AWQ,
compressed-tensors, FP8, bitsandbytes NF4, torchao int4) with `adopt` / `release` to swap a loaded model's
projections, and `stack`, a decoder layer's projections joined for the fused decode step. docs/quantized.md says
which format maps to what."""

from .adopt import adopt, quantized_projections, release
from .importers import (
    IMPORTERS,
    format_of,
    import_awq,
    import_bnb4,
    import_compressed_tensors,
    import_fp8,
    import_gptq,
    import_torchao,
)
from .module import QuantLinear, quantize_rtn
from .quantize import quantize

__all__ = ["IMPORTERS", "QuantLinear", "adopt", "format_of", "import_awq", "import_bnb4", "import_compressed_tensors",
           "import_fp8", "import_gptq", "import_torchao", "quantize", "quantize_rtn", "quantized_projections",
           "release"]
