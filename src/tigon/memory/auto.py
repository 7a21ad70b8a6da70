"""offload_checkpoints="auto": checkpoints go to host memory only when the training step would not fit the card
otherwise (docs/memory/offload.md, "Only when the step would not fit").

`install_auto_offload(model)` puts a forward pre-hook on the model (the module patched). At the first
training forward of each new (batch, seq_len), with grad enabled, gradient checkpointing on and the model on a
CUDA device (never while torch.compile traces), it reads `tigon.memory.plan` for that shape without offload
(the model's own trainable parameters, as the patch report's plan line) and compares the peak with what the card
can give (`_card_budget`). If the step does not fit, it arms `install_checkpoint_offload` with the largest
`keep_on_card` whose planned peak fits, and logs one WARNING that says so; if not even every checkpoint in host
memory fits, or the host's available memory cannot hold the checkpoints it would move, it leaves the job alone
and logs why once. The offload's losses and gradients are
HF's bit for bit, so arming changes the step's speed and memory only.

Once armed, a later shape can only move more checkpoints off the card (a smaller keep_on_card), never fewer: a
shape decided once stays served, and a decided shape costs one dict lookup a forward.

keep_activations="auto" is the other direction (`install_auto_kept_activations`): where the card has room, the
most layers the plan fits skip the recompute (tigon.memory.recompute; docs/memory/kept_activations.md).
"""

import dataclasses
from typing import Optional

import torch

from .. import _log
from ..ops._library import tracing
from . import offload, recompute
from .plan import CONTEXT_BYTES, MemoryPlanError, _build, _gib, _refuse, plan
from .tiling import _MARK, _TiledMLPForward, process_cap_bytes

_WHO = "tigon offload_checkpoints='auto'"
# what _card_budget holds back of the card's total: the plan's checked error (within 1.2% on the jobs of
# docs/memory/plan.md) and what it leaves out (NCCL buffers, fragmentation past its 5% allocator slack)
AUTO_MARGIN = 1 / 20


def _card_budget(model: torch.nn.Module) -> Optional[int]:
    """The bytes a training step of `model` may take on its card, in the plan's terms (its peak counts the CUDA
    context): the free memory of the CUDA device of its first parameter, plus what this process's allocator
    already reserved and CONTEXT_BYTES, at most the card's total (or the process cap of
    `torch.cuda.set_per_process_memory_fraction`, plus CONTEXT_BYTES), less AUTO_MARGIN of the total. Free memory,
    not the total: what another process holds on the card (a colocated vLLM) is not counted. None for a model
    not on a CUDA device: nothing to fit."""
    device = next((p.device for p in model.parameters()), None)
    if device is None or device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    held = min(total, free + reserved + CONTEXT_BYTES, process_cap_bytes(device) + CONTEXT_BYTES)
    return int(held - AUTO_MARGIN * total)


def _shape(args, kwargs):
    """(batch, seq_len) of a decoder call: its input_ids or inputs_embeds ([B, T] or [B, T, H]); None if neither."""
    x = kwargs.get("input_ids")
    if x is None:
        x = kwargs.get("inputs_embeds")
    if x is None and args:
        x = args[0]
    if isinstance(x, torch.Tensor) and x.dim() >= 2:
        return x.shape[0], x.shape[1]
    return None


def _tile_tokens(model: torch.nn.Module, batch: int) -> Optional[int]:
    """The tile a tiled MLP of `model` runs (install_tiled_mlp), as its "auto" would choose it now; None if the
    MLP is not tiled."""
    wrapper = next((w for w in (m.__dict__.get(_MARK) for m in model.modules()) if isinstance(w, _TiledMLPForward)),
                   None)
    if wrapper is None:
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    itemsize = emb.weight.element_size() if emb is not None else 2
    return wrapper.plan.peek(device, itemsize, batch, wrapper.intermediate_size)


