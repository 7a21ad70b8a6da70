"""Fused-linear preference, RL and distillation losses: the lm_head and the loss in one chunked pass, never the
[tokens, vocab] logits. See docs/ops/losses.md."""

from ._engine import FusedLinearLossConfig
from .distill import fused_linear_jsd
from .preference import (
    DPO_LOSS_TYPES,
    fused_linear_cpo,
    fused_linear_dpo,
    fused_linear_kto,
    fused_linear_orpo,
    fused_linear_preference,
    fused_linear_simpo,
)
from .rl import GRPO_LOSS_TYPES, fused_linear_grpo, fused_linear_logprobs

__all__ = [
    "DPO_LOSS_TYPES",
    "FusedLinearLossConfig",
    "fused_linear_cpo",
    "fused_linear_dpo",
    "fused_linear_kto",
    "fused_linear_orpo",
    "fused_linear_preference",
    "fused_linear_simpo",
    "GRPO_LOSS_TYPES",
    "fused_linear_grpo",
    "fused_linear_jsd",
    "fused_linear_logprobs",
]
