"""Layers `kernels.kernelize` swaps in for transformers' hub-kernel layer names. Stateless, as `kernels` requires:
forward runs with the Hugging Face module as `self` and reads its weights and eps (tigon.hf.kernels)."""

import torch

from tigon.hf import kernels as _tigon_kernels


class RMSNorm(torch.nn.Module):
    """transformers' "RMSNorm" layer name on tigon.ops.rms_norm, with the formula the module's family computes
    (Llama's, Gemma's 1 + weight, OLMo-2's fp32 weight: tigon.hf.registry)."""

    can_torch_compile = True  # one custom op

    def forward(self, hidden_states):
        return _tigon_kernels.rms_norm_forward(self, hidden_states)


class RotaryPosEmb(torch.nn.Module):
    """transformers' "rotary_pos_emb" (apply_rotary_pos_emb) on tigon.ops.apply_rope where the function is a
    rotate-half family's of tigon.hf.registry; any other keeps transformers' function."""

    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _tigon_kernels.rotary_forward(self, q, k, cos, sin, unsqueeze_dim)


class SwiGLUMLP(torch.nn.Module):
    """transformers' "SwiGLUMLP" layer name (a LlamaMLP layout) on Tigon's fused SwiGLU MLP."""

    def forward(self, x):
        return _tigon_kernels.mlp_forward(self, x, "swiglu")


class GeGLUMLP(torch.nn.Module):
    """transformers' "GeGLUMLP" layer name (a GemmaMLP layout) on Tigon's fused GeGLU MLP."""

    def forward(self, x):
        return _tigon_kernels.mlp_forward(self, x, "geglu")


class KeptActivation(torch.nn.Module):
    """transformers' activation layer names ("SiLU", "GeluTanh", ...): the module's own forward. Tigon fuses the
    activation with the gate product inside its MLP (tigon.patch), not alone."""

    can_torch_compile = True

    def forward(self, input):
        return type(self).forward(self, input)
