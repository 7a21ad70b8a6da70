"""Tigon: fused Triton kernels for Hugging Face LLM training and inference.

    import tigon
    tigon.patch(model)      # swap in the fused pieces; tigon.unpatch(model) restores
    tigon.generate(model, input_ids, max_new_tokens=64)   # ring-buffer KV cache, CUDA-graph decoding
    tigon.quantize(model, "int4", group_size=128)          # 4- or 8-bit weights (tigon.quant), in place

Importing tigon is cheap: no CUDA initialisation, no kernel compilation, no transformers. Submodules load on
first use. Layers, lowest first (each imports only those below it; tests/test_layering.py reads the imports):
ops (torch + Triton) < memory, modules, optim, quant (4- and 8-bit weights) < hf < compat, decode (the inference
wing and its Prometheus metrics) < this package (tigon.patch / tigon.unpatch) < cli (the `tigon` command and its
demo).

`tigon.patch(model, ...)` is `tigon.hf.patching.patch_hf_model` (same arguments, report and errors), and on a
model instance it also installs the fused decoder-layer step (`tigon.decode.layer_step.install`) on the layers
that run Tigon's decoder forward, so HF's own `model.generate(ids, past_key_values=RollingKVCache(...))` on the
"tigon" attention decodes with it. `patch(model, cuda_graph=True)` also installs `tigon.decode.hf_graph` (that
generate's decode steps replay a CUDA graph) and, where `attention` is left "auto", switches the model to the
"tigon" attention, which the graph needs. On an instance holding quantized projections (GPTQ, AWQ,
compressed-tensors, FP8, bitsandbytes NF4) it swaps them for QuantLinear modules (`tigon.quant.adopt`), whose
decode layers then run the fused quantized step. `unpatch(model)` undoes all of it. Both import tigon.hf and
tigon.decode (which need transformers) when called, and their first access reads the doc and signature of the
hf patcher they run.
"""

import importlib
from typing import TYPE_CHECKING, Literal

from . import _log

if TYPE_CHECKING:
    import torch

    from .hf.patching import PatchReport

__version__ = "0.1.0"
__all__ = ["ops", "modules", "memory", "optim", "quant", "hf", "decode", "patch", "unpatch", "generate",
           "DecodeSettings", "quantize", "__version__"]

_ADOPTED = "_tigon_quant_adopted"  # on the transformers model: the projections tigon.patch swapped (names)


def _set_up_for_kbit_training(hf) -> bool:
    """Every parameter outside LoRA adapters frozen (what peft.prepare_model_for_kbit_training leaves), and no
    adapters yet or some trainable: a QLoRA run is being set up, not an inference."""
    adapters, frozen = False, True
    for name, p in hf.named_parameters():
        if "lora_" in name:
            adapters = True
            if p.requires_grad:
                return True
        elif p.requires_grad:
            frozen = False
    return frozen and not adapters


def _qlora_base(hf) -> bool:
    """A bitsandbytes 4-bit model with no LoRA adapters yet: NF4 is the base QLoRA trains on, and get_peft_model
    must see bitsandbytes' modules. Serving such a model fused takes quantized=True."""
    with _log.requires_extra("tigon.patch"):
        from .quant.importers import format_of
    if any("lora_" in name for name, _ in hf.named_parameters()):
        return False
    return any(format_of(m) == "bnb4" for m in hf.modules())


def _adopt(model, report, quantized) -> None:
    """tigon.quant.adopt on the transformers model under `model`, its swaps and skips written into `report`."""
    with _log.requires_extra("tigon.patch"):  # tigon.hf imports transformers
        from .hf.unwrap import unwrap_model
        from .quant import adopt
        from .quant.importers import format_of
    hf = unwrap_model(model)
    if quantized == "auto" and (_set_up_for_kbit_training(hf) or _qlora_base(hf)):
        if any(format_of(m) is not None for m in hf.modules()):
            report.skip("quantized projections", "the model is set up for k-bit training (a bitsandbytes 4-bit "
                        "base with no adapters yet, or every base parameter frozen with LoRA adapters trainable or "
                        "not added yet): the checkpoint's modules stay, for get_peft_model and the training step; "
                        "quantized=True adopts them anyway")
        return
    skipped = {}
    swapped = adopt(hf, skipped=skipped)
    if swapped:
        report.add("QuantLinear (quantized projections: tigon.ops.quant_linear)", len(swapped))
        hf.__dict__.setdefault(_ADOPTED, []).extend(swapped)
    for name, reason in skipped.items():
        report.skip(f"quantized {name}", reason)


def _patch(model: "torch.nn.Module | None" = None, *, cuda_graph: bool = False,
           quantized: bool | Literal["auto"] = False, **options) -> "PatchReport":
    with _log.requires_extra("tigon.patch"):  # tigon.hf and tigon.decode import transformers
        from .decode import hf_graph, layer_step
        from .hf.patching import patch_hf_model
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"tigon.patch: cuda_graph must be True or False, got {type(cuda_graph).__name__} "
                        f"{cuda_graph!r}")
    if not isinstance(quantized, bool) and quantized != "auto":
        raise TypeError(f"tigon.patch: quantized must be True, False or 'auto', got {type(quantized).__name__} "
                        f"{quantized!r}")
    if quantized is True and model is None:
        raise ValueError("tigon.patch: quantized=True swaps a model instance's quantized projections: "
                         "tigon.patch(model, quantized=True)")
    if cuda_graph and model is None:
        raise ValueError("tigon.patch: cuda_graph=True puts the CUDA-graph decode step on a model instance: "
                         "tigon.patch(model, cuda_graph=True)")
    if cuda_graph:
        if options.get("attention", "auto") is False:
            raise ValueError("tigon.patch: cuda_graph=True needs the \"tigon\" attention (its decode step reads "
                             "the ring by device positions); pass attention=True or leave it 'auto'")
        options["attention"] = True
    graphed = model is not None and hf_graph.installed(model)
    if graphed:  # the HF patch sees the model's own forward, and the graph step stays outermost
        hf_graph.uninstall(model)
    report = patch_hf_model(model, **options)
    if model is not None:
        if quantized:  # after the HF patch: the LoRA marks sit on the checkpoint's modules, which adopt keeps
            _adopt(model, report, quantized)
        layer_step.install(model)
    if cuda_graph or graphed:
        hf_graph.install(model)
    return report


