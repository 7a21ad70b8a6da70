"""Training (and prefill) attention of the "tigon" implementation: packed sequences, sliding windows, softcapping.

What a layer attends to, in a row of T tokens (query i, key j): j <= i (causal); the same document (packed rows:
transformers' `DataCollatorWithFlattening` / TRL's padding-free layout, one row whose `position_ids` restart at 0
per example, with or without `cu_seq_lens_q/k` and `max_length_q/k`); i - j < window (sliding layers); and the
logits capped as softcap * tanh(s / softcap) (Gemma-2). How it gets here without a [T, T] mask:

- `training_mask` (called by the "tigon" mask builder) reads the mask Hugging Face describes (its mask function:
  causal, sliding overlay, the packed-sequence document ids HF found in position_ids) and, for a mask without a
  padding mask or a cache offset, returns a `TrainingMask` (the [B, T] document ids and the window) in place of the
  dense boolean tensor; plain causal stays None, as SDPA's is_causal wants. Anything else it does not know returns
  NotImplemented and HF builds its mask as before.
- `training_attention_forward` (the AttentionInterface function for non-decode calls) runs the first backend of
  `attention_table.ranking(gpu, kind)` that can take the call: PyTorch's varlen_attn (flash kernels per example,
  no mask; needs the collator's cu_seq_lens / max_length for a packed row), FlexAttention (a block mask from the
  document ids, built once per forward and shared by the layers, score_mod for softcap), flash_attn's kernels
  when installed, or HF's own pick (SDPA; eager for softcap) with the dense mask built here from the same
  document ids. The ranking is the user cache's (`tigon tune`), the shipped table's, or for an unmeasured GPU the
  rule's (backends that beat HF's pick on every measured GPU; docs/tuning.md), then HF's pick; a CPU runs HF's
  pick, so it computes exactly what HF computes.

No host sync: the document ids come from HF's packed-sequence detection (a device cumsum) or from `cu_seq_lens`
by a device searchsorted; nothing here reads a tensor value on the host. (HF's own detection, outside Tigon, does
one `.all()` per forward in eager mode, skipped under torch.compile.) Dropout > 0 runs HF's pick.
"""

import functools
import importlib.util
import inspect
import math
import sys
import warnings
from typing import Optional

import torch

from . import attention_table

_CAUSAL = "causal_mask_function"
_AND = "and_masks.<locals>.and_mask"
_WINDOW = "sliding_window_overlay.<locals>.inner_mask"
_PACKED = "packed_sequence_mask_function.<locals>.inner_mask"
DOCUMENTS = "tigon_documents"  # the kwarg that carries a packed row's TrainingMask from the model to the layers


class TrainingMask:
    """What a layer's mask means, without the [T, T] tensor: `docs` [B, T] int document ids (None: one document
    per row) and `window` (None: no window). One per mask kind and forward; the layers share it, and with it the
    FlexAttention block mask built at the first layer."""

    __slots__ = ("docs", "window", "block_masks")

    def __init__(self, docs=None, window=None):
        self.docs, self.window, self.block_masks = docs, window, {}

    def __repr__(self):
        shape = None if self.docs is None else tuple(self.docs.shape)
        return f"TrainingMask(docs={shape}, window={self.window})"


# torch >= 2.13: dynamo reads the closure of a function made while it traces (2.11 raises Unsupported on it).
_DYNAMO_READS_CLOSURES = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 13)


def _cells(fn) -> Optional[dict]:
    """The closure of `fn` by variable name, or None where it cannot be read: a callable with no code object, or
    a function made while dynamo traces (HF's packed-sequence AND mask under torch.compile with no cache), whose
    `__closure__` dynamo cannot read. The mask is then HF's to build. Dynamo before torch 2.13 cannot read the
    closure of a function made inside the trace (an Unsupported error, which fails a fullgraph trace): there a
    compiled forward reads no closure and keeps HF's mask."""
    if not _DYNAMO_READS_CLOSURES and torch.compiler.is_compiling():
        return None
    try:
        closure = fn.__closure__  # compared with None, not tested for truth: dynamo cannot branch on a traced tuple
        if closure is None:
            return {}
        return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in closure)))
    except AttributeError:
        return None


