"""tigon.patch / tigon.unpatch: the Hugging Face patch (`tigon.hf.patching`) plus the fused decode layer step and,
when asked, the CUDA-graph decode step of HF's own generate.

`patch(model, ...)` is `tigon.hf.patching.patch_hf_model` (same arguments, report and errors), and on a model
instance it also installs the fused decoder-layer step (`tigon.decode.layer_step.install`) on the layers that
run Tigon's decoder forward, so HF's own `model.generate(ids, past_key_values=RollingKVCache(...))` on the "tigon"
attention decodes with it. `patch(model, cuda_graph=True)` also installs `tigon.decode.hf_graph` (that
generate's decode steps replay a CUDA graph) and, where `attention` is left "auto", switches the model to the
"tigon" attention, which the graph needs. `unpatch(model)` undoes all of it.
"""

import functools
import inspect
from typing import TYPE_CHECKING

from . import _log

if TYPE_CHECKING:
    import torch

    from .hf.patching import PatchReport

with _log.requires_extra("tigon.patch"):  # tigon.hf and tigon.decode import transformers
    from .decode import hf_graph, layer_step
    from .hf.patching import patch_hf_model as _hf_patch
    from .hf.patching import unpatch_hf_model as _hf_unpatch
    from .hf.unwrap import unwrap_model


@functools.wraps(_hf_patch, assigned=("__doc__",))  # keeps the name tigon.patch
def patch(model: "torch.nn.Module | None" = None, *, cuda_graph: bool = False, **options) -> "PatchReport":
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"tigon.patch: cuda_graph must be True or False, got {type(cuda_graph).__name__} "
                        f"{cuda_graph!r}")
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
    report = _hf_patch(model, **options)
    if model is not None:
        layer_step.install(model)
    if cuda_graph or graphed:
        hf_graph.install(model)
    return report


patch.__doc__ = (_hf_patch.__doc__ or "") + """

    cuda_graph=True (instance only): HF's `model.generate(ids, past_key_values=RollingKVCache(...))` captures
    its decode step in a CUDA graph on the second decode step and replays it after (`tigon.decode.hf_graph`);
    it implies attention=True ("auto" becomes True; False is a ValueError). cuda_graph=False leaves an
    installed graph step in place (`tigon.unpatch` or `tigon.decode.hf_graph.uninstall` takes it off)."""
_params = list(inspect.signature(_hf_patch).parameters.values())
patch.__signature__ = inspect.Signature(
    _params[:1] + [inspect.Parameter("cuda_graph", inspect.Parameter.KEYWORD_ONLY, default=False,
                                    annotation=bool)] + _params[1:],
    return_annotation=inspect.signature(_hf_patch).return_annotation)


@functools.wraps(_hf_unpatch, assigned=("__doc__",))
def unpatch(model: "torch.nn.Module | None" = None, **options) -> None:
    if model is not None and not options:
        unwrap_model(model, "tigon.unpatch")  # the argument check, before anything changes
        hf_graph.uninstall(model)  # first: the forward under it is the HF patch's, which unpatch restores
    _hf_unpatch(model, **options)  # checks the arguments first
    if model is not None:
        layer_step.uninstall(model)
