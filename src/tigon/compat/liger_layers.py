"""Liger-Kernel 0.8.5's layer classes that have no Tigon kernel of their own (DyT, softmax, sparsemax, ReLU^2,
PolyNorm, multi-token attention, the Llama 4 RoPE functions) in plain PyTorch, and those built from Tigon's ops
(the SwiGLU MLP variants, the modulated RMSNorm, the MuseGlimmer norms, the experts). Same constructor and forward
signatures, parameter names and initialisation as Liger's; plain-PyTorch ones compute in fp32 and cast once to the
input's dtype, as Liger's kernels do. LigerMHC has no Tigon counterpart: constructing it raises NotImplementedError.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.utils import _pair

from .. import ops
from ..modules import SwiGLUMLP
from .liger_modules import LigerRMSNorm, LigerSwiGLUMLP, _check_act


class LigerDyT(nn.Module):
    """Dynamic tanh: gamma * tanh(alpha * x) + beta (beta=False: no shift). x [..., hidden_size]."""

    def __init__(self, hidden_size, beta=True, init_alpha=0.5):
        super().__init__()
        self.hidden_size, self.init_alpha = hidden_size, init_alpha
        self.alpha = nn.Parameter(torch.ones(1) * init_alpha)
        self.gamma = nn.Parameter(torch.ones(hidden_size))
        self.beta = nn.Parameter(torch.zeros(hidden_size)) if beta else None

    def forward(self, x):
        y = torch.tanh(self.alpha.float() * x.float()) * self.gamma.float()
        if self.beta is not None:
            y = y + self.beta.float()
        return y.to(x.dtype)

    def extra_repr(self):
        return f"{self.hidden_size}, init_alpha={self.init_alpha}, beta={self.beta}"


class LigerSoftmax(nn.Module):
    """softmax over the last dimension."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor):
        return torch.softmax(x.float(), dim=-1).to(x.dtype)


def sparsemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sparsemax (Martins & Astudillo, 2016): the Euclidean projection of x onto the simplex along dim. Autograd
    through the threshold gives the exact Jacobian diag(s) - s s^T / |support|."""
    z = x.float().transpose(dim, -1)
    z_sorted = z.sort(dim=-1, descending=True).values
    k = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cumsum = z_sorted.cumsum(-1)
    support = (1 + k * z_sorted > cumsum).sum(-1, keepdim=True)
    tau = (cumsum.gather(-1, support - 1) - 1) / support.to(z.dtype)
    return torch.clamp(z - tau, min=0).transpose(dim, -1).to(x.dtype)


class LigerSparsemax(nn.Module):
    """sparsemax along dim."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparsemax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LigerReLUSquared(nn.Module):
    """relu(x) ** 2 (Nemotron's activation)."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x.float()).square().to(x.dtype)


def _rms(u, eps):
    return u * torch.rsqrt(u.square().mean(-1, keepdim=True) + eps)


class LigerPolyNorm(nn.Module):
    """PolyNorm: w0 norm(x^3) + w1 norm(x^2) + w2 norm(x) + b, norm(u) = u / sqrt(mean(u^2) + eps) over the last
    dimension; weight (1/3, 1/3, 1/3), bias 1, as PolyCom and Liger initialise them."""

    def __init__(self, eps=1e-6, in_place=True):
        super().__init__()
        self.weight = nn.Parameter(torch.full((3,), 1.0 / 3.0))
        self.bias = nn.Parameter(torch.tensor(1.0))
        self.variance_epsilon, self.in_place = eps, in_place

    def forward(self, hidden_states):
        x, w, eps = hidden_states.float(), self.weight.float(), self.variance_epsilon
        y = w[0] * _rms(x * x * x, eps) + w[1] * _rms(x * x, eps) + w[2] * _rms(x, eps) + self.bias.float()
        return y.to(hidden_states.dtype)

    def extra_repr(self):
        return f"weight_shape={tuple(self.weight.shape)}, eps={self.variance_epsilon}, in_place={self.in_place}"


class LigerModulatedRMSNorm(LigerRMSNorm):
    """(1 + scale) * rms_norm(x) + shift, the norm on tigon.ops.rms_norm (eps, offset, casting_mode as
    LigerRMSNorm); scale and shift broadcast against x. forward(hidden_states, scale, shift=None)."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=True,
                 elementwise_affine=True):
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place,
                         elementwise_affine=elementwise_affine)

    def forward(self, hidden_states, scale, shift=None):
        y = super().forward(hidden_states).float() * (1 + scale.float())
        if shift is not None:
            y = y + shift.float()
        return y.to(hidden_states.dtype)