def _qualname(fn) -> str:
    """The function's qualified name, read from its code object where it has one. While dynamo traces (torch
    2.13), a function's `__qualname__` compares unequal to the same string; `__code__.co_qualname` does not.
    Without this a compiled forward read no mask function and fell back to HF's dense [T, T] mask."""
    name = getattr(getattr(fn, "__code__", None), "co_qualname", None)  # Python >= 3.11
    return name if isinstance(name, str) else getattr(fn, "__qualname__", "")


def _read_mask_function(fn, found: dict) -> bool:
    """Fill `found` (causal, window, docs) from HF's mask function; False for any function this does not know."""
    name = _qualname(fn)
    if name == _CAUSAL:
        found["causal"] = True
        return True
    cells = _cells(fn)
    if cells is None:
        return False
    if name == _AND:
        return all(_read_mask_function(f, found) for f in cells.get("mask_functions", ()))
    if name == _WINDOW and isinstance(cells.get("sliding_window"), int):
        found["window"] = min(found.get("window") or cells["sliding_window"], cells["sliding_window"])
        return True
    if name == _PACKED and isinstance(cells.get("packed_sequence_mask"), torch.Tensor):
        found["docs"] = cells["packed_sequence_mask"]
        return True
    return False


def training_mask(*, mask_function, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None,
                  batch_size=None):
    """The mask HF describes, as a TrainingMask (packed and/or windowed), None (plain causal), or NotImplemented
    where HF must build it (a padding mask, a cache offset, a mask function other than causal/window/packed)."""
    if (attention_mask is not None or not isinstance(q_offset, int) or not isinstance(kv_offset, int)
            or q_offset or kv_offset or q_length != kv_length or q_length < 2 or mask_function is None):
        return NotImplemented
    found = {}
    if not _read_mask_function(mask_function, found) or not found.get("causal"):
        return NotImplemented
    window = found.get("window")
    window = window if window is not None and window < q_length else None  # i - j < T always holds
    docs = found.get("docs")
    if docs is not None and (docs.dim() != 2 or docs.shape[-1] != q_length):
        return NotImplemented
    if docs is None and window is None:
        return None
    return TrainingMask(docs, window)


def documents_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids of packed rows: a new document wherever the position does not step by one (what HF's
    find_packed_sequence_indices computes), on the device."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def _one_document_each(docs: torch.Tensor) -> bool:
    """Whether every row of `docs` is one example, read on the host (a sync): only where HF's own pick runs,
    whose packed-sequence check syncs the same way, so an unpacked row keeps sdpa's is_causal kernel."""
    return not torch.compiler.is_compiling() and bool((docs[:, -1] == 0).all())


def packed_model_forward(self, *args, **kwargs):
    """Installed by tigon.patch on the instance of a decoder model (LlamaModel, ...): a call given position_ids
    with no attention_mask and no cache is a packed (padding-free) row, attended within each example whatever the
    attention implementation. HF's own packed detection does not run when the model makes its training-time
    DynamicCache (use_cache, the default), and its sdpa path then attends across the examples. On "tigon" the
    document ids travel to the attention layers as a kwarg, computed once per forward on the device (no sync where
    the table ranks a kernel above HF's pick); on any other implementation the call runs without that cache, so
    HF's own packed-sequence mask applies (past_key_values comes back None for such a row)."""
    position_ids = kwargs.get("position_ids")
    attention_mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    if (len(args) <= 2 and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
            and attention_mask is None and kwargs.get("past_key_values") is None):
        if getattr(self.config, "_attn_implementation", None) == "tigon":
            docs = documents_from_position_ids(position_ids)
            hf_kernel = attention_table.pick(gpu_name(docs.device), "packed") == attention_table.hf_pick("packed")
            if not (hf_kernel and _one_document_each(docs)):
                kwargs[DOCUMENTS] = TrainingMask(docs, None)
        else:
            kwargs["use_cache"] = False
    return type(self).forward(self, *args, **kwargs)


