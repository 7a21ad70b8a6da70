"""Drop-in nn.Modules, state_dict-compatible with the Hugging Face modules they replace: norms.py (RMSNorm,
LayerNorm), mlp.py (the gated MLPs), losses.py (every loss module, none with parameters)."""

from .losses import (
    CrossEntropyLoss,
    FusedLinearCPOLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
    FusedLinearKTOLoss,
    FusedLinearLogProbs,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
    LinearCrossEntropyLoss,
)
from .mlp import GeGLUMLP, SwiGLUMLP
from .norms import LayerNorm, RMSNorm

__all__ = ["CrossEntropyLoss", "GeGLUMLP", "LayerNorm", "LinearCrossEntropyLoss", "RMSNorm", "SwiGLUMLP"] + [
    "FusedLinearCPOLoss", "FusedLinearDPOLoss", "FusedLinearGRPOLoss", "FusedLinearJSDLoss", "FusedLinearKTOLoss",
    "FusedLinearLogProbs", "FusedLinearORPOLoss", "FusedLinearSimPOLoss",
]
