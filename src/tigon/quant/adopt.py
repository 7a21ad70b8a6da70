"""Adopting a quantized checkpoint: swap each supported quantized projection for a QuantLinear, and back.

`adopt(model)` repacks every projection a loader built from a supported format (`tigon.quant.importers`) into a
QuantLinear, keeping the module it replaced on the QuantLinear as `.original`; `release(model)` puts those modules
back, so the model's tensors and `state_dict` are exactly what they were. What is left on its own forward, with the
reason logged once a call on the "tigon" logger (and written into `skipped` when the caller passes a dict):
- the output projection (`lm_head`): its logits stay the checkpoint module's own;
- a format no importer reads, or a module an importer refuses (group sizes that do not divide K, bits other
  than 4, a kernel that repacked its tensors, ...);
- every quantized projection of a decoder layer whose projections mix layouts (int4 with fp8, ...).
"""

import re

import torch
from torch import nn

from tigon import _log
from tigon.ops.quantized_weight import QuantizedWeight

from .importers import IMPORTERS, format_of
from .module import QuantLinear
from .stack import drop_stacks

_LAYER = re.compile(r"^(.*?\.\d+)\.")  # "model.layers.3.self_attn.q_proj" -> "model.layers.3"


def _check_model(where, model):
    if not isinstance(model, nn.Module):
        raise TypeError(f"tigon.quant.{where}: model must be an nn.Module, got {type(model).__name__}")


def _is_output(model, name, module):
    get = getattr(model, "get_output_embeddings", None)
    try:
        out = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        out = None
    return module is out or name.rpartition(".")[2] == "lm_head"


def _scan(model, dtype):
    """(imported {name: (module, QuantizedWeight)}, skipped {name: reason}) over the quantized modules."""
    imported, skipped = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            continue
        fmt = format_of(module)
        if fmt is None:
            continue
        if _is_output(model, name, module):
            skipped[name] = f"the output projection stays the {fmt} module's own forward"
        elif fmt not in IMPORTERS:
            skipped[name] = f"format {fmt!r} ({type(module).__name__}) has no importer"
        else:
            try:
                imported[name] = (module, IMPORTERS[fmt](module, dtype=dtype))
            except ValueError as e:
                skipped[name] = str(e)
    kinds = {}
    for name, (_, qw) in imported.items():
        layer = _LAYER.match(name)
        kinds.setdefault(layer.group(1) if layer else name, set()).add(qw.kind)
    for name in list(imported):
        layer = _LAYER.match(name)
        found = kinds[layer.group(1) if layer else name]
        if len(found) > 1:
            skipped[name] = f"its layer mixes weight layouts {sorted(found)}"
            del imported[name]
    return imported, skipped


def _model_dtype(model):
    dtype = getattr(model, "dtype", None)
    return dtype if getattr(dtype, "is_floating_point", False) and dtype.itemsize >= 2 else None


def quantized_projections(model: nn.Module, *, dtype=None) -> dict[str, QuantizedWeight]:
    """{module name: QuantizedWeight} for each quantized projection `adopt` would swap (the same rules), repacked
    and not swapped. `dtype`: the activations' (default: the model's `dtype`, else each format's own)."""
    _check_model("quantized_projections", model)
    imported, _ = _scan(model, dtype or _model_dtype(model))
    return {name: qw for name, (_, qw) in imported.items()}


def adopt(model: nn.Module, *, dtype=None, skipped: dict | None = None) -> list[str]:
    """Swap each supported quantized projection of `model` for a QuantLinear (in place); the names swapped, in
    module order. Modules left alone, and why, go to the log and into `skipped` when given. Calling it again
    swaps nothing more; `release` undoes it."""
    _check_model("adopt", model)
    if skipped is not None and not isinstance(skipped, dict):
        raise TypeError(f"tigon.quant.adopt: skipped must be None or a dict, got {type(skipped).__name__}")
    imported, left = _scan(model, dtype or _model_dtype(model))
    for name, (module, qw) in imported.items():
        bias = getattr(module, "bias", None)
        swap = QuantLinear(qw, bias if isinstance(bias, torch.Tensor) else None).train(module.training)
        object.__setattr__(swap, "original", module)
        swap.layer_name = name
        model.set_submodule(name, swap)
    if left:
        lines = "\n".join(f"  {name}: {reason}" for name, reason in left.items())
        _log.get_logger().warning("tigon.quant.adopt: %d quantized module(s) left on their own forward:\n%s",
                                  len(left), lines)
        if skipped is not None:
            skipped.update(left)
    return list(imported)


def release(model: nn.Module) -> list[str]:
    """Put back every module `adopt` replaced (the same objects, tensors untouched); the names restored.
    QuantLinears made by `tigon.quant.quantize` have no original and stay. The decode step's stacked copies of
    the layers' weights (`tigon.quant.stack`) are dropped."""
    _check_model("release", model)
    back = [(name, m.original) for name, m in model.named_modules()
            if isinstance(m, QuantLinear) and m.original is not None]
    for name, original in back:
        model.set_submodule(name, original)
    drop_stacks(model)
    return [name for name, _ in back]
