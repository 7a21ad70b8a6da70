"""RollingBuffer: a preallocated, per-device workspace arena that kernels borrow scratch tensors from; public as
`tigon.memory.RollingBuffer` and `tigon.memory.workspace` (docs/memory/rolling_buffer.md).

A stack allocator over one backing byte block: `borrow` bumps a top offset, returning the loan pops it,
so the same sequence of borrows returns the same addresses every step (safe inside CUDA-graph capture)
and a borrow that fits allocates nothing. A borrow that does not fit grows the arena: a new, bigger block
serves it and every later borrow, while the old block stays alive until its loans are returned.

Scratch is stream-ordered on the stream current when the loan is used: a returned loan may be handed to
the next kernel at once, which is safe on one stream (kernels run in order); work on another stream
must synchronize before the loan is returned. Imports torch and the stdlib only (`tigon.ops` uses it).

A block larger than `keep_bytes` (64 MiB by default: a chunk of logits, not a kernel's partial sums) goes back to
PyTorch's caching allocator when its last loan returns, so that the backward pass's activations can use the bytes
the fused loss's chunk held; the next call takes them from the allocator's cache. `reserve` and `size_hint_bytes`
keep what they ask for.

A loan's bytes may go to the next borrower, and an outgrown block is freed when its last loan returns: neither
holds for scratch that a CUDA graph captures (a replay writes the captured address long after the loan) or that
keeps state between calls (decode_linear's split-K arrival counters, zero between calls). Those are `pinned`
buffers of the same arena: one named tensor per (name, dtype, stream), the same address on every call that fits,
grown only when a call needs more, and every buffer it ever handed out kept alive until `release()`.
"""

import math
import operator
import threading
import warnings

import torch

_NAME = "RollingBuffer"
# Past 10 MiB, CUDA's caching allocator gives a request its own segment rounded up to 2 MiB: rounding a
# growth to 2 MiB there costs nothing and leaves slack for slightly larger steps.
_LARGE, _LARGE_ROUND = 10 << 20, 2 << 20


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _contiguous_strides(shape: tuple) -> tuple:
    if len(shape) <= 1:
        return (1,) * len(shape)
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _parse_spec(i: int, spec) -> tuple:
    """`(shape, dtype)` -> (shape, dtype, nbytes, strides), with errors naming the argument."""
    if type(spec) is tuple and len(spec) == 2:  # the common case in ~0.6 us instead of ~2.4 us
        shape, dtype = spec
        shape = (shape,) if type(shape) is int else shape
        if type(dtype) is torch.dtype and type(shape) in (tuple, torch.Size) and all(
            type(d) is int and d >= 0 for d in shape
        ):
            return tuple(shape), dtype, math.prod(shape) * dtype.itemsize, _contiguous_strides(shape)
    arg = f"{_NAME}.borrow: spec {i}"
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise TypeError(f"{arg} must be a (shape, dtype) pair, got {spec!r}")
    shape, dtype = spec
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{arg}: dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    dims = (shape,) if isinstance(shape, int) or hasattr(shape, "__index__") else shape
    try:
        if isinstance(dims, (str, bytes)) or any(isinstance(d, bool) for d in dims):
            raise TypeError
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise TypeError(f"{arg}: shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{arg}: shape must not be negative, got {dims}")
    return dims, dtype, math.prod(dims) * dtype.itemsize, _contiguous_strides(dims)


class _Block:
    """One backing allocation: `raw` bytes, usable from the aligned offset `base` for `capacity` bytes."""

    __slots__ = ("raw", "base", "capacity", "frames", "typed")

    def __init__(self, device: torch.device, capacity: int, alignment: int):
        # Never an inference tensor, so loans taken under inference_mode stay usable outside it.
        with torch.inference_mode(False):
            # CUDA's caching allocator aligns to 512 bytes, CPU's to 64: pad by `alignment` where needed.
            pad = 0 if device.type == "cuda" else alignment
            self.raw = torch.empty(_round_up(capacity + pad, 16), dtype=torch.uint8, device=device)
            if not pad and self.raw.data_ptr() % alignment:
                self.raw = None
                self.raw = torch.empty(_round_up(capacity + alignment, 16), dtype=torch.uint8, device=device)
        self.base = (-self.raw.data_ptr()) % alignment
        self.capacity = capacity
        self.frames: list = []  # live (start, end) byte ranges, in increasing order
        self.typed: dict = {}  # dtype -> self.raw.view(dtype), built once

    def top(self) -> int:
        return self.frames[-1][1] if self.frames else 0


class _Loan:
    """The context manager `borrow` returns: takes the views on enter, gives them back on exit."""

    __slots__ = ("_buf", "_specs", "_frame")

    def __init__(self, buf: "RollingBuffer", specs: list):
        self._buf, self._specs, self._frame = buf, specs, None

    def __enter__(self) -> tuple:
        if self._frame is not None:
            raise RuntimeError(f"{_NAME}.borrow: this loan is already active; call borrow() again")
        views, self._frame = self._buf._take(self._specs)
        return views

    def __exit__(self, *exc) -> None:
        frame, self._frame = self._frame, None
        self._buf._give_back(frame)


