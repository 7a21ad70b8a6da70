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
`adapter_names`, vanilla LoRA (no DoRA or other variant, no lora_bias), a plain nn.Linear base, nn.Dropout or
nn.Identity dropout, no hooks that the op would skip. use_rslora is only a different scaling.

QLoRA: PEFT's bitsandbytes layers (`lora.bnb.Linear4bit`, `lora.bnb.Linear8bitLt`) get `qlora_forward` the same
way (their bitsandbytes base layers are marked too): the base layer runs as a module (bitsandbytes dequantizes,
unchanged), then tigon.ops.lora_add adds the adapters into a new output, under the same conditions, and not under
an autocast dtype other than x's (PEFT would run the adapters in that dtype). Design and byte model:
docs/ops/lora.md.
"""

import functools
import sys
import weakref

import torch
from torch import nn

from .. import ops
from ..quant.module import QuantLinear

MARK = "_tigon_lora"
_LAYER_MODULE = "peft.tuners.lora.layer"
_BNB_LAYER_MODULE = "peft.tuners.lora.bnb"  # imported by get_peft_model for a quantized model, not by `import peft`
_BNB_NAMES = ("Linear4bit", "Linear8bitLt")  # bitsandbytes.nn's layers and PEFT's LoRA layers around them
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


def _adapters(layer, x):
    """([A], [B], [scaling], [dropout p]) of `layer`'s active adapters when each is vanilla LoRA the op computes
    exactly, else None."""
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
    return as_, bs, scales, ps


def _global_hooks() -> bool:
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def plan(layer, x, args, kwargs):
    """(weight, bias, [A], [B], [scaling], [dropout p]) when lora_linear computes exactly what PEFT's forward of
    `layer` would for this call, else None."""
    base = layer.base_layer
    if args or kwargs or getattr(base, MARK, None) is None or not isinstance(x, torch.Tensor):
        return None
    if layer.disable_adapters or layer.merged or not _plain_weight(base) or not base.weight.is_floating_point():
        return None
    if _global_hooks():
        return None
    if x.dtype != base.weight.dtype and not torch.is_autocast_enabled(x.device.type):
        return None  # F.linear would refuse: let PEFT's forward raise its own error
    adapters = _adapters(layer, x)
    return None if adapters is None else (base.weight, base.bias, *adapters)


def plan_qlora(layer, x, args, kwargs):
    """([A], [B], [scaling], [dropout p]) when base_layer(x) followed by lora_add computes what PEFT's forward of
    the bitsandbytes LoRA `layer` would for this call, else None. The base layer runs as a module, so hooks on it
    run as they would under PEFT's forward; the adapter modules are not called, so they must have none. A base
    layer that `tigon.quant.adopt` swapped for a QuantLinear is judged by the module it holds (`.original`)."""
    base = layer.base_layer
    if isinstance(base, QuantLinear) and base.original is not None:
        base = base.original
    if args or kwargs or getattr(base, MARK, None) is None or not isinstance(x, torch.Tensor):
        return None
    if layer.disable_adapters or layer.merged or type(base) not in _classes("bitsandbytes.nn") or _global_hooks():
        return None
    dev = x.device.type
    if not x.is_floating_point() or (torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != x.dtype):
        return None  # under autocast PEFT runs the adapters in the autocast dtype, the op in x's
    return _adapters(layer, x)


def lora_forward(self, x, *args, **kwargs):
    """PEFT lora.Linear's forward: through tigon.ops.lora_linear for a layer of a patched model, else PEFT's."""
    p = plan(self, x, args, kwargs)
    if p is None:
        return _PEFT_FORWARD[_layer_class()](self, x, *args, **kwargs)
    return ops.lora_linear(x, *p)


lora_forward.__tigon__ = True


def qlora_forward(self, x, *args, **kwargs):
    """PEFT's bitsandbytes LoRA layer's forward: bitsandbytes' base layer, then tigon.ops.lora_add, for a layer of a
    patched model, else PEFT's."""
    p = plan_qlora(self, x, args, kwargs)
    if p is not None:
        base_out = self.base_layer(x)
        # bitsandbytes returns x's dtype and leading shape (Linear4bit casts back to it); anything else: PEFT's
        # forward, which runs the base layer again (no randomness in it) and casts as it does
        if isinstance(base_out, torch.Tensor) and base_out.dtype == x.dtype and base_out.shape[:-1] == x.shape[:-1]:
            return ops.lora_add(base_out, x, *p)
    return _peft_forward(type(self))(self, x, *args, **kwargs)


