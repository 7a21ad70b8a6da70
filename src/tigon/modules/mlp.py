"""Gated MLPs: LlamaMLP / GemmaMLP / Phi3MLP parameter layouts, with the activation and product fused.

Training with plain bias-free nn.Linear projections runs the whole MLP as one autograd node
(`ops.swiglu_mlp` / `ops.geglu_mlp`): it keeps x, gate and up for backward and recomputes the activation
product in the gradient pass, a quarter less activation memory than autograd over the three Linears. Anything
else (inference, biases, hooks on a projection, PEFT or quantized wrappers, DTensor weights,
saved-tensor hooks such as activation checkpointing's in eager)
calls the projections as they are (cuBLAS) around the fused GLU op with inplace_backward=True: dgate and dup
overwrite the fresh projection outputs, so the MLP's backward needs no memory beyond the projections' own. PEFT
LoRA projections of a patched model are such module calls, each one node of tigon.ops.lora_linear
(tigon.hf.lora), whose output is fresh as the GLU's in-place backward needs.
"""

from typing import Optional

import torch
from torch import nn

from .. import ops
from ..ops import _library
from ..ops.glu_mlp import geglu_mlp, swiglu_mlp
from ..ops.swiglu import geglu_packed, swiglu_packed

SWIGLU_ACTS = ("silu", "swish")
GEGLU_ACTS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")  # all 0.5 x (1 + tanh(...))


def _config_act(config):
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


_MISSING = object()


def member(module: nn.Module, name: str):
    """`getattr(module, name)` for a parameter, buffer or submodule, in nn.Module's order (an instance attribute,
    then parameters, buffers, submodules) but without `nn.Module.__getattr__`'s Python-level miss path: ~0.1 us
    a read against ~0.5-0.8. The decode wing's per-forward checks read ~40 of them a layer."""
    d = module.__dict__
    for store in (d, d["_parameters"], d["_buffers"], d["_modules"]):
        value = store.get(name, _MISSING)
        if value is not _MISSING:
            return value
    raise AttributeError(f"'{type(module).__name__}' object has no attribute '{name}'")


def plain_linear(lin) -> bool:
    """An nn.Linear itself (no PEFT / quantized wrapper), bias-free, hook-free, with a plain tensor weight (no
    DTensor): what a fused kernel may replace by reading `lin.weight` directly."""
    return (type(lin) is nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks
            and not lin._backward_hooks and not lin._backward_pre_hooks and member(lin, "bias") is None
            and type(member(lin, "weight")) in (nn.Parameter, torch.Tensor))