class RollingBuffer:
    """A workspace arena on `device` that lends views by (shape, dtype) inside a `with` block.

    `size_hint_bytes` preallocates the first block (0: allocate on the first borrow). Every view starts on
    an `alignment`-byte boundary (a power of two >= 16). A block larger than `keep_bytes` (and than what
    `reserve` or `size_hint_bytes` asked for) is freed when its last loan returns. Thread-safe; addresses are
    repeatable for a repeated sequence of borrows from one thread at a time that stay within `keep_bytes`.
    """

    def __init__(self, device, size_hint_bytes: int = 0, alignment: int = 256, keep_bytes: int = 64 << 20):
        self.device = _canonical(device)
        if isinstance(size_hint_bytes, bool) or not isinstance(size_hint_bytes, int) or size_hint_bytes < 0:
            raise ValueError(f"{_NAME}: size_hint_bytes must be an int >= 0, got {size_hint_bytes!r}")
        if isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int) or keep_bytes < 0:
            raise ValueError(f"{_NAME}: keep_bytes must be an int >= 0, got {keep_bytes!r}")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 16 or (
            alignment & (alignment - 1)
        ):
            raise ValueError(f"{_NAME}: alignment must be a power of two >= 16, got {alignment!r}")
        self.alignment, self.keep_bytes = alignment, keep_bytes
        self._lock = threading.Lock()
        self._block: _Block | None = None
        self._retired: list = []  # outgrown blocks kept alive until their last loan returns
        self._in_use = self._peak = self._loans = self._avoided = self._grows = 0
        self._pinned: dict = {}  # (name, dtype, stream) -> tensor
        self._pinned_old: list = []  # outgrown pinned tensors: a captured graph may still write them
        self._pinned_calls = self._pinned_hits = 0
        if size_hint_bytes:
            self.reserve(size_hint_bytes)

    def borrow(self, *specs) -> _Loan:
        """`with ws.borrow((shape, dtype), ...) as (a, ...)`: contiguous, uninitialized, aligned views,
        valid inside the block only and returned on exit (exceptions included). Nested borrows stack."""
        return _Loan(self, [_parse_spec(i, s) for i, s in enumerate(specs)])

    def reserve(self, nbytes: int) -> None:
        """Grow now, outside any hot loop or graph capture, so that borrows of up to `nbytes` in all fit; the
        arena keeps that much between loans from then on (`keep_bytes` rises to it)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"{_NAME}.reserve: nbytes must be an int >= 0, got {nbytes!r}")
        with self._lock:
            self.keep_bytes = max(self.keep_bytes, nbytes)
            if self._block is None or self._block.capacity - self._block.top() < nbytes:
                self._grow(nbytes)

    def pinned(self, name: str, numel: int, dtype: torch.dtype, *, zeros: bool = False) -> torch.Tensor:
        """The arena's 1-D `dtype` buffer `name` on the current stream with at least `numel` elements: the same
        tensor for every call that fits (a stable address for CUDA-graph replay, nothing allocated), a bigger
        one (zero-filled with zeros=True, as the first) when a call needs more; the old one stays alive until
        `release()`, since a captured graph may still use it. The caller owns its contents between calls."""
        stream = torch.cuda.current_stream(self.device).stream_id if self.device.type == "cuda" else 0
        key = (name, dtype, stream)
        with self._lock:
            self._pinned_calls += 1
            buf = self._pinned.get(key)
            if buf is not None and buf.numel() >= numel:
                self._pinned_hits += 1
                return buf
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                warnings.warn(f"{_NAME}: pinned buffer {name!r} grows during CUDA graph capture; warm up first",
                              RuntimeWarning, stacklevel=2)
            if buf is not None:
                self._pinned_old.append(buf)
                numel = max(numel, 2 * buf.numel())  # doubling: a few grows for any sequence of sizes
            with torch.inference_mode(False):
                make = torch.zeros if zeros else torch.empty
                buf = self._pinned[key] = make(numel, dtype=dtype, device=self.device)
            return buf

    def stats(self) -> dict:
        """Bytes reserved (all live blocks), in use and peak in use (padding included), loans (views lent
        so far), allocations avoided (views served without allocating), grows, active borrows, blocks; for the
        pinned buffers: bytes held (outgrown ones included), calls, and calls served without allocating."""
        with self._lock:
            blocks = self._retired + ([self._block] if self._block is not None else [])
            pinned = list(self._pinned.values()) + self._pinned_old
            return dict(
                reserved_bytes=sum(b.raw.numel() for b in blocks), in_use_bytes=self._in_use,
                peak_in_use_bytes=self._peak, loans=self._loans, allocations_avoided=self._avoided,
                grows=self._grows, active_borrows=sum(len(b.frames) for b in blocks), blocks=len(blocks),
                pinned_bytes=sum(t.numel() * t.element_size() for t in pinned), pinned_calls=self._pinned_calls,
                pinned_hits=self._pinned_hits,
            )

    def reset_peak(self) -> None:
        with self._lock:
            self._peak = self._in_use

    def release(self) -> None:
        """Drop the backing memory (to PyTorch's caching allocator on CUDA), pinned buffers included (no CUDA
        graph that captured an op using them may replay after this); refused while loans are out."""
        with self._lock:
            out = sum(len(b.frames) for b in self._retired + ([self._block] if self._block else []))
            if out:
                raise RuntimeError(f"{_NAME}.release: {out} loan(s) still out; return them first")
            for block in self._retired + ([self._block] if self._block else []):
                self._drop(block)
            self._block, self._retired = None, []
            self._pinned, self._pinned_old = {}, []

    def _drop(self, block: _Block) -> None:
        # The caching allocator would hand the bytes out again on the stream the block was allocated on;
        # record the current stream so that reuse also waits for the kernels queued here that used it.
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            block.raw.record_stream(torch.cuda.current_stream(self.device))

    def _grow(self, need: int) -> None:
        old = self._block
        # Room for everything lent now plus the request, so the next identical step fits in one block.
        cap = self._in_use + need
        cap = _round_up(cap, _LARGE_ROUND if cap > _LARGE and self.device.type == "cuda" else self.alignment)
        if old is not None:
            cap = max(cap, old.capacity)
            if old.frames:
                self._retired.append(old)
            else:
                self._drop(old)  # an idle old block is freed before the new one is allocated
            self._block = old = None
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            warnings.warn(f"{_NAME}: growing to {cap} bytes during CUDA graph capture; warm up first "
                          "or call reserve()", RuntimeWarning, stacklevel=4)
        self._block = _Block(self.device, cap, self.alignment)
        self._grows += 1

    def _take(self, specs: list) -> tuple:
        align = self.alignment
        offsets, size = [], 0
        for spec in specs:
            offsets.append(size)
            size += -(-spec[2] // align) * align
        with self._lock:
            block = self._block
            grew = size > 0 and (block is None or block.capacity - block.top() < size)
            if grew:
                self._grow(size)
                block = self._block
            start = block.top() if block is not None else 0
            frame = (block, start, start + size)
            if size:
                block.frames.append((start, start + size))
            self._in_use += size
            self._peak = max(self._peak, self._in_use)
            self._loans += len(specs)
            self._avoided += 0 if grew else len(specs)
            views = []
            for (shape, dtype, nbytes, strides), off in zip(specs, offsets, strict=True):
                if nbytes == 0:  # no bytes, no address: a plain empty tensor never touches the allocator
                    views.append(torch.empty(shape, dtype=dtype, device=self.device))
                    continue
                typed = block.typed.get(dtype)
                if typed is None:
                    typed = block.typed[dtype] = block.raw.view(dtype)
                first = (block.base + start + off) // dtype.itemsize
                views.append(typed.as_strided(shape, strides, first))
            return tuple(views), frame

    def _give_back(self, frame: tuple) -> None:
        block, start, end = frame
        if end == start:
            return
        with self._lock:
            block.frames.remove((start, end))
            self._in_use -= end - start
            if block.frames:
                return
            if block is not self._block:
                self._retired.remove(block)  # its last loan is back: the outgrown block can go
                self._drop(block)
            elif block.capacity > self.keep_bytes:  # large scratch goes back to the caching allocator
                self._drop(block)
                self._block = None


def _canonical(device) -> torch.device:
    """'cuda' -> 'cuda:<current>' (an arena never follows the current device), 'cpu:0' -> 'cpu'."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if device.type == "cpu" else device


