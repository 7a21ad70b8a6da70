"""Sequence-tiled layers: a row-independent function (a decoder layer's MLP with its LoRA adapters) run over tiles
of the tokens, so its working set is one tile's however long the sequence (docs/memory/tiling.md).

`tiled_apply(fn, x, tile_tokens)` is y = fn(x) for x [..., T, H], computed tile by tile along T. With a gradient
wanted it is one autograd node that keeps x only: the forward runs the tiles under no_grad; the backward runs each
tile again with grad, back-propagates that tile's rows of dy, writes the tile's rows of dx and adds the tile's
parameter gradients (in fp32 for 16-bit parameters, tiles in order: deterministic, and one rounding to the
parameter's dtype at the end, as the untiled GEMM's fp32 accumulator does).

Parameter gradients are outputs of the node, not sums written into `.grad` from inside a backward (Liger's and
Arctic's TiledMLP): autograd then sees one gradient per parameter per backward, so DDP's reducer, post-accumulate
hooks, gradient accumulation and `torch.autograd.grad(loss, params)` see what the untiled module gives them. The
price is an fp32 sum of the trainable parameters of `fn` while its backward runs (LoRA: a few MiB; a full
fine-tune's MLP: 4 bytes a parameter for that one layer).

Under non-reentrant activation checkpointing (Hugging Face's default) x is kept by a separate identity node ahead
of the tiles, so the checkpoint's recompute stops at x (torch's early stop) instead of running every tile's
forward once more: the MLP runs forward twice a step, as untiled with checkpointing. RNG state (LoRA dropout)
and autocast are replayed in the recompute, as torch.utils.checkpoint does.

`install_tiled_mlp(model)` puts this behind each decoder layer's `.mlp` (instance-level; HF's MLPs, Tigon's
SwiGLUMLP/GeGLUMLP, PEFT-wrapped projections). MoE blocks (an `experts` child) are left alone: their router
outputs are recorded per call and would be per tile.
"""

import contextlib
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Optional, Union

import torch
from torch import nn

from ..ops._library import tracing

# "auto": the tile's MLP intermediates take at most this share of the device's free memory, read once an install
AUTO_TILE_FRACTION = 1 / 16
# I-wide [tokens, I] tensors alive per token while a tile's backward runs: gate, up, the product h and dh
AUTO_ACTS_PER_TOKEN = 4
# tile lengths a multiple of this (whole GEMM tiles, aligned rows) and at least it
TILE_ALIGN = 256
# "auto" on a CPU, where free memory says little about what the host can spare
CPU_AUTO_TILE_TOKENS = 4096
_MARK = "_tigon_tiled_mlp"


def _check_tile_tokens(caller: str, tile_tokens, allow_auto: bool):
    if allow_auto and isinstance(tile_tokens, str):
        if tile_tokens != "auto":
            raise ValueError(f"{caller}: tile_tokens must be a positive int or 'auto', got {tile_tokens!r}")
        return tile_tokens
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, numbers.Integral):
        expected = "a positive int or 'auto'" if allow_auto else "a positive int"
        raise TypeError(f"{caller}: tile_tokens must be {expected}, got {type(tile_tokens).__name__}")
    if tile_tokens < 1:
        raise ValueError(f"{caller}: tile_tokens must be a positive int, got {tile_tokens}")
    return int(tile_tokens)