class _GatedMLP(nn.Module):
    _ACTS: tuple = ()

    def __init__(self, config=None, *, hidden_size: Optional[int] = None, intermediate_size: Optional[int] = None,
                 bias: Optional[bool] = None, fused_gate_up: bool = False, device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        if config is not None:
            act = _config_act(config)
            if act is not None and act not in self._ACTS:
                raise ValueError(f"{name}: config activation {act!r} is not one of {self._ACTS}")
            hidden_size = hidden_size if hidden_size is not None else config.hidden_size
            intermediate_size = intermediate_size if intermediate_size is not None else config.intermediate_size
            bias = bias if bias is not None else bool(getattr(config, "mlp_bias", False))
        if hidden_size is None or intermediate_size is None:
            raise ValueError(f"{name}: give a config or both hidden_size and intermediate_size")
        self.config = config
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.fused_gate_up = fused_gate_up
        kw = dict(bias=bool(bias), device=device, dtype=dtype)
        if fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, **kw)
        else:
            self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
            self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    _fused_mlp = None  # ops.swiglu_mlp / geglu_mlp

    def _glu(self, gate, up):
        raise NotImplementedError

    def _glu_packed(self, gate_up):
        raise NotImplementedError

    def _fused_weights(self, x):
        """The weights for the one-node MLP (ops.swiglu_mlp), or None where the three nn.Linear calls must
        run as they are: inference, biases, hooks on a projection, PEFT/quantized wrappers, tensor-parallel
        DTensors. Under autocast the cast nn.Linear would do is done here, once."""
        if not torch.is_grad_enabled():
            return None
        # Saved-tensor hooks are active under activation checkpointing (and offloading): a checkpointed layer
        # keeps only its input anyway, and its recompute stops at the last saved tensor, which for built-in
        # ops is packed before they run but for a custom autograd.Function only after its whole forward: the
        # one-node MLP would make every recompute redo the down projection (~13 ms a step at the 1.5B config).
        # Dynamo refuses to trace that query (marked skipped: a graph break, an error under fullgraph); a compiled
        # graph's checkpointing is the compiler's own (selective recompute of the traced graph), so the check is
        # an eager one.
        if not _library.tracing() and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return None
        projs = (self.gate_up_proj,) if self.fused_gate_up else (self.gate_proj, self.up_proj)
        projs += (self.down_proj,)
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return None
        if not all(plain_linear(lin) for lin in projs):
            return None
        weights = [lin.weight for lin in projs]
        if not (x.requires_grad or any(w.requires_grad for w in weights)):
            return None
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        if any(w.dtype != x.dtype or w.device != x.device for w in weights):
            return None
        if self.fused_gate_up:
            weights.insert(1, None)
        return x, weights

    def forward(self, x):
        fused = self._fused_weights(x)
        if fused is not None:
            x, weights = fused
            with torch.autocast(x.device.type, enabled=False):
                return type(self)._fused_mlp(x, *weights)
        if self.fused_gate_up:
            return self.down_proj(self._glu_packed(self.gate_up_proj(x)))
        return self.down_proj(self._glu(self.gate_proj(x), self.up_proj(x)))

    @classmethod
    def from_hf(cls, module):
        """The same MLP as the HF `module` (gate_proj/up_proj/down_proj, or Phi3's gate_up_proj/down_proj),
        sharing its nn.Linear submodules (so PEFT/LoRA wrappers around them keep working)."""
        config = getattr(module, "config", None)
        act = _config_act(config)
        if act is not None and act not in cls._ACTS:
            raise ValueError(f"{cls.__name__}.from_hf: config activation {act!r} is not one of {cls._ACTS}")
        fused = hasattr(module, "gate_up_proj")
        if not hasattr(module, "down_proj") or not (fused or (hasattr(module, "gate_proj")
                                                              and hasattr(module, "up_proj"))):
            raise TypeError(f"{cls.__name__}.from_hf: {type(module).__name__} has no gate/up/down projections")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.config = config
        new.fused_gate_up = fused
        if fused:
            new.gate_up_proj = module.gate_up_proj
        else:
            new.gate_proj, new.up_proj = module.gate_proj, module.up_proj
        new.down_proj = module.down_proj
        new.hidden_size, new.intermediate_size = _linear_shape(module.down_proj)[::-1]
        return new

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"
                + (", fused_gate_up=True" if self.fused_gate_up else ""))


def _linear_shape(lin):
    """(in_features, out_features) of an nn.Linear or a wrapper around one (PEFT's LoRA layers)."""
    return (getattr(lin, "in_features", None) or lin.weight.shape[1],
            getattr(lin, "out_features", None) or lin.weight.shape[0])


class SwiGLUMLP(_GatedMLP):
    """down_proj(silu(gate_proj(x)) * up_proj(x)): LlamaMLP's parameters and state_dict (Mistral, Qwen...),
    or Phi3MLP's with fused_gate_up=True (gate_up_proj [2I, H], gate first). Sizes and bias come from
    `config` (hidden_size, intermediate_size, mlp_bias if present) unless given; bias defaults to False."""

    _ACTS = SWIGLU_ACTS
    _fused_mlp = staticmethod(swiglu_mlp)

    def _glu(self, gate, up):
        return ops.swiglu(gate, up, inplace_backward=True)

    def _glu_packed(self, gate_up):
        return swiglu_packed(gate_up, inplace_backward=True)


class GeGLUMLP(_GatedMLP):
    """down_proj(gelu_tanh(gate_proj(x)) * up_proj(x)): GemmaMLP's parameters and state_dict; the same
    arguments as SwiGLUMLP."""

    _ACTS = GEGLU_ACTS
    _fused_mlp = staticmethod(geglu_mlp)

    def _glu(self, gate, up):
        return ops.geglu(gate, up, inplace_backward=True)

    def _glu_packed(self, gate_up):
        return geglu_packed(gate_up, inplace_backward=True)
