"""RMSNorm and LayerNorm modules: the Hugging Face / torch parameter layout, forward on tigon.ops."""

import numbers

import torch
from torch import nn

from .. import ops
from ..ops import reference

# HF norm classes that compute (x_normed * (1 + weight.float())).to(dtype) from zero-initialised weights.
_GEMMA_STYLE = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a `weight` [hidden_size] (state_dict-compatible with LlamaRMSNorm,
    GemmaRMSNorm and their copies).

    casting_mode "llama": weight * normed.to(x.dtype) (LlamaRMSNorm; output dtype promote(x, weight)),
    "gemma": (normed * (offset + weight)).to(x.dtype) in fp32, "none": fp32 math, output x.dtype. Gemma
    uses offset=1.0 with the weight initialised to zeros. elementwise_affine=False: no weight, the normed x
    in x.dtype (Gemma-4's `with_scale=False` norms; hidden_size may then be None: any size).
    forward(x, residual) returns (rms_norm(x + residual), x + residual) from one kernel.
    """

    def __init__(self, hidden_size, eps=1e-6, *, offset=0.0, casting_mode="llama", elementwise_affine=True,
                 device=None, dtype=None):
        super().__init__()
        if casting_mode not in reference.CASTING_MODES:
            raise ValueError(f"RMSNorm: casting_mode must be one of {reference.CASTING_MODES}, got {casting_mode!r}")
        if not elementwise_affine and offset:
            raise ValueError(f"RMSNorm: offset={offset} scales a weight; elementwise_affine=False has none")
        if hidden_size is None and elementwise_affine:
            raise ValueError("RMSNorm: hidden_size is needed for the weight (None only with elementwise_affine=False)")
        self._hidden_size = None if hidden_size is None else int(hidden_size)
        if elementwise_affine:
            init = torch.zeros if offset else torch.ones
            self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.eps = eps
        self.offset = float(offset)
        self.casting_mode = casting_mode

    # LlamaRMSNorm calls it variance_epsilon, GemmaRMSNorm eps: code written for either keeps working.
    @property
    def variance_epsilon(self):
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value):
        self.eps = value

    @property
    def hidden_size(self):
        return self._hidden_size if self.weight is None else self.weight.shape[0]

    def forward(self, x, residual=None):
        kw = dict(offset=self.offset, casting_mode=self.casting_mode)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, **kw)
        return ops.add_rms_norm(x, residual, self.weight, self.eps, **kw)

    @classmethod
    def from_hf(cls, module, **kwargs):
        """An RMSNorm computing what the HF norm `module` computes, sharing its `weight` Parameter.

        The eps comes from `variance_epsilon` or `eps`; offset and casting_mode default to Gemma's (1.0,
        "gemma") for GemmaRMSNorm/Gemma2RMSNorm/Gemma3RMSNorm and Llama's (0.0, "llama") otherwise, and any
        keyword given overrides them (the patcher passes its table's row). A scale-free norm
        (`with_scale=False`, Gemma-4's v_norm, which keeps no size) becomes a weightless one of any size that
        normalizes in fp32 to x.dtype, as HF's does (casting_mode "gemma", no offset, whatever the row says).
        """
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if eps is not None and weight is None and not getattr(module, "with_scale", True):
            kwargs.update(offset=0.0, casting_mode="gemma")
            return cls(None, eps, elementwise_affine=False, **kwargs)
        if eps is None or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise TypeError(
                f"RMSNorm.from_hf: {type(module).__name__} needs a 1-D `weight` Parameter (or with_scale=False) "
                "and an `eps` or `variance_epsilon` attribute"
            )
        gemma = type(module).__name__ in _GEMMA_STYLE
        kwargs.setdefault("offset", 1.0 if gemma else 0.0)
        kwargs.setdefault("casting_mode", "gemma" if gemma else "llama")
        new = cls(weight.shape[0], eps, device="meta", **kwargs)
        new.weight = weight
        return new

    def extra_repr(self):
        s = f"{self.hidden_size}, eps={self.eps}" + ("" if self.weight is not None else ", elementwise_affine=False")
        if self.offset:
            s += f", offset={self.offset}"
        return s + f", casting_mode={self.casting_mode!r}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with torch.nn.LayerNorm's parameters and state_dict (weight, bias)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"LayerNorm: only the last dim is normalized, got normalized_shape {normalized_shape}")
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def reset_parameters(self):
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    @classmethod
    def from_hf(cls, module):
        """A LayerNorm computing what `module` (torch.nn.LayerNorm or alike) does, sharing its Parameters."""
        shape = tuple(getattr(module, "normalized_shape", ()))
        if len(shape) != 1 or not hasattr(module, "eps"):
            raise TypeError(
                f"LayerNorm.from_hf: {type(module).__name__} needs a 1-D normalized_shape and an `eps`"
            )
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        new = cls(shape, module.eps, elementwise_affine=weight is not None, bias=bias is not None, device="meta")
        new.weight, new.bias = weight, bias
        return new

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