def auto_tile_tokens(intermediate_size: int, element_size: int, free_bytes: Optional[int], *,
                     rows_per_token: int = 1) -> int:
    """The "auto" tile length: the most tokens whose AUTO_ACTS_PER_TOKEN intermediates of width
    `intermediate_size` (`element_size` bytes each, `rows_per_token` rows a token: the batch) fit in
    AUTO_TILE_FRACTION of `free_bytes`, rounded down to TILE_ALIGN and at least TILE_ALIGN.
    free_bytes None (a CPU) gives CPU_AUTO_TILE_TOKENS."""
    if free_bytes is None:
        return CPU_AUTO_TILE_TOKENS
    per_token = AUTO_ACTS_PER_TOKEN * max(int(intermediate_size), 1) * element_size * max(int(rows_per_token), 1)
    tokens = int(free_bytes * AUTO_TILE_FRACTION) // per_token
    return max(TILE_ALIGN, tokens // TILE_ALIGN * TILE_ALIGN)


def shard_tile_tokens(tokens: int, num_shards: int) -> int:
    """The tile length that cuts `tokens` into `num_shards` tiles as torch.chunk does: ceil(tokens / shards)
    (fewer tiles where that rounds up: 4 tokens in 3 shards are tiles of 2), at least 1; num_shards < 1 is 1."""
    return max(1, -(-int(tokens) // max(1, int(num_shards))))


def _spans(length: int, tile: int):
    return [(s, min(s + tile, length)) for s in range(0, length, tile)]


def _run_tiles(fn, x, tile, caller):
    """fn over the tiles of x along dim -2, written into one output (no concatenation copy of all tiles)."""
    out = None
    for s, e in _spans(x.shape[-2], tile):
        x_t = x[..., s:e, :]
        y_t = fn(x_t)
        if not isinstance(y_t, torch.Tensor):
            raise TypeError(f"{caller}: fn must return a tensor, got {type(y_t).__name__}")
        if y_t.shape[:-1] != x_t.shape[:-1]:
            raise ValueError(f"{caller}: fn must keep the leading dims of its input [..., T, H], got "
                             f"{tuple(y_t.shape)} from {tuple(x_t.shape)}")
        if y_t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{caller}: fn uses a tensor that requires grad and is not in params; pass it in "
                             "params so its gradient is kept")
        if out is None:
            out = torch.empty(x.shape[:-1] + y_t.shape[-1:], dtype=y_t.dtype, device=y_t.device)
        out[..., s:e, :].copy_(y_t)
    return out


class _CallState:
    """The RNG and autocast state at the forward, replayed around the backward's recompute."""

    def __init__(self, device: torch.device, preserve_rng_state: bool):
        self.device = device
        kinds = (device.type,) if device.type == "cpu" else (device.type, "cpu")
        self.autocast = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                         for k in kinds if torch.amp.is_autocast_available(k)]
        self.cache = torch.is_autocast_cache_enabled()
        self.rng = None
        if preserve_rng_state:
            accel = None if device.type == "cpu" else torch.get_device_module(device.type).get_rng_state(device)
            self.rng = (torch.get_rng_state(), accel)

    @contextlib.contextmanager
    def replay(self):
        with contextlib.ExitStack() as stack:
            if self.rng is not None:
                devices = [] if self.device.type == "cpu" else [self.device]
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type=self.device.type))
                torch.set_rng_state(self.rng[0])
                if self.rng[1] is not None:
                    torch.get_device_module(self.device.type).set_rng_state(self.rng[1], self.device)
            for kind, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=self.cache))
            stack.enter_context(torch.enable_grad())
            yield


