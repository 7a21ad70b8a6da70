"""RollingKVCache: a fixed ring-buffer KV cache for Hugging Face `generate` (transformers >= 5.17 Cache API).

Each layer owns two preallocated `[batch, kv_heads, ring, head_dim]` buffers written in place (allocated at
construction, or at the layer's first update when the cache follows the model's dtype and device). The token at
absolute position p lives in slot `p` while p < sink_tokens (attention sinks, kept forever, StreamingLLM)
and in slot `sink + (p - sink) % (ring - sink)` after that, so while the sequence fits slot == position and
the cache is an exact full-attention cache; past the ring the oldest non-sink token is overwritten (a
sliding window). Sliding-window layers (Mistral, Gemma-2's local layers) get `ring = min(capacity, window)`
and no sinks: the window is all they may attend, which makes them exact past capacity too. A full-attention layer
refuses a multi-token chunk (a prompt) that overflows its ring unless the window is asked for (`sliding=True` or
`sink_tokens`): the model would silently attend less than it was trained to.

Hugging Face builds the attention mask from `get_mask_sizes` as if key j sat at position `kv_offset + j`.
The ring satisfies that contract in three cases, chosen by host integers that depend on shapes only:
- fits (seen + q <= ring): slot == position. A decode step returns the whole ring, mask sizes (ring, 0): one
  shape for every step (CUDA graphs); a chunk (prefill) returns the slots written so far, sizes (seen + q, 0).
  Exact.
- decode past the ring (q == 1): write one slot, return the whole ring in slot order with sizes
  (ring, seen - ring + 1). HF's mask is then all-true (every slot is inside the window), and attention is
  order-free, so slot order is harmless. Decode allocates nothing: the slot index is computed on the device
  into a preallocated tensor, then `index_copy_` writes the new K/V only; no host sync.
- a multi-token chunk past the ring (long prefill, chat continuation): return the cached tokens gathered in
  position order followed by the chunk (a temporary, as HF's sliding layers do), sizes
  (cached + q, seen - cached), then keep the chunk's survivors in the ring.
Limits (see docs/memory/kv_cache.md): past the ring the 2-D padding mask is applied by position, not slot,
so rows whose left padding is still inside the ring are not exact; chunked attention and linear-attention
layers are refused; beam search reorders in place, other batch reshaping is refused.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..ops.reference import ring_slot

_NAME = "RollingKVCache"
_SUPPORTED = ("full_attention", "sliding_attention")


def _resolve_dtype(dtype, config) -> torch.dtype:
    given = dtype
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):  # "bfloat16" or "torch.bfloat16", as configs and from_pretrained spell it
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        where = "dtype" if given is not None else "config.dtype"
        raise TypeError(f"{_NAME}: {where} must be a floating torch.dtype, got "
                        f"{given if given is not None else dtype!r}")
    return dtype


def _resolve_device(device) -> torch.device:
    if device is None:
        device = torch.get_default_device()
    elif not isinstance(device, (str, int, torch.device)) or isinstance(device, bool):
        raise TypeError(f"{_NAME}: device must be a torch.device, a str such as 'cuda:0' or a CUDA index, "
                        f"got {type(device).__name__} {device!r}")
    try:
        # "cuda" -> "cuda:0", so the update check compares equal; also proves the device exists
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError, ValueError) as e:
        raise ValueError(f"{_NAME}: device {device!r} is not usable here: {e}") from None


def _config_shape(config):
    """(kv_heads, head_dim) of a decoder config, with an error naming what is missing."""
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(getattr(config, "num_hidden_layers", None), int) or not isinstance(heads, int):
        raise ValueError(f"{_NAME}: config ({type(config).__name__}) has no num_hidden_layers / "
                         "num_attention_heads: pass the model's config (model.config) of a decoder-only LM")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None:
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int) or hidden % heads:
            raise ValueError(f"{_NAME}: config ({type(config).__name__}) has no head_dim and its hidden_size "
                             f"{hidden!r} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    return kv_heads, head_dim


def _positive_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_NAME}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{_NAME}: {name} must be >= {minimum}, got {value}")
    return value


def _layer_storage(batch, heads, head_dim, rings, sinks, dtype, device):
    """(per layer, (positions, state)): per layer i (ring_i slots, sinks_i of them kept) (keys, values, positions,
    next, slot, consts), views of one buffer of each kind (a few kernels to build a cache, not six per layer), and
    the whole positions and `[layers, (next, slot)]` state buffers. keys and values are zeros, not
    garbage: HF's attention over the whole ring (attention="hf") multiplies masked slots by 0; positions are
    -1 (empty); next (the next absolute position) and slot (the decode step's) are zero counters updated in
    place; consts are the decode step's int64 constants (sink, recent, 1) as device tensors, one
    host-to-device copy per distinct ring shape (a Python scalar operand would be a fresh 8-byte tensor per op)."""
    per = [batch * heads * r * head_dim for r in rings]
    kv = torch.zeros(2 * sum(per), dtype=dtype, device=device)
    # Each layer's positions start 16-byte aligned (an even int64 offset): Triton specializes a pointer argument on
    # 16-byte alignment, so an odd ring size would compile the kernels that take them once more at a new capacity.
    spans = [r + r % 2 for r in rings]
    pos = torch.full((sum(spans),), -1, dtype=torch.int64, device=device)
    state = torch.zeros((len(rings), 2), dtype=torch.int64, device=device)
    consts = {}
    out, k_off, p_off = [], 0, 0
    for i, (r, span, n, sink) in enumerate(zip(rings, spans, per, sinks)):
        if (r, sink) not in consts:
            consts[r, sink] = torch.tensor([sink, r - sink, 1], dtype=torch.int64, device=device)
        keys = kv[k_off:k_off + n].view(batch, heads, r, head_dim)
        values = kv[k_off + n:k_off + 2 * n].view(batch, heads, r, head_dim)
        out.append((keys, values, pos[p_off:p_off + r], state[i, 0:1], state[i, 1:2], consts[r, sink]))
        k_off, p_off = k_off + 2 * n, p_off + span
    return out, (pos, state)


class RollingKVLayer(CacheLayerMixin):
    """One layer's ring: `keys`/`values` `[batch, kv_heads, ring, head_dim]`, `positions` `[ring]` int64 on the
    device (the absolute position held by each slot, -1 while empty). With `dtype` and `device` (or `storage`) the
    ring is allocated here; with dtype=None and device=None at the first update (or `Cache.early_initialization`),
    in the dtype and on the device of its key_states, as transformers' StaticLayer does."""

    is_compileable = True
    is_croppable = False
    supports_early_init = True

    def __init__(self, *, layer_idx, batch_size, kv_heads, head_dim, ring, sink_tokens, sliding, dtype, device,
                 storage=None, evicts=False):
        super().__init__()
        self.layer_idx, self.batch_size, self.num_heads, self.head_dim = layer_idx, batch_size, kv_heads, head_dim
        self.ring, self.sink, self.is_sliding = ring, sink_tokens, sliding
        # Whether a chunk past the ring may drop the oldest tokens: always for a sliding layer (exact), for a
        # full-attention one only when the cache was asked for a window (sliding=True or sink tokens).
        self.evicts = sliding or evicts or sink_tokens > 0
        self.recent = ring - sink_tokens  # slots that roll; the first `sink` slots never move
        self.dtype, self.device = dtype, device
        self.seen = 0  # the same count on the host, derived from shapes only (no sync): drives the branches
        self.positions = self._next = self._slot = None
        if (dtype is None) != (device is None) and storage is None:
            raise ValueError(f"{_NAME}: a layer takes both dtype and device (allocated now) or neither (allocated at "
                             f"its first update), got dtype={dtype!r}, device={device!r}")
        if storage is None and dtype is not None:
            # a layer on its own; RollingKVCache hands its layers views of shared buffers
            storage = _layer_storage(batch_size, kv_heads, head_dim, [ring], [sink_tokens], dtype, device)[0][0]
        if storage is not None:
            self._adopt(storage)

    def _adopt(self, storage) -> None:
        self.keys, self.values, self.positions, self._next, self._slot, consts = storage
        self._sink_t, self._recent_t, self._one_t = consts.split(1)
        self.is_initialized = True
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.positions, self._next, self._slot, consts):
                torch._dynamo.mark_static_address(t)

    def __repr__(self):
        kind = "sliding" if self.is_sliding else "full"
        return f"RollingKVLayer({kind}, ring={self.ring}, sink={self.sink}, seen={self.seen})"

    def lazy_initialization(self, key_states, value_states) -> None:
        """Allocate the ring in key_states' dtype, on its device (one layer at a time: a model split over devices
        gets each layer's ring where that layer runs). A no-op once allocated."""
        if self.is_initialized:
            return
        self._check_shapes(key_states, value_states)
        dtype, device = key_states.dtype, key_states.device
        if not dtype.is_floating_point:
            raise TypeError(f"{_NAME}.update: key_states must be floating point, got {dtype}")
        storage = _layer_storage(self.batch_size, self.num_heads, self.head_dim, [self.ring], [self.sink], dtype,
                                 device)[0][0]
        self.dtype, self.device = dtype, device
        self._adopt(storage)

    def _unallocated(self, what: str) -> RuntimeError:
        return RuntimeError(f"{_NAME}: {what} of layer {self.layer_idx} before its first update: a cache built "
                            "without dtype= and device= allocates each ring at its first update")

    def _views(self, batch: int):
        """keys and values of the first `batch` sequences (the tensors themselves for the whole batch)."""
        if batch == self.batch_size:
            return self.keys, self.values
        return self.keys[:batch], self.values[:batch]

    def _slots_of(self, p: torch.Tensor) -> torch.Tensor:
        """Slot of each absolute position: p below the sinks, else sink + (p - sink) % recent."""
        return ring_slot(p, self.sink, self.recent)

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Validate an update's K/V; a lazily allocated ring is allocated here, from the first one."""
        self._check_shapes(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if t.dtype != self.dtype:
                raise TypeError(f"{_NAME}.update: {name} dtype {t.dtype} does not match the cache dtype "
                                f"{self.dtype} (pass dtype= to {_NAME}, or neither dtype= nor device= to follow "
                                "the model)")
            if t.device != self.device:
                raise ValueError(f"{_NAME}.update: {name} is on {t.device}, the cache on {self.device} "
                                 f"(pass device= to {_NAME}, or neither dtype= nor device= to follow the model)")

    def _check_shapes(self, key_states, value_states) -> None:
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{_NAME}.update: {name} must be a 4-D [batch, kv_heads, seq, head_dim] tensor, "
                                 f"got {getattr(t, 'shape', type(t).__name__)}")
            b, h, _, d = t.shape
            if b > self.batch_size:
                raise ValueError(f"{_NAME}.update: {name} batch {b} is larger than the cache's batch_size "
                                 f"{self.batch_size}")
            if h != self.num_heads or d != self.head_dim:
                raise ValueError(
                    f"{_NAME}.update: {name} of layer {self.layer_idx} has kv_heads={h}, head_dim={d}, but the "
                    f"cache was built for kv_heads={self.num_heads}, head_dim={self.head_dim}: a config of "
                    "another model?")
        if key_states.shape != value_states.shape:
            raise ValueError(f"{_NAME}.update: key_states {tuple(key_states.shape)} and value_states "
                             f"{tuple(value_states.shape)} differ")

    def _check_fits(self, q: int) -> None:
        """Refuse a chunk that would drop tokens of a full-attention layer that was not asked for a window (host
        integers only: `seen` and the chunk's length come from shapes)."""
        if q == 1 or self.evicts or self.seen + q <= self.ring:
            return
        what = "a prompt" if self.seen == 0 else "a continuation"
        raise ValueError(
            f"{_NAME}: a {q}-token chunk ({what}) on {self.seen} cached tokens needs {self.seen + q} slots, but "
            f"capacity is {self.ring}: layer {self.layer_idx} is a full-attention layer and would drop the oldest "
            f"tokens, a sliding window the model was not trained with (its output would differ from a full cache). "
            f"Pass capacity >= {self.seen + q}, or RollingKVCache(..., sliding=True) (or sink_tokens=) to keep a "
            f"window of the last {self.ring} tokens on purpose")

    def update(self, key_states, value_states, *args, **kwargs):
        self._check(key_states, value_states)
        b, q = key_states.shape[0], key_states.shape[2]
        self._check_fits(q)
        keys, values = self._views(b)
        seen, self.seen = self.seen, self.seen + q
        if q == 1:
            # Decode: the slot on the device into a preallocated tensor, then one column written; no
            # allocation, no host sync, the same code whether or not the ring has wrapped.
            self._decode_slot()
            keys.index_copy_(2, self._slot, key_states)
            values.index_copy_(2, self._slot, value_states)
            self.positions.index_copy_(0, self._slot, self._next)
            self._next.add_(self._one_t)
            return keys, values
        if seen + q <= self.ring:
            # Fits: slot == position, a plain strided copy. A chunk attends to the written slots only (a first
            # prefill then has kv_length == q, so SDPA may run its causal kernels without a mask).
            keys[:, :, seen:seen + q].copy_(key_states)
            values[:, :, seen:seen + q].copy_(value_states)
            torch.arange(seen, seen + q, out=self.positions[seen:seen + q])  # _next == seen here
            self._next.add_(q)
            return keys[:, :, :seen + q], values[:, :, :seen + q]
        # A chunk that overflows: attention needs the cached tokens (position order) and the whole chunk.
        dev = self.device
        old = torch.cat((torch.arange(min(self.sink, seen), device=dev),
                         torch.arange(min(seen, max(self.sink, seen - self.recent)), seen, device=dev)))
        old_slots = self._slots_of(old)
        full_k = torch.cat((keys.index_select(2, old_slots), key_states), dim=2)
        full_v = torch.cat((values.index_select(2, old_slots), value_states), dim=2)
        # Survivors of the chunk: its sink positions and its last `recent` positions (distinct slots).
        keep = torch.cat((torch.arange(seen, max(seen, min(self.sink, seen + q)), device=dev),
                          torch.arange(max(self.sink, seen, seen + q - self.recent), seen + q, device=dev)))
        slots = self._slots_of(keep)
        keys.index_copy_(2, slots, key_states.index_select(2, keep - seen))
        values.index_copy_(2, slots, value_states.index_select(2, keep - seen))
        self.positions.index_copy_(0, slots, keep)
        self._next.add_(q)
        return full_k, full_v

    def _decode_slot(self) -> None:
        """The slot of position `_next` into `_slot`, on the device, from the device constants (no allocation)."""
        ring_slot(self._next, self._sink_t, self._recent_t, out=self._slot)

    def update_rope(self, key_states, value_states, cos, sin, query_states=None, *, advance=True):
        """`update` for keys before RoPE: returns (keys, values, rotated query or None).

        A decode step (one token) computes its slot, rotates the key (and the query) and writes key and value
        into the ring in one kernel (`tigon.ops.rope_kv_append`), with no allocation besides the rotated query
        and no host sync; so does a chunk that fits the ring. A chunk past the ring rotates with
        `tigon.ops.apply_rope` and goes through `update`. cos, sin
        `[1 or batch, seq, rotary_dim]` as HF's rotary embedding returns them. Inference only.
        advance=False (one token only): the device's next position is left at the new token's position, and the
        caller advances it after attention (`decode_attention(..., advance_q_pos=True)` on `decode_positions()`'s
        next, which saves the step a kernel per layer).
        """
        from ..ops import apply_rope, rope_kv_append

        self._check(key_states, value_states)
        b, q = key_states.shape[0], key_states.shape[2]
        if q != 1 and self.seen + q > self.ring:
            q_embed, k_embed = apply_rope(query_states if query_states is not None else key_states, key_states,
                                          cos, sin)
            keys, values = self.update(k_embed, value_states)
            return keys, values, (q_embed if query_states is not None else None)
        # One kernel computes the slots from `_next` on the device, records their positions and writes K/V (a
        # chunk that fits has slot == position; apply_rope + update would take five kernels).
        keys, values = self._views(b)
        seen, self.seen = self.seen, self.seen + q
        q_embed = rope_kv_append(key_states, value_states, cos, sin, keys, values, self.positions, self._next,
                                 sink=self.sink, query=query_states)
        if q != 1:  # a chunk attends to the written slots only
            self._next.add_(q)
            return keys[:, :, :seen + q], values[:, :, :seen + q], q_embed
        if advance:
            self._next.add_(self._one_t)
        return keys, values, q_embed

    def prefill_rope(self, key_states, value_states, cos, sin, query_states=None):
        """`update_rope` for the fused prefill (`tigon.decode.layer_step`): the first chunk, which fits the ring,
        with key, value and query views of the caller's own projections and cos/sin `[1 or batch, chunk,
        rotary_dim]` (rotary_dim even, <= head_dim) checked by the caller, so the write skips
        `rope_kv_append`'s argument checks (`tigon.ops.kv_write.rope_kv_append_rows`; they cost more host time
        than the launch). Returns (keys, values, rotated query or None), as update_rope."""
        from ..ops.kv_write import rope_kv_append_rows

        self._check(key_states, value_states)
        b, q = key_states.shape[0], key_states.shape[2]
        if self.seen != 0 or not 0 < q <= self.ring:
            raise ValueError(f"{_NAME}.prefill_rope: the first chunk of a layer that holds nothing, at most "
                             f"{self.ring} tokens; this layer holds {self.seen} and the chunk has {q}")
        keys, values = self._views(b)
        self.seen = q
        q_embed = rope_kv_append_rows(key_states, value_states, cos, sin, keys, values, self.positions, self._next,
                                      self.sink, query_states)
        self._next.add_(q)
        return keys[:, :, :q], values[:, :, :q], q_embed

    def decode_positions(self):
        """(slot positions `[ring]`, next position `[1]`), both int64 device tensors kept by the layer.

        After a decode step's write the query sits at `next - 1`; `tigon.hf.ring_decode` passes `next` itself to
        `decode_attention` (with the window widened by one), which selects the same slots since no slot holds
        `next` yet, and so needs no subtraction kernel."""
        if not self.is_initialized:
            raise self._unallocated("decode_positions")
        return self.positions, self._next

    @property
    def next_position(self) -> torch.Tensor:
        """The absolute position the next token gets: the layer's int64 device tensor `[1]`, advanced in place by
        every write, so a CUDA graph that reads it sees each replay's value (never read it on the host per step:
        that is a sync)."""
        if not self.is_initialized:
            raise self._unallocated("next_position")
        return self._next

    def positions_after_append(self) -> torch.Tensor:
        """The slot positions `[ring]` as they will be once one token is written at `next_position`: a new int64
        device tensor (the ring is not changed), from device ops only. What a decode step's attention will see,
        known before the step writes (`tigon.decode.loop`'s masks)."""
        nxt = self.next_position
        return self.positions.scatter(0, self._slots_of(nxt), nxt)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of what `update` returns for a chunk of `query_length` tokens."""
        seen = self.seen
        if seen + query_length <= self.ring:
            # decode: the whole ring (a constant size for CUDA graphs); a chunk: the slots written so far
            return (self.ring if query_length == 1 else seen + query_length), 0
        if query_length == 1:
            return self.ring, seen - self.ring + 1
        cached = min(seen, self.ring)
        return cached + query_length, seen - cached

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.ring

    def reset(self) -> None:
        self.seen = 0
        if not self.is_initialized:
            return
        self.keys.zero_()
        self.values.zero_()
        self.positions.fill_(-1)
        self._next.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: gather rows, then copy back in place (the ring keeps its storage)."""
        if not self.is_initialized:
            return
        b = beam_idx.shape[0]
        for buf in (self.keys, self.values):
            buf[:b].copy_(buf[:b].index_select(0, beam_idx.to(buf.device)))

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(f"{_NAME}: crop (assisted decoding rollback) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(f"{_NAME}: the batch is fixed at construction; build it with the final batch_size")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError(f"{_NAME}: the batch is fixed at construction; build it with the final batch_size")

    def offload(self):
        raise NotImplementedError(f"{_NAME}: offloading would move the ring; it stays on its device")

    def prefetch(self):
        return None


class RollingKVCache(Cache):
    """A ring-buffer KV cache: `model.generate(ids, past_key_values=RollingKVCache(model.config, batch_size=B,
    capacity=C))`.

    Per layer two `[batch_size, kv_heads, ring, head_dim]` buffers of `dtype` on `device`, allocated once,
    where `ring = capacity` for full-attention layers and `min(capacity, sliding_window)` for sliding ones;
    total K/V bytes = sum over layers of `2 * batch_size * kv_heads * ring * head_dim * itemsize`. The first
    `sink_tokens` positions stay forever in full-attention layers (StreamingLLM); `0 <= sink_tokens <
    capacity`. With neither `dtype` nor `device` the cache follows the model: each layer's ring is allocated at its
    first update in the dtype and on the device of its key_states (as transformers' static caches do); with either
    one the rings are allocated here, `dtype` defaulting to `config.dtype` (else torch's default) and `device` to
    the default device.
    Exact full attention while the sequence fits; past capacity a sliding window of the most recent tokens
    (exact for models trained with that window, e.g. Mistral with capacity == sliding_window). Decode steps
    past capacity roll the ring; a multi-token chunk (a prompt) that overflows a full-attention layer's ring is
    refused with a ValueError unless `sliding=True` or `sink_tokens > 0` asks for that window on purpose (the
    model's own sliding-window layers always roll: they never attend further back).
    """

    def __init__(self, config, *, batch_size: int, capacity: int, sink_tokens: int = 0, sliding: bool = False,
                 dtype=None, device=None):
        batch_size = _positive_int("batch_size", batch_size, 1)
        capacity = _positive_int("capacity", capacity, 1)
        sink_tokens = _positive_int("sink_tokens", sink_tokens, 0)
        if not isinstance(sliding, bool):
            raise TypeError(f"{_NAME}: sliding must be True or False, got {type(sliding).__name__} {sliding!r}")
        if sink_tokens >= capacity:
            raise ValueError(f"{_NAME}: sink_tokens ({sink_tokens}) must be smaller than capacity ({capacity}), "
                             "or nothing would roll")
        if not hasattr(config, "get_text_config"):
            raise TypeError(f"{_NAME}: config must be a transformers PreTrainedConfig, got {type(config).__name__}")
        text = config.get_text_config(decoder=True)
        kv_heads, head_dim = _config_shape(text)
        lazy = dtype is None and device is None
        if not lazy:
            dtype, device = _resolve_dtype(dtype, text), _resolve_device(device)
        layer_types, kwargs = get_layer_types_and_kwargs(text)
        bad = sorted(set(layer_types) - set(_SUPPORTED))
        if bad:
            raise ValueError(f"{_NAME}: config: layer types {bad} are not supported (only {list(_SUPPORTED)})")
        window = kwargs.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{_NAME}: config.sliding_window must be an int >= 1 for sliding layers, got {window!r}")
        slidings = [kind == "sliding_attention" for kind in layer_types]
        rings = [min(capacity, window) if sliding else capacity for sliding in slidings]
        sinks = [0 if sliding else sink_tokens for sliding in slidings]
        if lazy:
            storage, self._counters = [None] * len(rings), None
        else:
            storage, self._counters = _layer_storage(batch_size, kv_heads, head_dim, rings, sinks, dtype, device)
        layers = [RollingKVLayer(layer_idx=i, batch_size=batch_size, kv_heads=kv_heads, head_dim=head_dim,
                                 ring=rings[i], sink_tokens=sinks[i], sliding=slidings[i], dtype=dtype,
                                 device=device, storage=storage[i], evicts=sliding)
                  for i in range(len(rings))]
        super().__init__(layers=layers)
        self.capacity, self.sink_tokens, self.sliding = capacity, sink_tokens, sliding
        # Set by a caller whose prefill reads the last position's output only (tigon.generate, logits_to_keep=1):
        # the fused prefill's last layer then computes that row alone (tigon.decode.layer_step.prefill_layer_step).
        self.last_position_only = False
        # Set by a caller that pads the first chunk on the right (tigon.decode.prefill_graph): an int64 device
        # tensor [1], the chunk's real rows; the last layer under last_position_only then computes row
        # `prefill_rows - 1` and attends to the keys before `prefill_rows` only.
        self.prefill_rows = None
        self.fused_prefill_layers = 0  # layers whose prefill ran tigon.decode.layer_step's (a host count)

    @property
    def dtype(self):
        """The first layer's dtype: None until its first update when the cache follows the model."""
        return self.layers[0].dtype if self.layers else None

    @property
    def device(self):
        """The first layer's device: None until its first update when the cache follows the model."""
        return self.layers[0].device if self.layers else None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"{_NAME}.update: layer_idx {layer_idx} is out of range: the cache was built for "
                             f"{len(self.layers)} layers (a config of another model?)")
        return self.layers[layer_idx].update(key_states, value_states)

    def nbytes(self) -> int:
        """Bytes of K/V storage allocated (fixed once every layer is allocated; 0 for a cache that follows the model,
        before its first update)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)

    def rewind(self) -> None:
        """Empty again by its counters, for a first chunk written next (a recorded prefill,
        `tigon.decode.prefill_graph`): the device's next positions 0 (one kernel) and the host counts 0. Slots keep
        their keys, values and positions until that chunk overwrites them and `keep_first` drops the rest. A
        cache allocated at construction only."""
        if self._counters is None:
            raise RuntimeError(f"{_NAME}.rewind: a cache built with dtype= or device= only (this one allocates each "
                               "ring at its first update)")
        self._counters[1][:, 0].zero_()
        for layer in self.layers:
            layer.seen = 0

    def clear(self) -> None:
        """Empty again for another sequence, by its counters: every slot's position -1, the next positions 0 (two
        kernels over the shared buffers) and the host counts 0. Keys and values keep the old sequence's numbers,
        which no attention reads (the tigon attention skips slots at position -1; HF's masks weigh them 0) until new
        ones overwrite them. A cache allocated at construction only."""
        self.rewind()
        self._counters[0].fill_(-1)
        self.last_position_only, self.prefill_rows = False, None

    def keep_first(self, rows: torch.Tensor) -> None:
        """After a first chunk written padded on the right: every slot past the first `rows` positions (an int64
        device tensor `[1]`) is empty again and each layer's next position is `rows` (two kernels over the
        shared buffers, nothing on the host: the caller sets `seen`). The state of a cache whose first chunk
        was `rows` tokens long, where the chunk fitted every ring."""
        positions, state = self._counters
        positions.masked_fill_(positions >= rows, -1)
        state[:, 0].copy_(rows.expand(state.shape[0]))