class _ScaleFreeRMSNorm(LigerRMSNorm):
    """with_scale=False: x / sqrt(mean(x^2) + eps) in fp32 with no weight (HF's with_scale=False forward)."""

    def __init__(self, dim=None, eps=1e-6, offset=0.0, casting_mode="gemma", init_fn="ones", in_place=False,
                 with_scale=True):
        super().__init__(dim, eps, offset, casting_mode, init_fn, in_place, elementwise_affine=with_scale)
        self.with_scale = with_scale

    def forward(self, hidden_states):
        if self.with_scale:
            return super().forward(hidden_states)
        return _rms(hidden_states.float(), self.eps).to(hidden_states.dtype)


class LigerRMSNormForMuseGlimmer(_ScaleFreeRMSNorm):
    """MuseGlimmer's RMSNorm: weight applied directly, gemma casting; with_scale=False has no weight."""


class LigerRMSNormForMuseGlimmerTextCentered(LigerRMSNorm):
    """MuseGlimmer's text-centered RMSNorm: (1 + weight) with zero-initialised weight, gemma casting."""

    def __init__(self, hidden_size, eps=1e-6, offset=1.0, casting_mode="gemma", init_fn="zeros", in_place=False,
                 row_mode=None):
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, row_mode)


class LigerMLP(LigerSwiGLUMLP):
    """liger_kernel.transformers.LigerMLP(config): LlamaMLP's layout on Tigon's SwiGLU MLP."""

    def __init__(self, config):
        super().__init__(config)


class LigerSwiGLUMLPForMuseGlimmer(SwiGLUMLP):
    """MuseGlimmer's MLP (its config names no hidden_act; the activation is SiLU) on Tigon's SwiGLU MLP."""

    def __init__(self, config):
        super().__init__(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, bias=False)
        self.config = config


class LigerFalconH1SwiGLUMLP(nn.Module):
    """Falcon-H1's MLP: down_proj(swiglu(gate_proj(x) * gate_mult, up_proj(x))) * down_mult, with
    (gate_mult, down_mult) = config.mlp_multipliers and bias = config.mlp_bias; tigon.ops.swiglu."""

    def __init__(self, config):
        super().__init__()
        self.config, self.hidden_size, self.intermediate_size = config, config.hidden_size, config.intermediate_size
        bias = self._bias(config)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        _check_act(type(self).__name__, config)
        gate_multiplier, down_multiplier = config.mlp_multipliers
        self.gate_multiplier, self.down_multiplier = float(gate_multiplier), float(down_multiplier)

    @staticmethod
    def _bias(config):
        return getattr(config, "mlp_bias", False)

    def forward(self, x):
        h = ops.swiglu(self.gate_proj(x) * self.gate_multiplier, self.up_proj(x))
        return self.down_proj(h) * self.down_multiplier


class LigerFalconH1MLP(LigerFalconH1SwiGLUMLP):
    """Falcon-H1's MLP without bias (Liger's LigerMLPFunction variant); config.mlp_bias=True is a ValueError."""

    @staticmethod
    def _bias(config):
        if getattr(config, "mlp_bias", False):
            raise ValueError("LigerFalconH1MLP: config.mlp_bias=True is not supported (use LigerFalconH1SwiGLUMLP)")
        return False