class _KeepInput(torch.autograd.Function):
    """Identity that keeps x for the tiles' backward. A custom Function's saved tensors are packed after its
    forward returns; kept here, ahead of the tiles, x is the last tensor a checkpointed layer packs, and the
    checkpoint's recompute stops there instead of after one more forward of every tile."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx


def _foreign_leaf(y, allowed):
    """A leaf that requires grad, reached from y's graph, that is not one of the tensors `allowed`, or None. The
    walk stops at the allowed tensors' own nodes (a parameter computed from others is an input, not a leaf)."""
    ids, stops = {id(t) for t in allowed}, {t.grad_fn for t in allowed if t.grad_fn is not None}
    stack, seen = [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if var is not None:
            if id(var) not in ids:
                return var
            continue
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return None


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, x, tile, preserve_rng_state, kept, *params):
        ctx.fn, ctx.tile, ctx.params = fn, tile, params  # parameters by reference: leaves, and unsaved, so a
        # checkpoint's recompute has nothing of this node to wait for
        ctx.keeper = x.grad_fn if kept else None
        if not kept:
            ctx.save_for_backward(x)
        ctx.state = _CallState(x.device, preserve_rng_state)
        with torch.no_grad():
            return _run_tiles(fn, x, tile, "tigon.memory.tiled_apply")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.keeper.saved_tensors if ctx.keeper is not None else ctx.saved_tensors
        ctx.keeper = None
        x = x.detach()
        need_x = ctx.needs_input_grad[1]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[5:]) if need]
        dx = torch.empty_like(x) if need_x else None
        sums = [None] * len(ctx.params)
        with ctx.state.replay():
            for k, (s, e) in enumerate(_spans(x.shape[-2], ctx.tile)):
                # a view of x, as the untiled module's input is a non-leaf: autocast caches the cast of a leaf
                # that is not a view, which would sum dx of the MLP's two uses in bf16, not in x's dtype
                x_t = x[..., s:e, :].requires_grad_(need_x)
                y_t = ctx.fn(x_t)
                inputs = ([x_t] if need_x else []) + [ctx.params[i] for i in wanted]
                if k == 0 and y_t.requires_grad:
                    leaf = _foreign_leaf(y_t, (x_t, *ctx.params))
                    if leaf is not None:
                        raise ValueError(f"tigon.memory.tiled_apply: fn uses a tensor of shape {tuple(leaf.shape)} "
                                         "that requires grad and is not in params; pass it in params so its "
                                         "gradient is kept")
                got = (torch.autograd.grad(y_t, inputs, dy[..., s:e, :], allow_unused=True) if y_t.requires_grad
                       else [None] * len(inputs))
                if need_x:
                    g, got = got[0], got[1:]
                    if g is None:
                        dx[..., s:e, :].zero_()
                    else:
                        dx[..., s:e, :].copy_(g)
                for i, g in zip(wanted, got):
                    if g is None:
                        continue
                    if sums[i] is None:  # a copy: autograd may hand back dy itself (y = x_t + p)
                        sums[i] = g.to(torch.promote_types(g.dtype, torch.float32), copy=True)
                    else:
                        sums[i].add_(g)
                del y_t, got
        param_grads = [None if t is None else t.to(p.dtype) for t, p in zip(sums, ctx.params)]
        return (None, dx, None, None, None, *param_grads)


def _module_params(fn) -> list:
    owner = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    return list(owner.parameters()) if isinstance(owner, nn.Module) else []


def tiled_apply(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile_tokens: int, *,
                params: Optional[Iterable[torch.Tensor]] = None, preserve_rng_state: bool = True) -> torch.Tensor:
    """y = fn(x) computed over tiles of `tile_tokens` along dim -2 of x [..., T, H] (packed rows: [1, T, H]); fn
    must treat rows independently and return [..., t, H_out] for [..., t, H]. With a gradient wanted, the
    backward recomputes each tile and returns dx and the gradients of `params` (default: the trainable
    parameters of fn, an nn.Module or a bound method of one); a trainable tensor fn uses that is not in params is
    an error, not a silently lost gradient. T <= tile_tokens (and torch.compile tracing) runs fn(x) as it is.
    Not twice differentiable."""
    caller = "tigon.memory.tiled_apply"
    if not callable(fn):
        raise TypeError(f"{caller}: fn must be callable, got {type(fn).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{caller}: x must be a tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{caller}: x must have shape [..., T, H], got {tuple(x.shape)}")
    tile = _check_tile_tokens(caller, tile_tokens, allow_auto=False)
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"{caller}: preserve_rng_state must be a bool, got {type(preserve_rng_state).__name__}")
    params = _module_params(fn) if params is None else list(params)
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError(f"{caller}: params must be tensors")
    if x.shape[-2] <= tile or tracing():
        return fn(x)
    unique = {id(p): p for p in params if p.requires_grad}
    params = list(unique.values())
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return _run_tiles(fn, x, tile, caller)
    kept = x.requires_grad
    return _TiledFunction.apply(fn, _KeepInput.apply(x) if kept else x, tile, preserve_rng_state, kept, *params)


