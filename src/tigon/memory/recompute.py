"""Layers that keep their activations: gradient checkpointing without the recompute on the last layers.

Hugging Face's gradient checkpointing saves each decoder layer's input and runs the layer's forward a second time in
the backward: a whole forward of GEMMs, attention and kernels (about a quarter of a LoRA step's time). Where the
card has memory to spare, a layer can instead keep what its backward reads, as without checkpointing.
`install_kept_activations(model, layers=K)` does that for the last K `GradientCheckpointingLayer`s (their backward
comes first, so their activations are freed first): their checkpointing function becomes a plain call. HF's
checkpointing path stays on for them otherwise (the flag, the cache arguments it drops), and the other layers are
checkpointed as before. Losses and gradients are bitwise those of checkpointing where a layer runs the same ops
either way (the recompute computes the same values; a patched full fine-tune's MLP runs as one node outside a
checkpoint, its input gradient summed in another order); the step is faster and holds K layers' activations more
(`tigon.memory.plan(..., keep_activations=K)` counts them; `MemoryPlan.most_kept_activations(budget)` finds the
largest K that fits).

The choice is a mark on each chosen layer (`_MARK`), which the offload's checkpointing function honours too
(tigon.memory.offload), so the two install in either order. Like the offload, the function is put back by a
forward pre-hook when `gradient_checkpointing_enable()` replaces it after install.
"""

import functools

import torch

from ..ops._library import tracing

_INSTALL = "tigon.memory.install_kept_activations"
_STATE = "_tigon_kept_activations"  # attribute of the model installed on
_MARK = "_tigon_keeps_activations"  # attribute of each chosen layer: run without the recompute


class _Missing:
    """The marker for "no attribute" (a layer without a checkpointing function before install); one object, also
    after a copy or a pickle of the model."""

    def __reduce__(self):
        return "_MISSING"


_MISSING = _Missing()


class _KeptActivationsFunc:
    """The `_gradient_checkpointing_func` of one chosen layer: the layer's call itself, no checkpoint (under
    torch.compile too). `previous` is the function it replaced, restored by uninstall."""

    def __init__(self):
        self.previous = _MISSING

    def __call__(self, function, *args, **kwargs):
        return function(*args, **kwargs)


def checkpoint_layers(model: torch.nn.Module) -> list:
    """[(name, layer)] of `model`'s transformers GradientCheckpointingLayers, in order (none without transformers)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]


class ArmedLayers:
    """Checkpointing functions an install put on a model's layers, and how it undoes that (the offload's and this
    module's): `armed` [(layer, function)], each function with a `previous` attribute (what it replaced).
    `arm(model, names)` puts them on and hooks the modules whose forward runs the layers, so that each forward puts
    a function back where something replaced it (HF's gradient_checkpointing_enable after install), what it found
    becoming what `disarm` restores. `yields_to(current)`: a function found there that stays."""

    def __init__(self, armed: list):
        self.armed, self.hooks = armed, []

    def yields_to(self, current) -> bool:
        return False

    def arm(self, model: torch.nn.Module, names: list) -> None:
        # the modules whose forward runs the layers (LlamaModel over model.layers), and the model itself
        owners = {name.rpartition(".")[0].rpartition(".")[0] for name in names} | {""}
        modules = dict(model.named_modules())
        self.hooks = [modules[o].register_forward_pre_hook(functools.partial(_rearm_hook, self))
                      for o in sorted(owners) if o in modules]
        self.rearm()

    def rearm(self) -> None:
        for layer, func in self.armed:
            current = layer.__dict__.get("_gradient_checkpointing_func", _MISSING)
            if current is not func and not self.yields_to(current):
                func.previous = current
                layer._gradient_checkpointing_func = func

    def disarm(self) -> None:
        for handle in self.hooks:
            handle.remove()
        for layer, func in self.armed:
            if layer.__dict__.get("_gradient_checkpointing_func", _MISSING) is not func:
                continue  # replaced after the last forward: the newer function stays
            if func.previous is _MISSING:
                del layer.__dict__["_gradient_checkpointing_func"]
            else:
                layer._gradient_checkpointing_func = func.previous


def _rearm_hook(state: ArmedLayers, module, args) -> None:
    if not tracing():
        state.rearm()


def uninstall_armed(model: torch.nn.Module, key: str) -> int:
    """Disarm every ArmedLayers kept under `key` on `model` or a module inside it; the number of layers."""
    count = 0
    for module in model.modules():
        state = module.__dict__.pop(key, None)
        if state is not None:
            state.disarm()
            count += len(state.armed)
    return count


class _Installed(ArmedLayers):
    """The chosen layers: a function that honours the mark itself (the offload's, `honours_kept_activations`) is
    left in place; uninstall also takes the marks off."""

    def yields_to(self, current) -> bool:
        return getattr(current, "honours_kept_activations", False)

    def disarm(self) -> None:
        for layer, _ in self.armed:
            layer.__dict__.pop(_MARK, None)
        super().disarm()


def install_kept_activations(model: torch.nn.Module, *, layers: int) -> int:
    """The last `layers` of `model`'s Hugging Face `GradientCheckpointingLayer`s run without the recompute (they keep
    their activations for the backward) while gradient checkpointing is on; the others are checkpointed as before.
    Works whether `model.gradient_checkpointing_enable()` is called before or after, and with
    `install_checkpoint_offload` in either order (the chosen layers' inputs are then not offloaded). Installing
    again replaces the earlier choice; `layers=0` uninstalls. Returns the number of layers chosen."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_INSTALL}: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"{_INSTALL}: layers must be an int >= 0, got {layers!r}")
    found = checkpoint_layers(model)
    if layers and not found:
        raise ValueError(f"{_INSTALL}: model ({type(model).__name__}) has no transformers GradientCheckpointingLayer "
                         "(the decoder layers that gradient_checkpointing_enable() checkpoints)")
    if layers > len(found):
        raise ValueError(f"{_INSTALL}: layers must be at most the model's {len(found)} checkpointed layers, got "
                         f"{layers}")
    uninstall_kept_activations(model)
    if not layers:
        return 0
    state = _Installed([(layer, _KeptActivationsFunc()) for _, layer in found[len(found) - layers:]])
    for layer, _ in state.armed:
        layer.__dict__[_MARK] = True
    state.arm(model, [name for name, _ in found])
    model.__dict__[_STATE] = state
    return len(state.armed)


def uninstall_kept_activations(model: torch.nn.Module) -> int:
    """Undo `install_kept_activations` on `model` or a module inside it: every chosen layer is checkpointed again
    (gets back the function it had). Returns the number of layers it had chosen (0 when none)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tigon.memory.uninstall_kept_activations: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    return uninstall_armed(model, _STATE)


def kept_activation_layers(model: torch.nn.Module) -> int:
    """How many of `model`'s layers run without the recompute (`install_kept_activations`)."""
    return sum(1 for m in model.modules() if m.__dict__.get(_MARK))


def keeps_activations(layer) -> bool:
    """Whether `layer` was chosen to run without the recompute."""
    return bool(getattr(layer, "__dict__", {}).get(_MARK))