def documents_from_cu_seq_lens(cu_seq_lens: torch.Tensor, length: int) -> torch.Tensor:
    """[1, length] document ids from flash-attention style boundaries [0, l0, l0 + l1, ...], on the device (a
    searchsorted, no host read); tokens past the last boundary form one more document."""
    positions = torch.arange(length, device=cu_seq_lens.device, dtype=cu_seq_lens.dtype)
    return torch.searchsorted(cu_seq_lens[1:].contiguous(), positions, right=True).unsqueeze(0)


def mask_kind(docs, window, softcap) -> str:
    """The attention_table key: causal / packed / sliding / packed+sliding, + "+softcap"."""
    parts = [p for p, on in (("packed", docs is not None), ("sliding", bool(window))) if on] or ["causal"]
    return "+".join(parts) + ("+softcap" if softcap else "")


def dense_mask(docs, window, length: int, device) -> torch.Tensor:
    """The boolean [B or 1, 1, T, T] mask (True = attend) of causal / documents / window: HF's pick and the
    reference build it; the fast backends never do."""
    i = torch.arange(length, device=device)
    allowed = i[:, None] >= i[None, :]
    if window:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    allowed = allowed[None, None]
    if docs is not None:
        docs = docs.to(device)
        allowed = allowed & (docs[:, None, :, None] == docs[:, None, None, :])
    return allowed


def attention_reference(query, key, value, *, scaling, docs=None, window=None, softcap=None, mask=None):
    """The spec, in fp32 (fp64 for fp64 inputs): query [B, Hq, T, D], key/value [B, Hk, T, D] (Hq a multiple of
    Hk), docs [B, T] or None; `mask` (boolean, broadcastable to [B, Hq, T, T]) in place of docs and window.
    Returns [B, T, Hq, D] in query's dtype, as HF's attention functions do."""
    math_dtype = torch.promote_types(query.dtype, torch.float32)
    q, k, v = (t.to(math_dtype) for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = dense_mask(docs, window, q.shape[2], q.device) if mask is None else mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).to(query.dtype)


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def hf_attention(module, query, key, value, attention_mask, **kwargs):
    """Hugging Face's pick for a materialized (or None) mask: SDPA, or the family's eager attention for a
    softcapping layer (SDPA drops the softcap)."""
    if kwargs.get("softcap") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager adds its mask
                attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill_(
                    ~attention_mask, torch.finfo(query.dtype).min)
            return eager(module, query, key, value, attention_mask, **kwargs)
        return _softcap_without_eager(query, key, value, attention_mask, **kwargs)
    return _sdpa(module, query, key, value, attention_mask, **kwargs)


def _softcap_without_eager(query, key, value, attention_mask, *, softcap, scaling=None, dropout=0.0, **kwargs):
    """A softcapping layer whose modeling module has no eager_attention_forward: the spec's math (SDPA would
    drop the cap). Takes a boolean mask, or None for causal."""
    if dropout:
        raise ValueError(f"tigon training attention: dropout={dropout} with softcap={softcap} needs the model "
                         "family's eager_attention_forward, which its modeling module does not define")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError("tigon training attention: a softcapping layer without eager attention takes a boolean "
                         f"mask, got {attention_mask.dtype}")
    return attention_reference(query, key, value, scaling=scaling or query.shape[-1] ** -0.5, softcap=softcap,
                               mask=attention_mask), None


# Compiled variants of flex_attention one process may need: per (window, softcap, grad mode, dtype) up to 3
# graphs (a static first length, then a dynamic T; rows of one 128-block specialize apart, size 1 being static),
# so a Gemma-2 with train and eval steps needs ~12, past dynamo's default limit of 8. At the limit dynamo would
# silently run flex_attention eagerly, which materializes the [B, H, T, T] scores (53 GB at 8192 tokens, 32 heads):
# here the limit is raised to this for the flex call, and hitting it raises FlexRecompileLimitHit instead.
FLEX_RECOMPILE_LIMIT = 64