class _TilePlan:
    """The tile length of one install_tiled_mlp call: a fixed int, or "auto", whose free-memory budget is read
    once, at the first call in training (the model is on its device by then), so every later step tiles the same
    way."""

    __slots__ = ("tile_tokens", "free_bytes", "read", "last")

    def __init__(self, tile_tokens):
        self.tile_tokens, self.free_bytes, self.read, self.last = tile_tokens, None, False, None

    def tokens(self, x: torch.Tensor, intermediate_size: int) -> int:
        self.last = self._tokens(x, intermediate_size)
        return self.last

    def _tokens(self, x: torch.Tensor, intermediate_size: int) -> int:
        if self.tile_tokens != "auto":
            return self.tile_tokens
        if not self.read:
            self.free_bytes, self.read = _free_bytes(x.device), True
        kind = x.device.type
        autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
        return self.peek(x.device, dtype.itemsize, math.prod(x.shape[:-2]), intermediate_size)

    def peek(self, device: torch.device, itemsize: int, rows: int, intermediate_size: int) -> int:
        """The tile a call of `rows` rows would take now, without recording a read: "auto" over the free memory
        read at the first call, or over what is free now before it."""
        if self.tile_tokens != "auto":
            return self.tile_tokens
        free = self.free_bytes if self.read else _free_bytes(device)
        return auto_tile_tokens(intermediate_size, itemsize, free, rows_per_token=rows)


def _free_bytes(device: torch.device) -> Optional[int]:
    """Free memory of a CUDA device for this process; None elsewhere (the CPU's fixed "auto" tile)."""
    return card_free_bytes(device) if device.type == "cuda" else None


def process_cap_bytes(device: torch.device) -> int:
    """What this process's allocator may reserve on a CUDA device: the card's total, or less under
    `torch.cuda.set_per_process_memory_fraction` (how a smaller card is emulated, or a card shared on purpose)."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    return int(total * min(1.0, fraction))


def card_free_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device that this process can still reserve: the driver's free bytes, at most the
    process cap less what its allocator already reserved."""
    free, _ = torch.cuda.mem_get_info(device)
    return max(0, min(free, process_cap_bytes(device) - torch.cuda.memory_reserved(device)))