# what tigon.patch's doc adds to patch_hf_model's
_PATCH_DOC = """

    cuda_graph=True (instance only): HF's `model.generate(ids, past_key_values=RollingKVCache(...))` captures
    its decode step in a CUDA graph on the second decode step and replays it after (`tigon.decode.hf_graph`);
    it implies attention=True ("auto" becomes True; False is a ValueError). cuda_graph=False leaves an
    installed graph step in place (`tigon.unpatch` or `tigon.decode.hf_graph.uninstall` takes it off).
    quantized (instance only) swaps the model's quantized projections (GPTQ, AWQ, compressed-tensors, FP8,
    bitsandbytes NF4) for `tigon.quant.QuantLinear` modules (`tigon.quant.adopt`; what it leaves, and why, is in
    the report's skipped list): quant_linear's kernels in inference, the fused quantized decode step; where a
    gradient may be wanted they run the checkpoint's module, so training is unchanged. False (the default)
    leaves them: measured on the H100, the quantized kernels reach 5-71% of their read bound and an int4 decode
    layer takes about the bf16 layer's time (benchmarks/results/h100.md), so adopting is an opt-in until they
    measure faster than the checkpoint's own kernels. "auto" adopts except on a model set up for k-bit
    training (every base parameter frozen, as peft.prepare_model_for_kbit_training leaves it, and LoRA adapters
    trainable or not added yet; or a
    bitsandbytes 4-bit model with no adapters, the QLoRA base: get_peft_model must still see the checkpoint's
    modules, and the repacked copy would only cost memory; True serves such a model fused); True always; False
    never. unpatch puts the checkpoint's modules back."""


def _unpatch(model: "torch.nn.Module | None" = None, **options) -> None:
    with _log.requires_extra("tigon.unpatch"):  # tigon.hf and tigon.decode import transformers
        from .decode import hf_graph, layer_step
        from .hf.patching import unpatch_hf_model
        from .hf.unwrap import unwrap_model
        from .quant import release
    if model is not None and not options:
        unwrap_model(model, "tigon.unpatch")  # the argument check, before anything changes
        hf_graph.uninstall(model)  # first: the forward under it is the HF patch's, which unpatch restores
    unpatch_hf_model(model, **options)  # checks the arguments first
    if model is not None:
        layer_step.uninstall(model)
        hf = unwrap_model(model, "tigon.unpatch")
        if hf.__dict__.pop(_ADOPTED, None):
            release(hf)  # the checkpoint's modules back (and the decode step's stacked weights dropped)


_patch.__name__ = _patch.__qualname__ = "patch"
_unpatch.__name__ = _unpatch.__qualname__ = "unpatch"


def _publish(name: str, patching):
    """tigon.patch or tigon.unpatch on first access: the doc (and patch's signature) of the hf patcher it runs,
    read from `patching` (tigon.hf.patching, which needs transformers, so `import tigon` cannot), then stored in
    this module, a plain attribute from then on."""
    import functools
    import inspect

    fn, hf_fn = (_patch, patching.patch_hf_model) if name == "patch" else (_unpatch, patching.unpatch_hf_model)
    functools.update_wrapper(fn, hf_fn, assigned=("__doc__",))
    if fn is _patch:
        fn.__doc__ = (hf_fn.__doc__ or "") + _PATCH_DOC
        hf_sig = inspect.signature(hf_fn)
        params = list(hf_sig.parameters.values())
        fn.__signature__ = hf_sig.replace(parameters=params[:1] + [
            inspect.Parameter("cuda_graph", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool),
            inspect.Parameter("quantized", inspect.Parameter.KEYWORD_ONLY, default=False,
                              annotation=bool | Literal["auto"])] + params[1:])
    globals()[name] = fn
    return fn


def __getattr__(name):
    # a missing optional package (transformers for patch and generate) surfaces as the extra to install
    with _log.requires_extra(f"tigon.{name}"):
        if name in ("ops", "modules", "memory", "optim", "quant", "hf", "decode"):
            return importlib.import_module(f"tigon.{name}")
        if name == "quantize":  # round-to-nearest 4- and 8-bit weights (tigon.quant.quantize)
            return importlib.import_module("tigon.quant").quantize
        if name in ("patch", "unpatch"):
            return _publish(name, importlib.import_module("tigon.hf.patching"))
        if name == "PatchReport":
            return importlib.import_module("tigon.hf.patching").PatchReport
        if name in ("generate", "DecodeSettings"):
            return getattr(importlib.import_module("tigon.decode"), name)
    raise AttributeError(f"module 'tigon' has no attribute {name!r}")