class FlexRecompileLimitHit(RuntimeError):
    """Compiled FlexAttention reached its recompile limit; training_attention_forward then runs HF's pick."""


# (device, dtype, head dim, GQA groups, grad, mask kind, under one 128-block) of flex calls whose compile failed
# (inductor found no kernel config: torch 2.11 at head 16, bf16, GQA 4, 64 tokens, no grad): they run HF's pick
# without compiling again, which would cost seconds per layer and fail the same way.
_FLEX_FAILED: set = set()


def _flex_key(query, key, kind) -> tuple:
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key))
    return (str(query.device), query.dtype, query.shape[-1], query.shape[1] // key.shape[1], grad, kind,
            query.shape[2] <= 128)


def _compile_flex(backend="inductor"):
    from torch.nn.attention.flex_attention import flex_attention

    # Eager flex_attention is a slow dense reference; compiled, it is the fused kernel. dynamic=None (automatic
    # dynamic): the first packed length compiles static, the second recompiles with a symbolic T, and every later
    # length reuses that graph (10 packed lengths of 80..200 tokens: 3 graphs, tests/hf/test_training_attention.py).
    return torch.compile(flex_attention, backend=backend)


@functools.cache
def _compiled_flex():
    return _compile_flex()


def _without_silent_fallback(fn, *args, **kwargs):
    """fn(*args, **kwargs) (a torch.compile'd callable) with dynamo's recompile limit raised to FLEX_RECOMPILE_LIMIT and
    hitting it an error (FlexRecompileLimitHit), not an eager run. Plain attribute swaps: config.patch costs 30 us
    a call, x layers per step."""
    import torch._dynamo

    config = torch._dynamo.config
    saved = config.recompile_limit, config.fail_on_recompile_limit_hit, config.specialize_float
    # specialize_float: a second softcap (or scale) value would otherwise make the float a graph input (automatic
    # dynamic), and then the softcap score_mod captures it: dynamo graph-breaks at the flex_attention HOP and runs
    # its autograd eagerly, which torch 2.11 refuses (an AssertionError in create_fw_bw_graph; torch 2.13 on CPU:
    # 13 graph breaks at the second softcap). Specialized, each value is its own static graph: one per model.
    config.recompile_limit, config.fail_on_recompile_limit_hit = max(saved[0], FLEX_RECOMPILE_LIMIT), True
    config.specialize_float = True
    try:
        return fn(*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        raise FlexRecompileLimitHit(
            f"tigon training attention: compiled FlexAttention reached torch._dynamo's recompile limit "
            f"({config.recompile_limit}); running it eagerly would materialize the [T, T] scores") from e
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit, config.specialize_float = saved


FLEX_BLOCK = 128  # FlexAttention's default sparse block: the tiles of its block masks
# Block masks of rows without documents (plain causal or windowed: a Gemma-2 row shorter than its window), which
# depend on the window, the length and the device alone: every layer of every step shares one.
_DOCUMENTLESS_BLOCK_MASKS: dict = {}


def _ordered(blocks):
    """[..., Q, K] boolean blocks -> (count per row, column indices with the row's blocks first), int32, as
    FlexAttention's BlockMask holds them."""
    dense = blocks.to(torch.int32)
    return (dense.sum(-1).to(torch.int32),
            torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))


