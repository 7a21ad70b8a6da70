"""tigon.quantize: quantize a model's projections in place, round-to-nearest, into QuantLinear modules.

For checkpoints published in full precision: every nn.Linear of the model (exactly nn.Linear, so no quantized
subclass) is replaced by `QuantLinear.from_linear`, except the output projection and the names in `skip`. The
rules per format are `tigon.quant.module.quantize_rtn`'s. An already-quantized projection (a checkpoint's module
or a QuantLinear) is an error naming it, before anything is changed. With calibration batches, 4-bit weights are
first rescaled by activation-aware scales folded into the ops before them (`tigon.quant.calibrate`). Sibling
projections (q, k, v; gate, up) then share one tensor each, as row slices (`tigon.quant.stack.share_rows`).
"""

from torch import nn

from .calibrate import _skipped, search_scales
from .importers import format_of
from .module import QuantLinear, _check_rtn
from .stack import share_rows

FORMATS = ("int4", "fp8", "nf4")


def quantize(model: nn.Module, fmt: str, *, group_size: int = 128, symmetric: bool = True, calibration=None,
             skip=("lm_head",)) -> nn.Module:
    """Replace each nn.Linear of `model` by a QuantLinear holding its weight in `fmt` ("int4", "fp8" or "nf4"),
    in place; returns `model`. `group_size`: elements a scale covers along K (int4 / nf4; it must divide every
    quantized layer's in_features), for fp8 the side of the square scale blocks (0: one scale per output channel).
    `symmetric`: int4 without (True) or with (False) zero points. `skip`: module names (a full name or its tail
    after a dot, e.g. "lm_head", "mlp.gate") kept in full precision; the output projection is also kept unless
    `skip` is empty.

    `calibration` (int4 / nf4 only): None for plain round-to-nearest, or an iterable of batches (input-id tensors
    [batch, seq], or dicts of keyword arguments for `model(**batch)`) of a Llama, Mistral, Qwen2 or Qwen3 model. The
    model runs once over them (no grad, eval mode), and each group of projections sharing an input gets the
    per-channel scale mean|x| ** alpha whose round-to-nearest output error on sampled inputs is lowest (alpha = 0,
    plain round-to-nearest, among the candidates); the scales fold into the RMSNorm weight, up_proj or v_proj before
    them, so the full-precision function is unchanged, and then the rescaled weights are quantized
    (`tigon.quant.calibrate.search_scales`; a one-line summary goes to the "tigon" logger at INFO)."""
    where = "tigon.quantize"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"{where}: fmt must be one of {FORMATS}, got {fmt!r}")
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise TypeError(f"{where}: skip must be a tuple of module names, got {skip!r}")
    get = getattr(model, "get_output_embeddings", None)
    output = get() if callable(get) and skip else None
    targets = []
    for name, module in model.named_modules():
        fmt_found = "QuantLinear" if isinstance(module, QuantLinear) else format_of(module)
        if fmt_found is not None:
            raise ValueError(f"{where}: layer {name!r} is already quantized ({fmt_found}); quantize a model in "
                             "full precision")
        if type(module) is nn.Linear and module is not output and not _skipped(name, skip):
            targets.append((name, module))
    for name, module in targets:  # every check before the first swap: a refused call changes nothing
        try:
            _check_rtn(where, module.weight, fmt, group_size, symmetric, None)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} (layer {name!r})") from None
    if calibration is not None:  # checks its own input before it folds anything
        search_scales(model, calibration, fmt, group_size, symmetric, skip)
    for name, module in targets:
        swap = QuantLinear.from_linear(module, fmt, group_size, symmetric=symmetric)
        swap.layer_name = name
        model.set_submodule(name, swap.train(module.training))
    share_rows(model)  # q|k|v and gate|up as row slices of one tensor each: the decode step stacks them for free
    return model