class LigerExperts(nn.Module):
    """transformers v5's fused experts (Mixtral, Qwen3-MoE, DeepSeek): gate_up_proj [E, 2I, H] (gate rows first),
    down_proj [E, H, I]. forward(hidden_states [..., H], top_k_index [..., K], top_k_weights [..., K]) -> [..., H]:
    sum_k w_k * down_e(swiglu(gate_e x, up_e x)), one expert at a time on tigon.ops.swiglu."""

    def __init__(self, config):
        super().__init__()
        for name in ("num_experts", "num_local_experts", "n_routed_experts"):
            if hasattr(config, name):
                self.num_experts = getattr(config, name)
                break
        self.intermediate_dim = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.hidden_dim = config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        _check_act("LigerExperts", config)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states.reshape(-1, self.hidden_dim)
        index = top_k_index.reshape(x.shape[0], -1)
        weights = top_k_weights.reshape(x.shape[0], -1)
        out = torch.zeros_like(x)
        for e in index.unique().tolist():  # one host sync: which experts got tokens
            rows, slot = torch.nonzero(index == e, as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(ops.swiglu(gate, up), self.down_proj[e]) * weights[rows, slot, None].to(x.dtype)
            out = out.index_add(0, rows, y.to(out.dtype))
        return out.view(hidden_states.shape)


def _causal_fill(t, value):
    """t [..., L, L] with the entries above the diagonal (key after query) set to value."""
    L = t.shape[-1]
    future = torch.ones(L, L, dtype=torch.bool, device=t.device).triu(1)
    return t.masked_fill(future, value)


class LigerMultiTokenAttention(nn.Module):
    """Multi-token attention (arXiv:2504.00927): causal_zero(conv2d(softmax(causal_mask(scores)))) over
    scores [B, C_in, L, L]; sparse=True takes sparsemax for softmax. The masked scores are -1e9 (Liger's value),
    not -inf. The convolution must keep L x L (stride 1, padding = dilation * (kernel - 1) / 2)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 dilation: int = 1, groups: int = 1, bias: bool = True, sparse: bool = False):
        super().__init__()
        self.in_channels, self.out_channels, self.groups, self.sparse = in_channels, out_channels, groups, sparse
        self.kernel_size, self.stride = _pair(kernel_size), _pair(stride)
        self.padding, self.dilation = _pair(padding), _pair(dilation)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *self.kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        masked = _causal_fill(scores, -1e9)
        probs = sparsemax(masked, -1) if self.sparse else torch.softmax(masked.float(), -1).to(scores.dtype)
        out = F.conv2d(probs, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        if out.shape[-2:] != scores.shape[-2:]:
            raise ValueError(f"LigerMultiTokenAttention: the convolution maps [{scores.shape[-2]}, "
                             f"{scores.shape[-1]}] scores to {list(out.shape[-2:])}; it must keep them square "
                             "(stride 1, 'same' padding)")
        return _causal_fill(out, 0.0)


def _complex_rope(x, freqs):
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)


def liger_llama4_text_rotary_pos_emb(xq, xk, freqs_cis):
    """Llama 4's text RoPE (HF's apply_rotary_emb): xq, xk [B, S, heads, D] as D/2 complex pairs times
    freqs_cis [B, S, D/2] complex. Returns the rotated (xq, xk) in their dtypes."""
    freqs = freqs_cis[:, :, None, :]
    return _complex_rope(xq, freqs), _complex_rope(xk, freqs)


def liger_llama4_vision_rotary_pos_emb(query, key, freqs_ci):
    """Llama 4's vision RoPE (HF's vision_apply_rotary_emb): query, key [B, S, heads, D]; freqs_ci broadcast over
    the batch and heads (complex, or real where a dtype cast dropped its imaginary part, as HF computes it)."""
    ndim = query.dim()
    shape = [d if i in (1, ndim - 1) else 1 for i, d in enumerate((*query.shape[:-1], query.shape[-1] // 2))]
    freqs = freqs_ci.reshape(shape).to(query.device)
    return _complex_rope(query, freqs), _complex_rope(key, freqs)


class LigerMHC(nn.Module):
    """Manifold-constrained hyper-connections: not in Tigon. Constructing it raises NotImplementedError."""

    def __init__(self, layer, *, hc, c, tmax=20, rms_eps=1e-6, pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0,
                 phi_dtype=torch.float16, allow_fp32=False):
        raise NotImplementedError("LigerMHC: Tigon has no manifold-constrained hyper-connections; use "
                                  "liger_kernel.transformers.LigerMHC from the liger-kernel package")

    def forward(self, x):
        raise NotImplementedError("LigerMHC: Tigon has no manifold-constrained hyper-connections")


__all__ = ["LigerDyT", "LigerExperts", "LigerFalconH1MLP", "LigerFalconH1SwiGLUMLP", "LigerMHC", "LigerMLP",
           "LigerModulatedRMSNorm", "LigerMultiTokenAttention", "LigerPolyNorm", "LigerRMSNormForMuseGlimmer",
           "LigerRMSNormForMuseGlimmerTextCentered", "LigerReLUSquared", "LigerSoftmax", "LigerSparsemax",
           "LigerSwiGLUMLPForMuseGlimmer", "liger_llama4_text_rotary_pos_emb", "liger_llama4_vision_rotary_pos_emb"]
