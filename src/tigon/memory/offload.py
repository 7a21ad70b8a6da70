"""Checkpoints in host memory: gradient checkpointing whose saved layer inputs wait in pinned host memory.

With Hugging Face's gradient checkpointing each decoder layer keeps one tensor for its backward: its input
hidden_states, [B, T, H] (8 KiB a token a layer at Llama-3-8B, 256 KiB a token over 32 layers). Installed on a
model, this module replaces each `GradientCheckpointingLayer`'s `_gradient_checkpointing_func` with torch's
non-reentrant checkpoint over a holder of the input instead of the input itself:
- forward: copies the input to pinned host memory on a side CUDA stream (`record_stream` keeps the card block
  from reuse until the copy ends, then the allocator frees it) and runs the layer under the checkpoint;
- backward: the checkpoint's recompute asks the holder for the input: the compute stream waits for it to be back
  on the card (an event, no host sync), and the copy of the next layer down starts (one layer ahead, on a second
  side stream, overlapped with this layer's recompute and backward). The recompute stops at the last tensor the
  backward needs, as plain checkpointing's does, and the gradients flow through the forward's own graph.
The last `keep_on_card` layers (those whose backward comes first) keep their input on the card. torch's
checkpoint replays the forward's RNG and autocast state, so losses and gradients are bitwise those of HF's own
(non-reentrant) checkpointing. On a CPU model the same code keeps a second CPU copy as "host memory" and runs the
copies in order, which is how the bookkeeping is tested without a GPU. docs/memory/offload.md has the byte model.
"""

import functools
import weakref
from typing import Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .. import _log
from ..ops._library import tracing
from .recompute import _MISSING, ArmedLayers, keeps_activations, uninstall_armed
from .recompute import checkpoint_layers as _checkpoint_layers

_INSTALL = "tigon.memory.install_checkpoint_offload"
_STATE = "_tigon_checkpoint_offload"  # attribute of the model the offload was installed on
_ARGUMENT = "offload_checkpoints"  # tigon.patch's argument; named in the errors a user of either entry can meet


def _allocate_host(like: torch.Tensor, pin: bool) -> torch.Tensor:
    return torch.empty_like(like, device="cpu", pin_memory=pin)


def _host_like(like: torch.Tensor) -> torch.Tensor:
    """A host tensor with `like`'s shape, dtype and (dense) strides; pinned when `like` is on a CUDA card, so the
    copies are asynchronous DMA."""
    pin = like.device.type == "cuda"
    try:
        return _allocate_host(like, pin)
    except RuntimeError as e:
        raise RuntimeError(
            f"tigon {_ARGUMENT}: could not allocate {like.numel() * like.element_size()} bytes of "
            f"{'pinned ' if pin else ''}host memory for a checkpointed layer input ({e}); keep more layers on the "
            f"card (keep_on_card) or free host memory") from e


class _Ticket:
    """One layer call's input while it waits for the backward: on the host (`host`), back on the card
    (`device`), or consumed (both None). `stored` / `loaded` are the CUDA events ending its two copies; `prev` is a
    weak link to the ticket made just before it in the forward, whose backward comes right after this one's."""

    __slots__ = ("layer", "where", "version", "host", "device", "stored", "loaded", "prev", "kept", "__weakref__")

    def __init__(self, layer: int, x: torch.Tensor, prev):
        self.layer, self.where, self.version, self.prev = layer, x.device, x._version, prev
        self.host = self.device = self.stored = self.loaded = None
        self.kept = False


