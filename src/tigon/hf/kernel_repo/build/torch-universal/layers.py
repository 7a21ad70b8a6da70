"""Layers `kernels.kernelize` swaps in for transformers' hub-kernel layer names. Stateless, as `kernels` requires:
forward runs with the Hugging Face module as `self` and reads its weight and eps."""

import torch

from tigon.hf import kernels as _tigon_kernels


class RMSNorm(torch.nn.Module):
    """transformers' "RMSNorm" layer name on tigon.ops.rms_norm, with the formula the module's family computes
    (Llama's, Gemma's 1 + weight, OLMo-2's fp32 weight: tigon.hf.registry)."""

    def forward(self, hidden_states):
        return _tigon_kernels.rms_norm_forward(self, hidden_states)