def block_sets(docs, window, length, device):
    """(partial, full) [B, 1, Q, K] booleans over 128-token tiles for causal / documents / window, from tile bounds
    alone: a partial tile has some allowed (query, key) pair, a full one only allowed pairs (its mask_mod is not
    run). Document ids must not decrease along a row (documents_from_* give 0, 0, 1, 1, 1, 2, ...). A key tile
    left of the query tile holds an allowed pair exactly when the closest pair (the query tile's first token, the
    key tile's last) is allowed: same document (the key precedes, so its id is at most the query's) and i - j <
    window. The diagonal tile always holds (i, i). O((T / 128)^2) device work, no host sync."""
    n = -(-length // FLEX_BLOCK)
    tiles = torch.arange(n, device=device)
    qb, kb = tiles[:, None], tiles[None, :]
    diagonal, left = kb == qb, kb < qb
    first = tiles * FLEX_BLOCK
    last = torch.clamp(first + FLEX_BLOCK - 1, max=length - 1)
    some, every = left, left & (qb < n - 1 if length % FLEX_BLOCK else True)  # a ragged last row: never full
    if window:
        some = some & (first[:, None] - last[None, :] < window)
        every = every & (first[:, None] + FLEX_BLOCK - 1 - first[None, :] < window)
    some, every = some[None], every[None]
    if docs is not None:
        docs = docs.to(device)
        head, tail = docs[:, first], docs[:, last]  # [B, n]: the ids of each tile's first and last token
        same = tail[:, None, :] == head[:, :, None]  # key tile's last token in the query tile's first's document
        one = head == tail
        some = some & same
        every = every & same & one[:, :, None] & one[:, None, :]
    partial = (some | diagonal) & ~every
    return partial[:, None], every[:, None]


@functools.cache
def _from_kv_blocks_takes_lengths() -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters


def _block_mask(docs, window, length, device):
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = q_idx >= kv_idx
        if window:
            allowed = allowed & (q_idx - kv_idx < window)
        if docs is not None:
            allowed = allowed & (docs[b, q_idx] == docs[b, kv_idx])
        return allowed

    if _from_kv_blocks_takes_lengths():
        # From tile bounds, not by evaluating mask_mod over [T, T]: create_block_mask's compiled build of a packed
        # row's document mask took 188 s on an H200 at 16384 tokens (25 s at 8192) the first time.
        partial, full = block_sets(docs, window, length, device)
        return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=FLEX_BLOCK,
                                        mask_mod=mask_mod, seq_lengths=(length, length))
    batch = docs.shape[0] if docs is not None else None
    # _compile runs a nested torch.compile, which dynamo refuses inside a traced forward: there the outer compile
    # traces the block-mask build itself (docs/compile.md).
    nested = device.type == "cuda" and not torch.compiler.is_compiling()
    if not nested:
        return create_block_mask(mask_mod, batch, None, length, length, device=device)
    return _without_silent_fallback(create_block_mask, mask_mod, batch, None, length, length, device=device,
                                    _compile=True)


def flex_attention_forward(query, key, value, *, scaling, docs=None, window=None, softcap=None, mask=None,
                           compiled=True):
    """FlexAttention over [B, Hq, T, D] / [B, Hk, T, D]: a block mask from docs / window (cached on `mask`, the
    forward's TrainingMask, so one block mask serves every layer) and a softcap score_mod. Returns [B, T, Hq, D].
    Raises FlexRecompileLimitHit where the compiled kernel would otherwise fall back to eager ([T, T] scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    length = query.shape[2]
    if mask is not None:
        cache = mask.block_masks
    elif docs is None and not torch.compiler.is_compiling():  # no data in it: one per (window, length, device)
        cache = _DOCUMENTLESS_BLOCK_MASKS
        if len(cache) >= 32:
            cache.clear()
    else:
        cache = {}
    key_ = (window, length, str(query.device))
    block_mask = cache.get(key_)
    if block_mask is None:
        block_mask = cache[key_] = _block_mask(docs, window, length, query.device)
    score_mod = None
    if softcap:
        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)
    # Inside a compiled model the outer compile fuses flex_attention itself; calling the compiled one nests.
    args = (query, key, value)
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    options = attention_table.flex_kernel_options(gpu_name(query.device), query.shape[-1], query.element_size())
    if options:
        kwargs["kernel_options"] = options
    if compiled and not torch.compiler.is_compiling():
        out = _without_silent_fallback(_compiled_flex(), *args, **kwargs)
    else:
        out = flex_attention(*args, **kwargs)
    return out.transpose(1, 2).contiguous()


@functools.cache
def varlen_parameters() -> frozenset:
    """The parameter names of torch.nn.attention.varlen.varlen_attn in this torch (empty: it has none). Read from
    the signature, never the version: torch 2.10's takes is_causal, later ones window_size, scale, enable_gqa."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_device(device) -> bool:
    """Whether varlen_attn runs on `device`: CUDA only (its kernels are aten's flash / cuDNN ones)."""
    return torch.device(device).type == "cuda"


