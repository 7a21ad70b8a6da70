"""Functional API. Each op runs Triton kernels on CUDA (or on CPU under TRITON_INTERPRET=1) and the
pure-PyTorch reference otherwise; see `tigon.ops._library` for the dispatch rule. The launch settings an op takes
as `config=` are the frozen classes of `tigon.ops.config`, exported here too (`FusedLinearLossConfig`, the
fused-linear losses' one, lives with them in `tigon.ops.losses`)."""

from ._library import backend_for, dispatch_counts
from .adamw import adamw_step_, grad_norm
from .adamw8bit import MOMENT_BLOCK, adamw8bit_step_, dequantize_moments, new_moments, quantize_moments
from .config import (
    AdamW8bitConfig,
    AdamWConfig,
    CrossEntropyConfig,
    DecodeAttentionConfig,
    DecodeLinearConfig,
    GLUConfig,
    LinearCrossEntropyConfig,
    QKNormRopeConfig,
    QuantLinearConfig,
    RMSNormConfig,
    RopeConfig,
    RopeKVWriteConfig,
)
from .cross_entropy import cross_entropy
from .decode_attention import decode_attention
from .decode_linear import decode_linear
from .glu_mlp import geglu_mlp, swiglu_mlp
from .kv_write import rope_kv_append, rope_kv_write
from .layer_norm import layer_norm
from .linear_cross_entropy import linear_cross_entropy
from .lora_linear import lora_add, lora_linear
from .losses import *  # noqa: F403  (fused-linear preference / RL / distillation losses)
from .losses import __all__ as _losses_all
from .moe import moe_combine, moe_permute
from .qk_norm_rope import qk_norm_rope
from .quant_linear import quant_linear
from .quantized_weight import QuantizedWeight
from .rms_norm import add_rms_norm, rms_norm
from .rope import apply_rope
from .swiglu import geglu, swiglu

__all__ = [
    "AdamW8bitConfig",
    "AdamWConfig",
    "CrossEntropyConfig",
    "DecodeAttentionConfig",
    "DecodeLinearConfig",
    "GLUConfig",
    "LinearCrossEntropyConfig",
    "MOMENT_BLOCK",
    "QKNormRopeConfig",
    "QuantLinearConfig",
    "QuantizedWeight",
    "RMSNormConfig",
    "RopeConfig",
    "RopeKVWriteConfig",
    "adamw8bit_step_",
    "adamw_step_",
    "add_rms_norm",
    "apply_rope",
    "backend_for",
    "cross_entropy",
    "decode_attention",
    "decode_linear",
    "dequantize_moments",
    "dispatch_counts",
    "geglu",
    "geglu_mlp",
    "grad_norm",
    "layer_norm",
    "linear_cross_entropy",
    "lora_add",
    "lora_linear",
    "moe_combine",
    "moe_permute",
    "new_moments",
    "qk_norm_rope",
    "quant_linear",
    "quantize_moments",
    "rms_norm",
    "rope_kv_append",
    "rope_kv_write",
    "swiglu",
    "swiglu_mlp",
]
__all__ += _losses_all