class _HostStore:
    """The host side of one installed model: the two side streams a CUDA device gets (device-to-host in the
    forward, host-to-device in the backward) and the chain of tickets of the forward in progress."""

    def __init__(self):
        self._streams = {}
        self._last = None  # weakref to the newest ticket: a graph dropped without backward frees its tickets

    def __getstate__(self):  # a copied or pickled model gets a store of its own, without streams or tickets
        return {}

    def __setstate__(self, state):
        self.__init__()

    def _side_streams(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _new(self, layer: int, x: torch.Tensor) -> _Ticket:
        ticket = _Ticket(layer, x, self._last)
        self._last = weakref.ref(ticket)
        return ticket

    def keep(self, layer: int, x: torch.Tensor) -> _Ticket:
        """`x` stays on the card (a layer the budget keeps); it joins the chain, so the backward of this layer
        still starts the copy of the layer below."""
        ticket = self._new(layer, x)
        ticket.device, ticket.kept = x, True
        return ticket

    def offload(self, layer: int, x: torch.Tensor) -> _Ticket:
        """Start copying `x` to host memory; the caller drops its reference to `x` afterwards."""
        ticket = self._new(layer, x)
        if x.device.type == "cuda":
            compute = torch.cuda.current_stream(x.device)
            down, _ = self._side_streams(x.device)
            down.wait_stream(compute)  # x is written by work already queued on the compute stream
            with torch.cuda.stream(down):
                ticket.host = _host_like(x)
                ticket.host.copy_(x, non_blocking=True)
                ticket.stored = torch.cuda.Event()
                ticket.stored.record(down)
            x.record_stream(down)  # freed by its last owner, x's block is reused only after the copy
        else:
            ticket.host = _host_like(x)
            ticket.host.copy_(x)
        return ticket

    def prefetch(self, ticket: "_Ticket | None") -> None:
        """Start copying `ticket`'s tensor back to the card; nothing for a missing, kept, fetched or used one."""
        if ticket is None or ticket.host is None or ticket.device is not None:
            return
        if ticket.where.type == "cuda":
            _, up = self._side_streams(ticket.where)
            with torch.cuda.stream(up):  # allocated on `up`: no wait on the compute stream's frees
                up.wait_event(ticket.stored)
                device = torch.empty_like(ticket.host, device=ticket.where)
                device.copy_(ticket.host, non_blocking=True)
                ticket.loaded = torch.cuda.Event()
                ticket.loaded.record(up)
        else:
            device = torch.empty_like(ticket.host, device=ticket.where)
            device.copy_(ticket.host)
        ticket.device = device

    def wait(self, ticket: _Ticket) -> torch.Tensor:
        """`ticket`'s tensor on the card, ready for the current stream (prefetched now if nobody did)."""
        if ticket.host is None and ticket.device is None:
            raise RuntimeError(f"tigon {_ARGUMENT}: layer {ticket.layer}'s input was already used by a backward; "
                               "backward through a checkpoint-offloaded graph twice (retain_graph=True) is not "
                               "supported")
        self.prefetch(ticket)
        device = ticket.device
        if ticket.kept and device._version != ticket.version:
            raise RuntimeError(f"tigon {_ARGUMENT}: layer {ticket.layer}'s input was modified in place after its "
                               "forward; its backward needs the value it had")
        if ticket.loaded is not None:
            compute = torch.cuda.current_stream(ticket.where)
            compute.wait_event(ticket.loaded)
            device.record_stream(compute)  # allocated on the copy stream, used and freed on the compute stream
        # the host block goes back to torch's pinned cache, which reuses it only after the copy reading it ends
        ticket.host = ticket.device = ticket.stored = ticket.loaded = None
        return device


def _host_available_bytes() -> Optional[int]:
    """What the host can still give without swapping (Linux's MemAvailable); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _host_block_bytes(nbytes: int, pinned: bool) -> int:
    """The host bytes one copy of `nbytes` takes: torch's pinned-memory cache rounds a block up to a power of
    two; a plain CPU tensor takes its size."""
    return 1 << max(0, (nbytes - 1).bit_length()) if pinned else nbytes


def _host_cached_free_bytes() -> int:
    """Pinned bytes torch's host cache holds but no tensor uses (reused before anything new is pinned)."""
    try:
        stats = torch.cuda.host_memory_stats()
        return max(0, stats.get("reserved_bytes.current", 0) - stats.get("allocated_bytes.current", 0))
    except (AttributeError, RuntimeError):
        return 0


def host_shortfall(count: int, nbytes: int, pinned: bool) -> Optional[tuple]:
    """(bytes needed, bytes of one buffer, bytes available) when `count` host copies of `nbytes` each do not fit
    the host's available memory (with the pinned buffers torch caches unused); None when they fit or the host's
    memory cannot be read. The one rule for the offload's forward and for offload_checkpoints="auto"."""
    available = _host_available_bytes()
    block = _host_block_bytes(nbytes, pinned)
    need = count * block
    if available is None or need <= available + (_host_cached_free_bytes() if pinned else 0):
        return None
    return need, block, available


class _Plan:
    """What every armed layer of one model shares: the store and the budget of inputs kept on the card."""

    def __init__(self, store: _HostStore, layers: int, keep_on_card: int, keep_on_card_bytes: int):
        self.store, self.layers = store, layers
        self.keep_on_card, self.keep_on_card_bytes = keep_on_card, keep_on_card_bytes
        self.warned = False
        self.host_checked = set()  # (layer input bytes, pinned) whose host memory was found sufficient

    def check_host(self, x: torch.Tensor) -> None:
        """Before the first input of a new size leaves the card: refuse a forward whose offloaded inputs would
        need more host memory than the host has (pinned memory cannot be swapped; running out midway costs the
        forward so far, or the process), naming what it needs. Checked once per size."""
        pinned = x.device.type == "cuda"
        key = (x.numel() * x.element_size(), pinned)
        if key in self.host_checked:
            return
        count = sum(1 for i in range(self.layers) if not self.keeps(i, x))
        short = host_shortfall(count, key[0], pinned)
        if short is not None:
            need, block, available = short
            raise RuntimeError(
                f"tigon {_ARGUMENT}: the {count} offloaded layer inputs of this forward need {need / 2**30:.2f} GiB "
                f"of {'pinned ' if pinned else ''}host memory ({key[0]} bytes each"
                f"{f', {block} in the pinned cache' if block != key[0] else ''}), and the host has "
                f"{available / 2**30:.2f} GiB available; keep more layers on the card (keep_on_card), shorten the "
                "sequence, or free host memory (tigon.memory.plan's checkpoints_host predicts the need)")
        self.host_checked.add(key)

    def keeps(self, index: int, x: torch.Tensor) -> bool:
        """Layer `index` keeps its input when it is one of the last `keep_on_card` layers, or when the inputs of
        it and every layer after it (as large as its own) fit `keep_on_card_bytes`."""
        after = self.layers - index
        return after <= self.keep_on_card or after * x.numel() * x.element_size() <= self.keep_on_card_bytes


class _Holder:
    """A checkpointed layer's input as the layer function reaches it: the tensor itself while the forward runs,
    then a ticket that the recompute in the backward redeems (from host memory, or kept on the card). The
    checkpoint holds this object, not the tensor, so the card's copy is freed once its host copy is made."""

    __slots__ = ("tensor", "ticket", "store", "requires_grad")

    def __init__(self, tensor: torch.Tensor, store: _HostStore):
        self.tensor, self.ticket, self.store, self.requires_grad = tensor, None, store, tensor.requires_grad

    def park(self, ticket: _Ticket) -> None:
        """The forward is over: from now on the input is `ticket`'s."""
        self.tensor, self.ticket = None, ticket

    def get(self) -> torch.Tensor:
        if self.ticket is None:
            return self.tensor
        ticket = self.ticket
        x = self.store.wait(ticket)  # this layer's recompute has begun: the layer below's backward comes next
        self.store.prefetch(ticket.prev() if ticket.prev is not None else None)
        # requires_grad as in the forward, so the recompute saves what the forward saved (the checkpoint checks)
        return x.detach().requires_grad_(self.requires_grad)


def _run_layer(function, holder: _Holder, device_marker: torch.Tensor, *rest):
    return function(holder.get(), *rest)


def _checkpoint(function, holder: _Holder, *rest):
    """torch's non-reentrant checkpoint of the layer: the RNG and autocast state replayed, and its recompute
    stopping at the last tensor the backward needs (the layer's output projection is never recomputed).
    torch stashes the RNG state of the devices of the tensors among the checkpoint's arguments; the holder hides
    the input, and HF passes everything else as keywords bound in `function`, so an empty tensor on the input's
    device stands in for it: without it a CUDA layer's dropout masks would differ in the recompute."""
    marker = holder.tensor.new_empty(0)
    return _torch_checkpoint(_run_layer, function, holder, marker, *rest, use_reentrant=False,
                             preserve_rng_state=True)


class _OffloadingCheckpointFunc:
    """The `_gradient_checkpointing_func` of one armed layer (`index`-th of the model's checkpointed layers).
    Under torch.compile, or for a call shape it does not know, it hands the call to the function it replaced
    (HF's checkpoint), so the result is the same and only the offload is skipped."""

    honours_kept_activations = True  # a layer install_kept_activations chose runs plainly here too

    def __init__(self, plan: _Plan, index: int):
        self.plan, self.index = plan, index
        self.previous = _MISSING  # the function this one replaced, restored by uninstall

    def _fallback(self, function, *args, **kwargs):
        previous = self.previous
        if previous is _MISSING:
            previous = functools.partial(_torch_checkpoint, use_reentrant=False)
        return previous(function, *args, **kwargs)

    def __call__(self, function, *args, **kwargs):
        layer = getattr(getattr(function, "func", None), "__self__", None)
        if keeps_activations(layer):  # install_kept_activations chose it: no checkpoint, nothing offloaded
            return function(*args, **kwargs)
        if tracing():
            return self._fallback(function, *args, **kwargs)
        if (kwargs or not isinstance(function, functools.partial) or not isinstance(layer, torch.nn.Module)
                or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point()):
            if not self.plan.warned:
                self.plan.warned = True
                _log.get_logger().warning(
                    "tigon %s: layer %d was called without its input as a positional tensor; such calls run the "
                    "checkpoint they had, with the input kept on the card", _ARGUMENT, self.index)
            return self._fallback(function, *args, **kwargs)
        hidden = args[0]
        tensors = [t for t in pytree.tree_leaves((function.args, function.keywords, args[1:]))
                   if isinstance(t, torch.Tensor)]
        if not torch.is_grad_enabled() or not (hidden.requires_grad or any(p.requires_grad for p in layer.parameters())
                                               or any(t.requires_grad for t in tensors)):
            return function(*args)  # nothing to differentiate: no checkpoint, nothing saved
        store = self.plan.store
        kept = self.plan.keeps(self.index, hidden)
        if not kept:
            self.plan.check_host(hidden)
        ticket = store.keep(self.index, hidden) if kept else store.offload(self.index, hidden)
        holder = _Holder(hidden, store)
        out = _checkpoint(function, holder, *args[1:])
        if not kept and hidden._version != ticket.version:
            raise RuntimeError(f"tigon {_ARGUMENT}: layer {self.index} modified its input in place; its copy in "
                               "host memory would not be the value its backward needs")
        holder.park(ticket)
        return out


class _Installed(ArmedLayers):
    """What install changed on a model, for uninstall: each armed layer and its function, the hooks, the plan."""

    def __init__(self, armed: list, plan: _Plan):
        super().__init__(armed)
        self.plan = plan


def _int_arg(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_INSTALL}: {name} must be an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{_INSTALL}: {name} must be an int >= 0, got {value}")
    return value


def install_checkpoint_offload(model: torch.nn.Module, *, keep_on_card: int = 0, keep_on_card_bytes: int = 0) -> int:
    """Arm every Hugging Face `GradientCheckpointingLayer` of `model` to keep its checkpointed input in host memory
    (pinned, copied on side CUDA streams, fetched back one layer ahead of its backward) instead of on the card.

    keep_on_card: the last this-many layers keep their input on the card (their backward comes first, so their
    input is needed soonest). keep_on_card_bytes: also keep the last layers whose inputs fit this many bytes.
    Works whether `model.gradient_checkpointing_enable()` is called before or after (the model's forward re-arms
    layers whose function was replaced). Installing again replaces the earlier settings. Returns the number of
    layers armed. Losses and gradients are bitwise those of HF's checkpointing; under torch.compile the layers
    run HF's checkpoint (no offload).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_INSTALL}: model must be a torch.nn.Module, got {type(model).__name__}")
    keep_on_card = _int_arg("keep_on_card", keep_on_card)
    keep_on_card_bytes = _int_arg("keep_on_card_bytes", keep_on_card_bytes)
    layers = _checkpoint_layers(model)
    if not layers:
        raise ValueError(f"{_INSTALL}: model ({type(model).__name__}) has no transformers GradientCheckpointingLayer "
                         "(the decoder layers that gradient_checkpointing_enable() checkpoints); nothing to offload")
    if any(p.device.type == "cuda" for p in model.parameters()):
        _host_like(torch.empty(1, device=next(p.device for p in model.parameters() if p.device.type == "cuda")))
    uninstall_checkpoint_offload(model)
    plan = _Plan(_HostStore(), len(layers), keep_on_card, keep_on_card_bytes)
    state = _Installed([(layer, _OffloadingCheckpointFunc(plan, i)) for i, (_, layer) in enumerate(layers)], plan)
    state.arm(model, [name for name, _ in layers])
    model.__dict__[_STATE] = state
    return len(state.armed)


def uninstall_checkpoint_offload(model: torch.nn.Module) -> int:
    """Undo `install_checkpoint_offload` on `model` or any module inside it: each layer gets back the
    checkpointing function it had (or none). Returns the number of layers disarmed (0 when none was armed)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tigon.memory.uninstall_checkpoint_offload: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    return uninstall_armed(model, _STATE)


def checkpoint_offload_installed(model: torch.nn.Module) -> bool:
    """Whether `install_checkpoint_offload` armed `model` or a module inside it."""
    return isinstance(model, torch.nn.Module) and any(_STATE in m.__dict__ for m in model.modules())