def _varlen_runs_cudnn(device) -> bool:
    """Whether this torch's varlen_attn runs cuDNN on `device` (GQA and windows raise there): its own check."""
    from torch.nn.attention import varlen

    check = getattr(varlen, "_should_use_cudnn", None)
    if check is None or device.type != "cuda":
        return False
    return bool(check(device.index if device.index is not None else torch.cuda.current_device()))


class VarlenPlan:
    """One varlen_attn call: `cu` int32 [N + 1] sequence starts in the flattened [B * T] tokens, `max_length` (an
    int: the kernel's grid), `repeat` (K/V heads repeated where the kernel takes no GQA) and the keywords."""

    __slots__ = ("cu", "max_length", "repeat", "kwargs")

    def __init__(self, cu, max_length, repeat, kwargs):
        self.cu, self.max_length, self.repeat, self.kwargs = cu, max_length, repeat, kwargs


def varlen_plan(query, key, *, scaling, docs=None, window=None, softcap=None, dropout=0.0, cu=None,
                max_length=None, params=None):
    """The VarlenPlan of a causal layer over query [B, Hq, T, D] / key [B, Hk, T, D], or a str saying why
    varlen_attn cannot take it. Packed rows (docs given) need the collator's cu_seq_lens_q and max_length_q (an
    int), one row: from position_ids alone the sequence count and the longest length are device values, and the
    kernel's grid and scratch are sized by them on the host (a sync; an upper bound such as N = T costs
    T / 128 x T x H programs and a [T, H, T] fp32 backward scratch). `params`: varlen_parameters() by default."""
    params = varlen_parameters() if params is None else params
    b, hq, t, d = query.shape
    hk = key.shape[1]
    reason = ("this torch has no torch.nn.attention.varlen.varlen_attn" if not params
              else "varlen_attn runs on CUDA only" if not varlen_device(query.device)
              else f"varlen_attn takes fp16 / bf16, not {query.dtype}" if query.dtype not in (torch.float16,
                                                                                             torch.bfloat16)
              else f"varlen_attn takes head dims <= 256 that are multiples of 8, not {d}" if d % 8 or d > 256
              else "varlen_attn has no softcap" if softcap
              else "varlen_attn has no dropout" if dropout
              else f"{hq} query heads are not a multiple of {hk} KV heads" if hq % hk
              else None)
    if reason:
        return reason
    cudnn = _varlen_runs_cudnn(query.device)
    kwargs = {}
    if window:
        if "window_size" not in params or cudnn:
            return "this torch's varlen_attn takes no sliding window"
        kwargs["window_size"] = (window - 1, 0)  # flash attends j in [i - left, i]; HF's window is i - j < window
    elif "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal: varlen_attn reads is_causal as window_size == (-1, 0), a tuple
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        return "this torch's varlen_attn takes neither window_size nor is_causal"
    if "scale" in params:
        kwargs["scale"] = scaling
    elif not math.isclose(scaling, d ** -0.5, rel_tol=1e-12):
        return f"this torch's varlen_attn takes no scale (the layer's is {scaling}, not head_dim ** -0.5)"
    repeat = 1
    if hq != hk:
        if "enable_gqa" in params and not cudnn:
            kwargs["enable_gqa"] = True
        else:
            repeat = hq // hk
    if docs is None:  # one sequence per row, known from the shapes
        return VarlenPlan(torch.arange(0, (b + 1) * t, t, device=query.device, dtype=torch.int32), t, repeat, kwargs)
    if (not isinstance(cu, torch.Tensor) or cu.dim() != 1 or b != 1 or isinstance(max_length, bool)
            or not isinstance(max_length, (int, torch.SymInt))):
        return "a packed row needs the collator's cu_seq_lens_q and max_length_q (an int), one row"
    return VarlenPlan(cu.to(device=query.device, dtype=torch.int32), max_length, repeat, kwargs)