def _sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are shards (FSDP2's DTensors, FSDP1's flat parameters, DeepSpeed ZeRO-3's):
    the plan counts one card holding the whole model, so it says nothing about such a job."""
    return any(hasattr(p, "placements") or getattr(p, "_is_flat_param", False) or hasattr(p, "ds_id")
               for p in model.parameters())


class _ShapeHook:
    """A model's forward pre-hook that decides once per (batch, seq_len) of a training forward with gradient
    checkpointing on (never while torch.compile traces): `decisions` {shape: what `_decide` returned}. `WHO` names
    it in messages; setting `active` to False removes the hook (tigon.unpatch does, through patch's undo record)."""

    WHO = ""
    INSTALL = ""

    def __init__(self, layers: list):
        self.layers = layers
        self.decisions = {}
        self.unplanned = False  # the plan cannot read the model (or it cannot be armed): never decided again
        self.handles = []

    @property
    def active(self) -> bool:
        return bool(self.handles)

    @active.setter
    def active(self, value) -> None:
        if value is not False:
            raise ValueError(f"{self.WHO}: active can only be set to False ({self.INSTALL}(model) arms it)")
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def __call__(self, module, args, kwargs):
        if not module.training or not torch.is_grad_enabled() or tracing():
            return None
        shape = _shape(args, kwargs)
        if shape is None or shape in self.decisions or not self.layers[0].gradient_checkpointing:
            return None  # not decided without checkpointing: the Trainer enables it after the patch
        self.decisions[shape] = self._decide(module, *shape)
        return None

    def _decide(self, model: torch.nn.Module, batch: int, seq_len: int):
        raise NotImplementedError


def _installed_hook(model: torch.nn.Module, kind: type):
    hooks = getattr(model, "_forward_pre_hooks", {})
    return next((h for h in hooks.values() if isinstance(h, kind)), None)


def _install_hook(model: torch.nn.Module, kind: type, prepend: bool = False):
    """The `kind` hook on `model`: the one there, or a new one over its checkpointed layers (None without any)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tigon.memory.{kind.INSTALL}: model must be a torch.nn.Module, got {type(model).__name__}")
    existing = _installed_hook(model, kind)
    if existing is not None:
        return existing
    layers = offload._checkpoint_layers(model)
    if not layers:
        return None
    state = kind([layer for _, layer in layers])
    state.handles = [model.register_forward_pre_hook(state, with_kwargs=True, prepend=prepend)]
    return state


class AutoOffload(_ShapeHook):
    """offload_checkpoints="auto" on one model, the forward pre-hook `install_auto_offload` puts on it.

    `decisions`: {(batch, seq_len): the keep_on_card that shape needs, or None (it fits, the model is not on a
    card, the plan cannot read the model or its parameters are sharded, or not even every checkpoint in host
    memory fits)}; `keep_on_card`: what
    it armed (None: nothing). It holds no reference to the model (the model reaches it as the hook's `module`),
    so a model dropped by its user is freed at once. Setting `active` to False removes the hook (tigon.unpatch
    does, through patch's undo record, and then takes the offload off itself)."""

    WHO, INSTALL = _WHO, "install_auto_offload"

    def __init__(self, layers: list):
        super().__init__(layers)
        self.keep_on_card = None
        self.installed = None  # the offload's record on the model, while it is the one this object armed
        self.refused = False  # a shape did not fit even fully offloaded: said once

    def owns_offload(self, model: torch.nn.Module) -> bool:
        """Whether the offload installed on `model` now is the one this object armed."""
        return self.installed is not None and model.__dict__.get(offload._STATE) is self.installed

    def _decide(self, model: torch.nn.Module, batch: int, seq_len: int) -> Optional[int]:
        budget = _card_budget(model)
        if budget is None or self.unplanned:
            return None
        if _sharded(model):  # never planned: the job's card holds a shard of the model
            self.unplanned = True
            _log.get_logger().debug("%s: the model's parameters are sharded; never armed", _WHO)
            return None
        if not self.owns_offload(model):
            if offload.checkpoint_offload_installed(model):
                return None  # installed otherwise (install_checkpoint_offload, offload_checkpoints=True): kept
            self.installed = self.keep_on_card = None  # none, or ours was uninstalled since
        try:
            full = _plan(model, batch, seq_len)
        except Exception as e:  # a model the plan cannot read (an MoE, nothing trainable) trains as it is
            self.unplanned = True
            _log.get_logger().debug("%s: no memory plan for this model, never armed: %s", _WHO, e)
            return None
        if full.peak <= budget:
            return None

        def planned(kept):
            return _build(dataclasses.replace(full._job, kept=kept), seq_len)

        if planned(0).peak > budget:
            if not self.refused:
                self.refused = True
                try:
                    _refuse(planned(0), budget)
                except MemoryPlanError as e:
                    _log.get_logger().warning("%s: a step of %d x %d tokens does not fit the card (%s) even with "
                                              "every checkpoint in host memory; left as it is: %s", _WHO, batch,
                                              seq_len, _gib(budget), e)
            return None
        lo, hi = 0, len(self.layers)  # planned(lo) fits, planned(hi) (no offload) does not; the peak grows with kept
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if planned(mid).peak <= budget else (lo, mid)
        refusal = _host_refusal(model, planned(lo), len(self.layers) - lo)
        if refusal:
            if not self.refused:
                self.refused = True
                _log.get_logger().warning("%s: a step of %d x %d tokens does not fit the card (%s), and %s; left "
                                          "as it is", _WHO, batch, seq_len, _gib(budget), refusal)
            return None
        self._arm(model, lo, f"a training step of {batch} x {seq_len} tokens needs {_gib(full.peak)} on the card, "
                  f"which gives {_gib(budget)} (tigon.memory.plan)", planned(lo).peak)
        return lo

    def _arm(self, model: torch.nn.Module, keep: int, why: str, peak: int) -> None:
        if self.keep_on_card is not None and self.keep_on_card <= keep:
            return  # already offloads at least as much
        if self.installed is not None:
            self.installed.plan.keep_on_card = keep  # every armed layer reads it at its next forward
        else:
            try:
                offload.install_checkpoint_offload(model, keep_on_card=keep)
            except RuntimeError as e:  # no pinned host memory: nothing was armed
                self.unplanned = True
                _log.get_logger().warning("%s: %s", _WHO, e)
                return
            self.installed = model.__dict__[offload._STATE]
        self.keep_on_card = keep
        _log.get_logger().warning("%s: %s; the checkpointed inputs of all but the last %d of %d layers now wait in "
                                  "pinned host memory (%s planned; losses and gradients unchanged)", _WHO, why, keep,
                                  len(self.layers), _gib(peak))


def _host_refusal(model: torch.nn.Module, planned, offloaded: int) -> Optional[str]:
    """Why the host cannot hold `offloaded` layer inputs of the planned step (each in a buffer of torch's pinned
    cache), or None when it can or its memory is unknown: the check the offload itself makes at its forward."""
    if offloaded <= 0:
        return None
    pinned = any(p.device.type == "cuda" for p in model.parameters())
    short = offload.host_shortfall(offloaded, planned.checkpoints_host // offloaded, pinned)
    if short is None:
        return None
    need, _, available = short
    return (f"moving the checkpoints of {offloaded} layers to host memory needs {_gib(need)} there, "
            f"{_gib(available)} available")


def _plan(model: torch.nn.Module, batch: int, seq_len: int, **kw):
    """tigon.memory.plan of one step of `model` at this shape as it runs now, without offload."""
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return plan(model, seq_len=seq_len, batch_size=batch, tile_tokens=_tile_tokens(model, batch),
                attention=attention if attention in ("eager", "sdpa") else "flash", **kw)


# what keep_activations="auto" leaves free of the card beyond AUTO_MARGIN: the kept layers' bytes are the plan's
# count, not yet checked against a measured peak as the checkpointed job's are
KEPT_MARGIN = 1 / 10
_WHO_KEPT = "tigon keep_activations='auto'"


class AutoKeptActivations(_ShapeHook):
    """keep_activations="auto" on one model: a forward pre-hook, run before the offload's "auto" reads the plan.
    At the first training forward of each new (batch, seq_len) with gradient checkpointing on and the model on a
    CUDA card, the last `MemoryPlan.most_kept_activations` layers of the plan with none kept, under the card's
    budget (`_card_budget`) less KEPT_MARGIN of the card, run without the recompute (install_kept_activations);
    none where the step would not fit checkpointed. A later shape can only lower the number, never raise it.
    `decisions`: {(batch, seq_len): the layers it allowed, or None (not decided: no card, no plan)}; `kept`: how
    many run so now (None: never decided). One INFO line on the "tigon" logger per change."""

    WHO, INSTALL = _WHO_KEPT, "install_auto_kept_activations"

    def __init__(self, layers: list):
        super().__init__(layers)
        self.kept = None

    def _decide(self, model: torch.nn.Module, batch: int, seq_len: int) -> Optional[int]:
        budget = _card_budget(model)
        if budget is None or self.unplanned:
            return None
        if _sharded(model):
            self.unplanned = True
            return None
        try:
            base = _plan(model, batch, seq_len, keep_activations=0)
        except Exception as e:  # a model the plan cannot read: every layer stays checkpointed
            self.unplanned = True
            _log.get_logger().debug("%s: no memory plan for this model, every layer recomputes: %s", _WHO_KEPT, e)
            return None
        device = next(p.device for p in model.parameters())
        room = budget - int(KEPT_MARGIN * torch.cuda.get_device_properties(device).total_memory)
        allowed = base.most_kept_activations(room) if room > base.weights and base.peak <= room else 0
        if self.kept is not None:
            allowed = min(allowed, self.kept)
        if allowed != self.kept:
            recompute.install_kept_activations(model, layers=allowed)
            _log.get_logger().info("%s: a training step of %d x %d tokens: the last %d of %d layers keep their "
                                   "activations (no recompute; %s planned against %s free)", _WHO_KEPT, batch,
                                   seq_len, allowed, len(self.layers),
                                   _gib(_build(dataclasses.replace(base._job, keep_activations=allowed),
                                               seq_len).peak), _gib(room))
        self.kept = allowed
        return allowed


def install_auto_kept_activations(model: torch.nn.Module) -> Optional[AutoKeptActivations]:
    """Watch `model`'s training forwards and let the most layers whose activations fit the card skip the recompute
    (AutoKeptActivations). Returns it (the one already installed, if any), or None for a model without
    transformers' GradientCheckpointingLayer."""
    return _install_hook(model, AutoKeptActivations, prepend=True)  # before the offload's: it reads the plan


def uninstall_auto_kept_activations(model: torch.nn.Module) -> bool:
    """Undo `install_auto_kept_activations`: the hook goes and every layer is checkpointed again. Returns whether
    one was installed."""
    state = auto_kept_activations(model)
    if state is None:
        return False
    state.active = False
    recompute.uninstall_kept_activations(model)
    return True


def auto_kept_activations(model: torch.nn.Module) -> Optional[AutoKeptActivations]:
    """The AutoKeptActivations installed on `model`, or None."""
    return _installed_hook(model, AutoKeptActivations)


def install_auto_offload(model: torch.nn.Module) -> Optional[AutoOffload]:
    """Watch `model`'s training forwards and arm `install_checkpoint_offload` at the first (batch, seq_len)
    whose step would not fit the card otherwise (module docstring). Returns the AutoOffload (the one already
    installed, if any), or None for a model without transformers' GradientCheckpointingLayer: nothing to arm."""
    return _install_hook(model, AutoOffload)


def uninstall_auto_offload(model: torch.nn.Module) -> bool:
    """Undo `install_auto_offload` on `model`: the hook goes, and the offload it armed (one installed otherwise
    stays). Returns whether one was installed."""
    state = auto_offload(model)
    if state is None:
        return False
    state.active = False
    if state.owns_offload(model):
        offload.uninstall_checkpoint_offload(model)
    state.installed = state.keep_on_card = None
    return True


def auto_offload(model: torch.nn.Module) -> Optional[AutoOffload]:
    """The AutoOffload installed on `model` (its decisions, what it armed), or None."""
    return _installed_hook(model, AutoOffload)