class _TiledMLPForward:
    """The forward install_tiled_mlp sets on one MLP instance: in training with more than a tile of tokens, the
    MLP's own forward (`inner`, or the class's) over tiles; otherwise that forward as it is."""

    # slots, not a __dict__: functools.wraps of a later wrapper (accelerate's hooks) copies a __dict__ over
    __slots__ = ("module", "inner", "plan", "intermediate_size", "active")

    def __init__(self, module, inner, plan, intermediate_size):
        self.module, self.inner, self.plan = module, inner, plan
        self.intermediate_size, self.active = intermediate_size, True

    def _forward(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if tracing() or not (self.active and self.module.training):
            return self._forward(*args, **kwargs)
        if len(args) + len(kwargs) != 1:
            return self._forward(*args, **kwargs)
        key = next(iter(kwargs), None)
        x = args[0] if key is None else kwargs[key]
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self._forward(*args, **kwargs)
        tile = self.plan.tokens(x, self.intermediate_size)
        if x.shape[-2] <= tile:
            return self._forward(*args, **kwargs)

        def fn(t):
            return self._forward(t) if key is None else self._forward(**{key: t})

        return tiled_apply(fn, x, tile, params=[p for p in self.module.parameters() if p.requires_grad])

    def __repr__(self):
        return f"<tigon tiled forward of {type(self.module).__name__}, tile_tokens={self.plan.tile_tokens!r}>"


def _intermediate_size(mlp: nn.Module) -> int:
    size = getattr(mlp, "intermediate_size", None)
    if isinstance(size, int) and size > 0:
        return size
    widths = [w for m in mlp.modules() for w in (getattr(m, "out_features", None), getattr(m, "in_features", None))
              if isinstance(w, int)]
    return max(widths, default=1)


def _mlp_modules(model: nn.Module) -> list:
    """Each distinct dense `.mlp` child in the model (MoE blocks, which have `experts`, and MLPs inside another
    found MLP are left out)."""
    found, inside = [], set()
    for parent in model.modules():
        mlp = parent._modules.get("mlp")
        if mlp is None or id(mlp) in inside or "experts" in mlp._modules:
            continue
        found.append(mlp)
        inside.update(id(m) for m in mlp.modules())
    return found


def install_tiled_mlp(model: nn.Module, *, tile_tokens: Union[int, str] = "auto") -> int:
    """Run each decoder layer's `.mlp` over tiles of `tile_tokens` tokens when the module is training and the
    sequence is longer than a tile (with or without a gradient: a reentrant checkpoint's first pass is no-grad);
    eval, short sequences and torch.compile tracing run the MLP as it is. "auto": the longest tile whose
    intermediates take at most AUTO_TILE_FRACTION of the free device memory at the first call in training
    (auto_tile_tokens; CPU_AUTO_TILE_TOKENS on a CPU). Install after anything that replaces the MLP modules
    (tigon.patch). Again on an installed model: the new tile length. Returns how many MLPs tile."""
    caller = "tigon.memory.install_tiled_mlp"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}")
    tile_tokens = _check_tile_tokens(caller, tile_tokens, allow_auto=True)
    targets = _mlp_modules(model)
    if not targets:
        raise ValueError(f"{caller}: {type(model).__name__} has no layer with a dense `.mlp` module to tile "
                         "(MoE blocks are not tiled)")
    plan = _TilePlan(tile_tokens)
    for mlp in targets:
        wrapper = mlp.__dict__.get(_MARK)
        if wrapper is not None:
            wrapper.plan, wrapper.active = plan, True
            continue
        inner = mlp.__dict__.get("forward")
        if getattr(inner, "__self__", None) is mlp and getattr(inner, "__func__", None) is type(mlp).forward:
            inner = None  # the class forward bound to the instance: call it as such (a bound method pickles by name)
        wrapper = _TiledMLPForward(mlp, inner, plan, _intermediate_size(mlp))
        mlp.__dict__[_MARK] = wrapper
        mlp.__dict__["forward"] = wrapper
    return len(targets)


def uninstall_tiled_mlp(model: nn.Module) -> int:
    """Undo install_tiled_mlp: each MLP gets back the forward it had. A forward another library set over the
    tiled one since stays, and the tiled one under it passes calls through. Returns how many MLPs it undid."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"tigon.memory.uninstall_tiled_mlp: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    undone = 0
    for mlp in model.modules():
        wrapper = mlp.__dict__.pop(_MARK, None)
        if wrapper is None:
            continue
        wrapper.active = False
        undone += 1
        if mlp.__dict__.get("forward") is wrapper:
            if wrapper.inner is None:
                del mlp.__dict__["forward"]
            else:
                mlp.__dict__["forward"] = wrapper.inner
    return undone


def tiled_mlp_tile_tokens(model: nn.Module) -> Optional[int]:
    """The tile length the installed MLPs of `model` chose at their last call in training ("auto" resolved; a
    sequence no longer than it ran whole), None before the first or where none is installed."""
    for mlp in _mlp_modules(model):
        wrapper = mlp.__dict__.get(_MARK)
        if wrapper is not None and wrapper.active and wrapper.plan.last is not None:
            return wrapper.plan.last
    return None


def tiled_mlp_installed(model: nn.Module) -> bool:
    """Whether install_tiled_mlp is in effect on any MLP of the model."""
    return any(isinstance(m.__dict__.get(_MARK), _TiledMLPForward) for m in model.modules())


__all__ = ["AUTO_TILE_FRACTION", "CPU_AUTO_TILE_TOKENS", "auto_tile_tokens", "install_tiled_mlp", "shard_tile_tokens",
           "tiled_mlp_tile_tokens",
           "tiled_apply", "tiled_mlp_installed", "uninstall_tiled_mlp"]