def varlen_attention_forward(query, key, value, plan: VarlenPlan):
    """torch.nn.attention.varlen.varlen_attn over [B, Hq, T, D] / [B, Hk, T, D] (flattened to [B * T, H, D], a
    view for B = 1), each sequence of plan.cu on its own, causal. Returns [B, T, Hq, D]."""
    from torch.nn.attention.varlen import varlen_attn

    b, hq, t, d = query.shape
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    if plan.repeat > 1:
        k, v = k.repeat_interleave(plan.repeat, 1), v.repeat_interleave(plan.repeat, 1)
    out = varlen_attn(q, k, v, plan.cu, plan.cu, plan.max_length, plan.max_length, **plan.kwargs)
    return out.view(b, t, hq, d)


@functools.cache
def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _flash_attn_forward(query, key, value, *, scaling, window, softcap, cu, max_length):
    """flash_attn over [B, H, T, D]: varlen with the collator's cu_seq_lens / max_length (B == 1), else dense
    causal. window_size=(w - 1, 0): flash_attn attends j in [i - left, i], HF's window is i - j < w."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, T, H, D]
    extra = dict(softmax_scale=scaling, causal=True, window_size=(window - 1, 0) if window else (-1, -1),
                 softcap=float(softcap or 0.0))
    if cu is None:
        return flash_attn_func(q, k, v, **extra)
    cu = cu.to(torch.int32)
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max_length, max_length, **extra)
    return out.unsqueeze(0)


def _eligible(backend, query, key, dropout, docs, cu, max_length) -> bool:
    d = query.shape[-1]
    if dropout or query.shape[1] % key.shape[1]:
        return False
    if backend == "flex":
        return d >= 16 and d <= 256 and d & (d - 1) == 0 and query.dtype in (torch.float16, torch.bfloat16,
                                                                              torch.float32)
    if backend == "flash_attn":
        packed_ok = docs is None or (cu is not None and isinstance(max_length, int) and query.shape[0] == 1)
        return (_has_flash_attn() and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                and d <= 256 and packed_ok)
    return backend in ("sdpa", "eager")


_GPU_NAMES: dict = {}


def gpu_name(device) -> str | None:
    """torch.cuda.get_device_name of a CUDA device (cached per index), None for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _GPU_NAMES:
        _GPU_NAMES[index] = torch.cuda.get_device_name(index)
    return _GPU_NAMES[index]


def _documents(attention_mask, packed, cu, query):
    """(docs, the TrainingMask that caches the block masks) of this call: the mask's documents (HF found them),
    else the model's (tigon_documents kwarg), else cu_seq_lens_q's (a single packed row)."""
    length = query.shape[2]
    if isinstance(attention_mask, TrainingMask) and attention_mask.docs is not None:
        return attention_mask.docs, attention_mask
    if isinstance(packed, TrainingMask) and packed.docs is not None and packed.docs.shape[-1] == length:
        return packed.docs, packed
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and query.shape[0] == 1:
        return documents_from_cu_seq_lens(cu.to(query.device), length), None
    return None, attention_mask if isinstance(attention_mask, TrainingMask) else None