qlora_forward.__tigon__ = True


def _peft_forward(cls):
    for c in cls.__mro__:
        if c in _PEFT_FORWARD:
            return _PEFT_FORWARD[c]
    return cls.forward


def _layer_class():
    return sys.modules[_LAYER_MODULE].Linear


def _classes(module) -> tuple:
    """`module`'s Linear4bit and Linear8bitLt classes, those it defines, when it is imported (else none)."""
    m = sys.modules.get(module)
    return tuple(getattr(m, n) for n in _BNB_NAMES if hasattr(m, n)) if m is not None else ()


def _put(cls, forward):
    if cls not in _PEFT_FORWARD:
        _PEFT_FORWARD[cls] = cls.__dict__["forward"]
        cls.forward = forward


def _install(qlora=False) -> bool:
    """Our forward on PEFT's lora.Linear (and, for a model with bitsandbytes layers, on PEFT's bnb LoRA layers),
    those of them imported (importing PEFT here would cost seconds). True when nothing is left to install."""
    done = _LAYER_MODULE in sys.modules
    if done:
        _put(_layer_class(), lora_forward)
    if qlora:
        classes = _classes(_BNB_LAYER_MODULE)
        for cls in classes:
            _put(cls, qlora_forward)
        done = done and bool(classes)
    return done


def _install_at_first_forward(module, args, kwargs, qlora=False):
    if not torch.compiler.is_compiling() and _install(qlora):
        handle = _PENDING.pop(module, None)
        if handle is not None:
            handle.remove()
        else:  # a copy of a patched model: the hook came with it, the handle did not
            for key, hook in list(module._forward_pre_hooks.items()):
                if getattr(hook, "func", None) is _install_at_first_forward:
                    del module._forward_pre_hooks[key]
                    module._forward_pre_hooks_with_kwargs.pop(key, None)


_PENDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # decoder -> its one-shot pre-hook handle


def lora_layers(model) -> list:
    """The PEFT LoRA Linear layers inside `model`: exactly lora.Linear, or PEFT's bitsandbytes LoRA layers."""
    classes = _classes(_BNB_LAYER_MODULE) + ((_layer_class(),) if _LAYER_MODULE in sys.modules else ())
    return [m for m in model.modules() if type(m) in classes] if classes else []


def arm(hf, undo) -> tuple:
    """Mark hf's nn.Linear and bitsandbytes Linear4bit / Linear8bitLt layers (recorded in `undo`) and put
    lora_forward / qlora_forward on PEFT's classes (now if PEFT has them imported, else at the model's first
    forward). Returns (LoRA layers found now, layers marked)."""
    layers = lora_layers(hf)
    adapters = {id(m) for layer in layers for d in (layer.lora_A, layer.lora_B) for m in d.values()}
    bnb = _classes("bitsandbytes.nn")  # a model holding bitsandbytes layers has imported bitsandbytes
    marked = qlora = 0
    for m in hf.modules():
        if (type(m) is nn.Linear or type(m) in bnb) and id(m) not in adapters:
            if MARK not in m.__dict__:
                undo.append((m, MARK, None))
                m.__dict__[MARK] = LoraMark()
            marked += 1
            qlora += type(m) in bnb
    _LIVE.add(hf)
    if not _install(bool(qlora)):
        inner = getattr(hf, "base_model", hf)
        if inner not in _PENDING:
            hook = functools.partial(_install_at_first_forward, qlora=bool(qlora))
            _PENDING[inner] = inner.register_forward_pre_hook(hook, with_kwargs=True)
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
