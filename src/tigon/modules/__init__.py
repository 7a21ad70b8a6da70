"""Drop-in nn.Modules, state_dict-compatible with the Hugging Face modules they replace."""

from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .losses import (
    FusedLinearCPOLoss,
    FusedLinearDPOLoss,
    FusedLinearGRPOLoss,
    FusedLinearJSDLoss,
    FusedLinearKTOLoss,
    FusedLinearLogProbs,
    FusedLinearORPOLoss,
    FusedLinearSimPOLoss,
)
from .mlp import GeGLUMLP, SwiGLUMLP
from .norms import LayerNorm, RMSNorm

__all__ = ["CrossEntropyLoss", "GeGLUMLP", "LayerNorm", "LinearCrossEntropyLoss", "RMSNorm", "SwiGLUMLP"] + [
    "FusedLinearCPOLoss", "FusedLinearDPOLoss", "FusedLinearGRPOLoss", "FusedLinearJSDLoss", "FusedLinearKTOLoss",
    "FusedLinearLogProbs", "FusedLinearORPOLoss", "FusedLinearSimPOLoss",
]