def training_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               sliding_window=None, softcap=None, **kwargs):
    """Non-decode attention of "tigon": query [B, Hq, T, D], key/value [B, Hk, S, D]; attention_mask a
    TrainingMask, None (causal; packed by the tigon_documents or cu_seq_lens_q kwarg) or HF's dense mask.
    Returns ([B, T, Hq, D], None)."""
    packed = kwargs.pop(DOCUMENTS, None)
    common = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    length = query.shape[2]
    if not isinstance(attention_mask, TrainingMask) and (attention_mask is not None or length < 2
                                                         or key.shape[2] != length):
        return hf_attention(module, query, key, value, attention_mask, **common, **kwargs)  # dense, decode, cache
    window = attention_mask.window if isinstance(attention_mask, TrainingMask) else None
    cu = kwargs.get("cu_seq_lens_q")
    docs, cache = _documents(attention_mask, packed, cu, query)
    if scaling is None:
        scaling = common["scaling"] = query.shape[-1] ** -0.5
    kind = mask_kind(docs, window, softcap)
    max_length = kwargs.get("max_length_q")
    for backend in attention_table.ranking(gpu_name(query.device), kind):
        if backend == "varlen":
            plan = varlen_plan(query, key, scaling=scaling, docs=docs, window=window, softcap=softcap,
                               dropout=dropout, cu=cu, max_length=max_length)
            if isinstance(plan, VarlenPlan):
                return varlen_attention_forward(query, key, value, plan), None
        elif backend == "flex" and _eligible("flex", query, key, dropout, docs, cu, max_length):
            out = _flex_or_none(query, key, value, scaling=scaling, docs=docs, window=window, softcap=softcap,
                                cache=cache, kind=kind)
            if out is not None:
                return out, None
        elif backend == "flash_attn" and _eligible("flash_attn", query, key, dropout, docs, cu, max_length):
            return _flash_attn_forward(query, key, value, scaling=scaling, window=window, softcap=softcap,
                                       cu=cu if docs is not None else None, max_length=max_length), None
        elif backend in ("sdpa", "eager"):
            dense = None if docs is None and window is None else dense_mask(docs, window, length, query.device)
            if backend == "eager" and softcap and dense is None:
                dense = dense_mask(None, None, length, query.device)  # eager takes no is_causal
            return hf_attention(module, query, key, value, dense, **common, **kwargs)
    raise AssertionError(f"attention_table.ranking ends with HF's pick, which takes every call ({kind})")


def _flex_or_none(query, key, value, *, scaling, docs, window, softcap, cache, kind):
    """flex_attention_forward, or None (the next backend of the ranking runs) past the recompile limit or where
    inductor cannot compile this shape (remembered: that shape is not compiled again)."""
    if _flex_key(query, key, kind) in _FLEX_FAILED:
        return None
    try:
        return flex_attention_forward(query, key, value, scaling=scaling, docs=docs, window=window, softcap=softcap,
                                      mask=cache)
    except FlexRecompileLimitHit as e:  # exact either way; HF's pick costs a [T, T] boolean mask, not scores
        warnings.warn(f"{e}; this call runs the next backend of the table's ranking (last: Hugging Face's pick, "
                      f"{attention_table.hf_pick(kind)}) instead", RuntimeWarning, stacklevel=3)
    except torch._dynamo.exc.BackendCompilerFailed as e:  # InductorError too: no kernel for this shape
        _FLEX_FAILED.add(_flex_key(query, key, kind))
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        warnings.warn(f"tigon training attention: compiled FlexAttention failed to compile for {kind}, head "
                      f"{query.shape[-1]}, {query.dtype} ({type(e).__name__}: {first}); these calls run the next "
                      f"backend of the table's ranking (last: Hugging Face's pick, {attention_table.hf_pick(kind)}) "
                      "instead", RuntimeWarning, stacklevel=3)
    return None


def layer_plan(config, device) -> dict:
    """{layer kind: {mask kind: backend}} for the PatchReport: full layers see causal / packed rows, sliding
    layers sliding / packed+sliding rows (shorter rows than the window are causal / packed). Where the table
    ranks several, the backend reads "varlen > flex > sdpa": the first that takes a call runs."""
    types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if not types:
        sliding = window is not None and getattr(config, "use_sliding_window", True) is not False
        types = ["sliding_attention" if sliding else "full_attention"]
    softcap = getattr(config, "attn_logit_softcapping", None)
    plan = {}
    for layer in dict.fromkeys(types):
        kinds = [("causal", None), ("packed", True)]
        if layer == "sliding_attention" and window:
            kinds += [("sliding", None), ("packed+sliding", True)]
        plan[layer] = {}
        for name, packed in kinds:
            kind = mask_kind(packed, "sliding" in name, softcap)
            plan[layer][kind] = " > ".join(attention_table.ranking(gpu_name(device), kind))
    return plan