_workspaces: dict = {}
_workspaces_lock = threading.Lock()


def workspace(device) -> RollingBuffer:
    """The default arena of `device` (created on first use, one per device, thread-safe)."""
    device = _canonical(device)
    ws = _workspaces.get(device)
    if ws is None:
        with _workspaces_lock:
            ws = _workspaces.setdefault(device, RollingBuffer(device))
    return ws


def split_scratch(device, name: str, numel: int, dtype: torch.dtype, *, least: int = 0, zeros: bool = False,
                  per_call: bool = False) -> torch.Tensor:
    """Scratch of a split-K launch (partial sums, arrival counters the kernel leaves at zero): the arena's pinned
    buffer `name`, at least `least` elements (one size for every projection of a model), when per_call is False;
    with per_call, a fresh tensor of `numel` (zero-filled with zeros) that the caller's call frees. The custom ops
    that torch.compile puts in its graphs take per-call scratch: a graph compiled with CUDA graphs
    (mode="reduce-overhead") runs its warm-up inside the graphs' memory pool and refuses a tensor allocated there
    that outlives the call, which a pinned buffer's first allocation would be."""
    if per_call:
        return (torch.zeros if zeros else torch.empty)(numel, dtype=dtype, device=device)
    return workspace(device).pinned(name, max(numel, least), dtype, zeros=zeros)
