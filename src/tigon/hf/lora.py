"""PEFT LoRA projections of a patched model run through tigon.ops.lora_linear (one node per projection).

How a LoRA layer finds the op, whichever of tigon.patch(model) and get_peft_model runs first: patch() marks every
nn.Linear of the model (an instance attribute, recorded in the model's undo list), and PEFT's `lora.Linear.forward`
is replaced at class level by `lora_forward`, which takes the op for a layer whose base layer carries the mark and
PEFT's own forward for every other layer. PEFT wraps the very nn.Linear objects patch() saw, so a model patched
before get_peft_model is covered without a hook in its forward or a walk over its modules per step; a model of
another PEFT user in the same process (not patched) keeps PEFT's forward. The class attribute is PEFT's again once
the last marked model is unpatched. Why not an instance-level forward on each LoRA layer: the layers do not exist
yet when patch() runs first, and finding them later needs a hook in modules Tigon does not own or a module walk.

The op runs where it computes what PEFT's forward computes: adapters not disabled and not merged, no mixed-batch
`adapter_names`, vanilla LoRA (no DoRA or other variant, no lora_bias), a plain nn.Linear base (bitsandbytes'
4-bit base has no dense weight for the base GEMM: QLoRA keeps PEFT's forward), nn.Dropout or nn.Identity dropout,
no hooks that the op would skip. use_rslora is only a different scaling. Design and byte model: docs/ops/lora.md.
"""

import sys
import weakref

import torch
from torch import nn

from .. import ops

MARK = "_tigon_lora"
_LAYER_MODULE = "peft.tuners.lora.layer"
_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # models holding marks
_PEFT_FORWARD: dict = {}  # PEFT's class -> its own forward, while ours is installed


class LoraMark:
    """The mark patch() sets on a model's nn.Linear (as `_tigon_lora`): its PEFT LoRA wrapper may run the op."""

    __tigon__ = True

    def __reduce__(self):
        return LoraMark, ()


def _no_hooks(m) -> bool:
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _plain_weight(lin) -> bool:
    return type(lin) is nn.Linear and _no_hooks(lin) and type(lin.weight) in (nn.Parameter, torch.Tensor)


def plan(layer, x, args, kwargs):
    """(weight, bias, [A], [B], [scaling], [dropout p]) when lora_linear computes exactly what PEFT's forward of
    `layer` would for this call, else None."""
    base = layer.base_layer
    if args or kwargs or getattr(base, MARK, None) is None or not isinstance(x, torch.Tensor):
        return None
    if layer.disable_adapters or layer.merged or not _plain_weight(base) or not base.weight.is_floating_point():
        return None
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return None
    if x.dtype != base.weight.dtype and not torch.is_autocast_enabled(x.device.type):
        return None  # F.linear would refuse: let PEFT's forward raise its own error
    as_, bs, scales, ps = [], [], [], []
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        if name in layer.lora_variant or layer.lora_bias.get(name, False):
            return None
        a, b, drop = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
        if not (_plain_weight(a) and _plain_weight(b)) or a.bias is not None or b.bias is not None:
            return None
        if type(drop) is nn.Dropout:
            ps.append(float(drop.p) if drop.training else 0.0)
        elif type(drop) is nn.Identity:
            ps.append(0.0)
        else:
            return None
        if not getattr(layer, "cast_input_dtype_enabled", True) and a.weight.dtype != x.dtype:
            return None
        as_.append(a.weight)
        bs.append(b.weight)
        scales.append(float(layer.scaling[name]))
    if not as_ or any(p >= 1 for p in ps):
        return None
    return base.weight, base.bias, as_, bs, scales, ps


def lora_forward(self, x, *args, **kwargs):
    """PEFT lora.Linear's forward: through tigon.ops.lora_linear for a layer of a patched model, else PEFT's."""
    p = plan(self, x, args, kwargs)
    if p is None:
        return _PEFT_FORWARD[_layer_class()](self, x, *args, **kwargs)
    return ops.lora_linear(x, *p)


lora_forward.__tigon__ = True


def _layer_class():
    return sys.modules[_LAYER_MODULE].Linear


def _install() -> bool:
    """Our forward on PEFT's lora.Linear, when PEFT is imported (importing it here would cost seconds)."""
    if _LAYER_MODULE not in sys.modules:
        return False
    cls = _layer_class()
    if cls not in _PEFT_FORWARD:
        _PEFT_FORWARD[cls] = cls.__dict__["forward"]
        cls.forward = lora_forward
    return True


def _install_at_first_forward(module, args, kwargs):
    if not torch.compiler.is_compiling() and _install():
        _PENDING.pop(module, None).remove()


_PENDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # decoder -> its one-shot pre-hook handle


def lora_layers(model) -> list:
    """The PEFT LoRA Linear layers (exactly that class) inside `model`."""
    if _LAYER_MODULE not in sys.modules:
        return []
    cls = _layer_class()
    return [m for m in model.modules() if type(m) is cls]


def arm(hf, undo) -> tuple:
    """Mark hf's nn.Linear layers (recorded in `undo`) and put lora_forward on PEFT's class (now if PEFT is imported,
    else at the model's first forward). Returns (LoRA layers found now, Linear layers marked)."""
    layers = lora_layers(hf)
    adapters = {id(m) for layer in layers for d in (layer.lora_A, layer.lora_B) for m in d.values()}
    marked = 0
    for m in hf.modules():
        if type(m) is nn.Linear and id(m) not in adapters:
            if MARK not in m.__dict__:
                undo.append((m, MARK, None))
                m.__dict__[MARK] = LoraMark()
            marked += 1
    _LIVE.add(hf)
    if not _install():
        inner = getattr(hf, "base_model", hf)
        if inner not in _PENDING:
            _PENDING[inner] = inner.register_forward_pre_hook(_install_at_first_forward, with_kwargs=True)
    return len(layers), marked


def release(hf) -> None:
    """After unpatch(hf): PEFT's forward back on its class once no marked model is left."""
    _LIVE.discard(hf)
    handle = _PENDING.pop(getattr(hf, "base_model", hf), None)
    if handle is not None:
        handle.remove()
    if not _LIVE:
        for cls, forward in _PEFT_FORWARD.items():
            cls.forward = forward
        _PEFT_FORWARD.clear()
