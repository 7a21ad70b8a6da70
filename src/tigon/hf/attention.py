"""The "tigon" attention implementation for transformers: decode steps over a RollingKVCache read the ring in place.

    from tigon.hf.attention import use_tigon_attention, restore_attention
    use_tigon_attention(model)     # or tigon.patch(model, attention=True)
    model.generate(ids, past_key_values=RollingKVCache(model.config, batch_size=B, capacity=C))

`use_tigon_attention` registers the name "tigon" with `AttentionInterface` (the attention function) and
`AttentionMaskInterface` (the mask builder), switches the model to it and wraps the forward of each attention
module on the instance. A decode step (one query token, a RollingKVCache, grad off) then runs:
- Llama-style modules (`rope_on_write_form`: transformers' own forward that reads as Llama's, with at most a
  sliding window and Qwen3's q/k norms on the head dim, and a rotate-half apply_rotary_pos_emb; in transformers
  5.17 Llama, Mistral, Ministral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma, Granite, Arcee): q/k/v
  projections, then one `tigon.ops.rope_kv_write` kernel that rotates q and k and writes k and v into the
  ring slot, then `tigon.ops.decode_attention` over the ring, then o_proj;
- any other module of the same call shape (Gemma-2, ...): the module's own forward, whose cache update writes
  the ring, then `decode_attention` from the attention function (GQA, the layer's sliding window, softcap).
Everything else (prefill, chunks, training, other caches) is Hugging Face's: `sdpa_attention_forward`, or,
for a model with attention-logit softcapping, the family's `eager_attention_forward` (sdpa ignores softcap,
so "tigon" computes what "eager" does for Gemma-2, and what "sdpa" does for the others).

The decode step never syncs the host: the slot positions and the query position are the cache's device
tensors, and HF's 4-D decode mask (always materialized for a compileable cache) is folded into per-row slot
positions with one `torch.where` (a masked slot becomes empty, -1), which keeps left padding exact. Limits: a
float 4-D mask is read as "0 = attend" (additive biases are not applied on the decode path); dropout and
autograd take the HF path.

RoPE of one instance (`route_rope`, what `tigon.patch(model)` uses): the attention modules of that model run
their class forward's own bytecode with the one global `apply_rotary_pos_emb` read under another name, bound to
Tigon's (`tigon.ops.apply_rope`); the modeling module's apply_rotary_pos_emb stays Hugging Face's, so another
model of the same class keeps Hugging Face's RoPE. Where that forward is Llama's with Qwen3's q/k norms and the norms
are Tigon's (`fuse_qk_norm_rope`, also from `tigon.patch`), the instance runs `_qk_norm_rope_forward` instead: the
same computation with both norms and RoPE in one `tigon.ops.qk_norm_rope` kernel.
"""

import ast
import collections
import dis
import functools
import hashlib
import inspect
import textwrap
import types

import torch

from ..memory.kv_cache import RollingKVCache
from ..modules.norms import RMSNorm
from ..ops import apply_rope, decode_attention, qk_norm_rope
from .bound import BoundForward
from .unwrap import hub_function, unwrap_model

NAME = "tigon"
_STATE = "_tigon_attention"  # hf.__dict__ key: the implementation to restore and the wrapped modules
_RING = "_tigon_ring"  # kwargs key that carries the cache layer from the module forward to the attention function
_CALL_SHAPE = ("self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values")
_registered = False


def register() -> None:
    """Register "tigon" with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, tigon_attention_forward)
    AttentionMaskInterface.register(NAME, tigon_mask)
    _registered = True


def _softcap_of(config):
    return getattr(config, "attn_logit_softcapping", None) if config is not None else None


def tigon_mask(*args, config=None, **kwargs):
    """The mask builder of "tigon". A mask without padding or a cache offset whose function is causal, a sliding
    window and/or HF's packed-sequence documents becomes a `training_attention.TrainingMask` (document ids and the
    window, no [T, T] tensor), plain causal None; the rest is HF's sdpa mask: boolean, or None where sdpa's
    is_causal does the work, except for a softcapping model, whose eager attention needs it materialized. (Not
    HF's eager_mask: it copies a host scalar to the device, which a CUDA-graph capture refuses.)"""
    from transformers.masking_utils import sdpa_mask

    from .training_attention import training_mask

    if not args:
        mask = training_mask(mask_function=kwargs.get("mask_function"), q_length=kwargs.get("q_length"),
                             kv_length=kwargs.get("kv_length"), q_offset=kwargs.get("q_offset", 0),
                             kv_offset=kwargs.get("kv_offset", 0), attention_mask=kwargs.get("attention_mask"))
        if mask is not NotImplemented:
            return mask
    if _softcap_of(config):
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, config=config, **kwargs)


def _fallback(module, query, key, value, attention_mask, **kwargs):
    """Every call but a ring decode step: training / prefill attention (tigon.hf.training_attention)."""
    from .training_attention import training_attention_forward

    return training_attention_forward(module, query, key, value, attention_mask, **kwargs)


def mask_usable(attention_mask, batch: int, ring: int) -> bool:
    """Host checks only: a 4-D [1 or B, 1, 1, ring] mask whose columns are the ring's slots, or none."""
    if attention_mask is None:
        return True
    return (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
            and attention_mask.shape[0] in (1, batch) and attention_mask.shape[-1] == ring
            and (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()))


def mark_unmasked(mask: torch.Tensor) -> torch.Tensor:
    """Record on the (all-true) 4-D `mask` that it masks nothing, so a decode step reads the slot positions as
    they are (saves a where and a fill kernel per layer and step). Returns `mask`."""
    mask._tigon_unmasked = True
    return mask


def slot_positions(layer, attention_mask, batch: int):
    """The positions decode_attention reads: the layer's `[ring]`, or `[B, ring]` with masked slots set to -1.

    In a decode step HF's mask column j is slot j (the ring is returned whole, in slot order), so folding the
    mask into the positions attends exactly the slots sdpa would."""
    positions, _ = layer.decode_positions()
    if attention_mask is None or getattr(attention_mask, "_tigon_unmasked", False):
        return positions
    row = attention_mask[:, 0, -1, :]
    allowed = row if row.dtype == torch.bool else row == 0
    return torch.where(allowed, positions, -1).expand(batch, -1)


def ring_decode(layer, query, keys, values, slot_pos, *, scaling, sliding_window, softcap, advanced=True):
    """advanced: the ring's next position was advanced by the write (the query sits at next - 1); else it is
    the query's position and the attention advances it (update_rope(advance=False))."""
    _, nxt = layer.decode_positions()
    # Advanced: passing `next` (and the window + 1) attends the same slots as next - 1 and the window: no slot
    # holds position `next` yet, and next - p < w + 1 iff (next - 1) - p < w. No subtraction kernel per layer.
    widen = 1 if advanced else 0
    out = decode_attention(query, keys, values, slot_pos, nxt, scale=scaling,
                           sliding_window=sliding_window + widen if sliding_window else None, softcap=softcap or None,
                           advance_q_pos=not advanced)
    return out.transpose(1, 2)  # [B, 1, Hq, D], as HF's attention functions return it


def tigon_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    """The AttentionInterface function "tigon": decode_attention on the ring when the module's forward handed
    over its RollingKVCache layer for a decode step, else the HF fallback. Returns ([B, T, Hq, D], None)."""
    layer = kwargs.pop(_RING, None)
    if (layer is not None and not dropout and query.shape[2] == 1 and key.shape[2] == layer.ring
            and mask_usable(attention_mask, query.shape[0], layer.ring)):
        slot_pos = slot_positions(layer, attention_mask, query.shape[0])
        return ring_decode(layer, query, key, value, slot_pos, scaling=scaling, sliding_window=sliding_window,
                       softcap=softcap), None
    return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, softcap=softcap, **kwargs)


def ring_layer(module, hidden_states, past_key_values):
    """The RollingKVCache layer of this module when this call is a decode step tigon runs, else None."""
    if (not isinstance(past_key_values, RollingKVCache) or hidden_states is None or hidden_states.dim() != 3
            or hidden_states.shape[1] != 1 or torch.is_grad_enabled()
            or module.config._attn_implementation != NAME):
        return None
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int) or not 0 <= idx < len(past_key_values.layers):
        return None
    layer = past_key_values.layers[idx]
    return layer if hidden_states.shape[0] <= layer.batch_size else None


class RopeOnWrite(collections.namedtuple("RopeOnWrite", "window qk_norm")):
    """How a Llama-form attention forward differs from Llama's: where it reads its sliding window ("module":
    `self.sliding_window`, "config": `config.sliding_window`, None: no window) and whether it applies RMSNorm to
    q and k on the head dim before RoPE (Qwen3)."""


_LLAMA = "transformers.models.llama.modeling_llama"  # the form _rope_on_write computes
_WINDOW_SOURCES = {"self.sliding_window": "module", "getattr(self.config, 'sliding_window', None)": "config"}
_QK_NORMS = {"q_norm": "self.q_proj(hidden_states).view(hidden_shape)",
             "k_norm": "self.k_proj(hidden_states).view(hidden_shape)"}


def _forward_body(fn):
    """The function's statements as a module AST (docstring, comments and layout gone), or None without its
    source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.Module(body=body, type_ignores=[])


def _code(fn, defined=False):
    """The source of `fn` (a kernels function module read as the function it wraps; `defined`: also after
    kernelize gave it a hub forward, `hub_function`) as normalized code, or None."""
    body = _forward_body(hub_function(fn, defined)) if fn is not None else None
    return ast.unparse(body) if body is not None else None


class _LlamaVariations(ast.NodeTransformer):
    """Takes out the two ways a Llama-form forward may differ, recording them: the sliding_window argument of
    the attention call, and q_norm / k_norm around the head-dim view of q and k."""

    def __init__(self):
        self.windows, self.norms = [], set()

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"
                and f.attr in _QK_NORMS and len(node.args) == 1 and not node.keywords
                and ast.unparse(node.args[0]) == _QK_NORMS[f.attr]):
            self.norms.add(f.attr)
            return node.args[0]
        kept = [k for k in node.keywords if k.arg != "sliding_window"]
        self.windows += [ast.unparse(k.value) for k in node.keywords if k.arg == "sliding_window"]
        node.keywords = kept
        return node


@functools.cache
def _llama_code(name):
    """The code of `name` ("LlamaAttention.forward", "apply_rotary_pos_emb", "rotate_half") in modeling_llama."""
    import importlib

    obj = importlib.import_module(_LLAMA)
    for part in name.split("."):
        obj = getattr(obj, part)
    return _code(obj, defined=True)  # the reference: Llama's source even where a kernelize replaced what runs


def _rotate_half_rope(fn) -> bool:
    """The forward's module-level apply_rotary_pos_emb is Llama's rotate-half (or Tigon's), not an interleaved
    one under the same name (GLM, Helium)."""
    rope = hub_function(fn.__globals__.get(_ROPE_NAME))
    if getattr(rope, "__tigon__", False):
        return True
    code = _code(rope)
    return (code is not None and code == _llama_code(_ROPE_NAME)
            and _code(getattr(rope, "__globals__", {}).get("rotate_half")) == _llama_code("rotate_half"))


_HF_FORWARD: dict = {}  # attention class -> the forward transformers defined on it, kept when a class patch replaces it


def hf_class_forward(cls, inherited=False):
    """The forward transformers defined on `cls` (kept from before a class-level patch replaced it), or None;
    `inherited`: else the one `cls` inherits."""
    return _HF_FORWARD.get(cls) or (getattr(cls, "forward", None) if inherited else cls.__dict__.get("forward"))


@functools.cache
def rope_on_write_form(cls):
    """`RopeOnWrite` when `cls.forward` is transformers' own (defined on the class, not replaced by another
    library) and, read as code, is LlamaAttention.forward with at most a sliding window and Qwen3's q/k norms;
    and its apply_rotary_pos_emb is rotate-half; else None. That is the computation `_rope_on_write` fuses; any
    other line (softcapping, a norm on the whole projection, a NoPE switch, a fused qkv projection) or an
    interleaved RoPE keeps the module's forward."""
    fn = hf_class_forward(cls)
    if (fn is None or not getattr(fn, "__module__", "").startswith("transformers.models.")
            or getattr(fn, "__qualname__", "") != f"{cls.__name__}.forward"):
        return None
    body = _forward_body(fn)
    if body is None or not _rotate_half_rope(fn):
        return None
    found = _LlamaVariations()
    body = found.visit(body)
    if (ast.unparse(body) != _llama_code("LlamaAttention.forward") or found.norms not in (set(), set(_QK_NORMS))
            or len(found.windows) > 1):
        return None
    window = _WINDOW_SOURCES.get(found.windows[0]) if found.windows else None
    if found.windows and window is None:
        return None
    return RopeOnWrite(window, bool(found.norms))


def sliding_window_of(module):
    """The sliding window a Llama-form attention module passes to its attention function (None: full)."""
    source = rope_on_write_form(type(module)).window
    if source == "module":
        return module.sliding_window
    if source == "config":
        return getattr(module.config, "sliding_window", None)
    return None


def has_qk_norm(module) -> bool:
    """The module's class forward is Llama-form and applies q_norm / k_norm on the head dim before RoPE (Qwen3);
    False for any other forward."""
    form = rope_on_write_form(type(module))
    return form is not None and form.qk_norm


def is_tigon_forward(module) -> bool:
    """The module runs the forward `use_tigon_attention` installed, with no hook around it."""
    forward = module.__dict__.get("forward")
    return (getattr(forward, "__func__", None) is _attention_forward and not module._forward_hooks
            and not module._forward_pre_hooks)


def _rope_on_write(module, layer, hidden_states, position_embeddings, attention_mask):
    """Llama's attention forward for one decode step, with RoPE fused into the cache write."""
    b = hidden_states.shape[0]
    if position_embeddings is None or not mask_usable(attention_mask, b, layer.ring):
        return None
    hidden_shape = (b, 1, -1, module.head_dim)
    q = module.q_proj(hidden_states).view(hidden_shape)
    k = module.k_proj(hidden_states).view(hidden_shape)
    v = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    if has_qk_norm(module):  # Qwen3: RMSNorm on the head dim before RoPE
        q, k = module.q_norm(q), module.k_norm(k)
    cos, sin = position_embeddings
    keys, values, q = layer.update_rope(k.transpose(1, 2), v, cos, sin, q.transpose(1, 2))
    slot_pos = slot_positions(layer, attention_mask, b)  # after the write: it holds the new position
    out = ring_decode(layer, q, keys, values, slot_pos, scaling=module.scaling,
                      sliding_window=sliding_window_of(module), softcap=None)
    return module.o_proj(out.reshape(b, 1, -1)), None


# transformers' LlamaAttention.forward as `_code` normalizes it, in the version `_qk_norm_rope_forward` computes
# (5.17): sha-256, first 16 hex digits. Another version keeps the class forward (Tigon's norms and RoPE apart).
_LLAMA_FORWARD_SHA = "edb09e4cdb72174c"
# module.__dict__ key: the q/k norms and RoPE of this module run as one kernel; its value: where the class forward
# reads its sliding window ("module", "config", "": none)
QK_NORM_ROPE = "_tigon_qk_norm_rope"


@functools.cache
def _llama_forward_mirrored() -> bool:
    """The installed LlamaAttention.forward is the one `_qk_norm_rope_forward` reproduces (read once a process)."""
    code = _llama_code("LlamaAttention.forward") or ""
    return hashlib.sha256(code.encode()).hexdigest()[:16] == _LLAMA_FORWARD_SHA


def _norms_fusable(q_norm, k_norm, head_dim) -> bool:
    return (isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm) and q_norm.weight is not None
            and k_norm.weight is not None and q_norm.weight.shape == k_norm.weight.shape == (head_dim,)
            and (q_norm.eps, q_norm.offset, q_norm.casting_mode) == (k_norm.eps, k_norm.offset, k_norm.casting_mode))


def qk_norm_rope_ready(module) -> str:
    """"" when the q/k norms and the RoPE of this attention module can run as one `tigon.ops.qk_norm_rope`
    kernel (`_qk_norm_rope_forward`), else why not."""
    why = qk_norm_rope_class_ready(type(module))
    if why:
        return why
    if not _norms_fusable(getattr(module, "q_norm", None), getattr(module, "k_norm", None), module.head_dim):
        return "q_norm / k_norm are not Tigon RMSNorms of head_dim with the same settings"
    return ""


def _qk_norm_rope_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                          **kwargs):
    """The class forward (Llama's with Qwen3's q/k norms, `rope_on_write_form`) with the two norms and RoPE in one
    `tigon.ops.qk_norm_rope` kernel, on an instance `fuse_qk_norm_rope` fused."""
    hf_forward = hf_class_forward(type(self), inherited=True)  # also where a class patch came after this instance's
    return _qk_norm_rope_compute(self, hf_forward, self.__dict__.get(QK_NORM_ROPE),
                                 hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)


def _qk_norm_rope_compute(self, hf_forward, window_source, hidden_states, position_embeddings, attention_mask,
                          past_key_values, **kwargs):
    """transformers' forward `hf_forward` with the q/k norms and RoPE in one kernel: the normalized q and k never go
    through memory. `window_source` says where it reads its sliding window ("module", "config", "": none). Where
    the kernel cannot run (norms swapped since, a partial rotary table) `hf_forward` runs, with Tigon's RoPE."""
    q_norm, k_norm = self.q_norm, self.k_norm
    cos, sin = position_embeddings
    if not _norms_fusable(q_norm, k_norm, self.head_dim) or cos.shape[-1] != self.head_dim:
        return _rope_routed(hf_forward)(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                        **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    q, k = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps, offset=q_norm.offset,
                        casting_mode=q_norm.casting_mode)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    names = hf_forward.__globals__  # the modeling module's attention functions, as the class forward reads them
    attention = names["ALL_ATTENTION_FUNCTIONS"].get_interface(self.config._attn_implementation,
                                                               names["eager_attention_forward"])
    window = {"sliding_window": self.sliding_window if window_source == "module" else
              getattr(self.config, "sliding_window", None)} if window_source else {}
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, **window, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def qk_norm_rope_class_forward(cls):
    """A forward for the attention class `cls` (Llama-form with Qwen3's q/k norms, `qk_norm_rope_class_ready`)
    running its q/k norms and RoPE as one kernel for every instance whose norms are Tigon's (the others run
    transformers' forward), for a class-level patch; `hf_class_forward(cls)` keeps transformers' forward."""
    hf_forward = hf_class_forward(cls)
    _HF_FORWARD.setdefault(cls, hf_forward)
    window_source = rope_on_write_form(cls).window or ""

    @functools.wraps(hf_forward)  # the signature, which the call-shape check and generate() inspect
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        return _qk_norm_rope_compute(self, hf_forward, window_source, hidden_states, position_embeddings,
                                     attention_mask, past_key_values, **kwargs)

    forward.__tigon__ = True
    return forward


NO_QK_NORM = "no q/k norms on the head dim before RoPE in a Llama-form forward"


def qk_norm_rope_class_ready(cls) -> str:
    """"" when the class forward of `cls` can run its q/k norms and RoPE as one kernel (whatever an instance's
    norms are), else why not (`NO_QK_NORM` where there is nothing to fuse)."""
    form = rope_on_write_form(cls)
    if form is None or not form.qk_norm:
        return NO_QK_NORM
    if not _llama_forward_mirrored():
        return "transformers' LlamaAttention.forward is not the version the fused forward computes"
    return ""


def fuse_qk_norm_rope(module) -> str:
    """Make this attention module (routed to Tigon's RoPE by `route_rope`) run its q/k norms and RoPE as one kernel.
    Returns "" when done (or already), else why not. `unroute_rope` undoes it too."""
    if not module.__dict__.get(ROPE):
        return "RoPE is not routed to Tigon's on this instance"
    if getattr(type(module).forward, "__tigon__", False):
        return ""  # a class-level patch fused the class forward: every instance runs it
    why = qk_norm_rope_ready(module)
    if not why:  # the window's source, read here: the forward traced by torch.compile then reads a plain str
        module.__dict__[QK_NORM_ROPE] = rope_on_write_form(type(module)).window or ""
    return why


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb (rotate-half) on tigon.ops.apply_rope."""
    return apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


apply_rotary_pos_emb.__tigon__ = True
_ROPE_NAME = "apply_rotary_pos_emb"
# The name a routed forward reads Tigon's function under, set in the modeling module beside HF's (which stays).
_ALIAS = "_tigon_apply_rotary_pos_emb"
ROPE = "_tigon_rope"  # module.__dict__ key: this attention module runs Tigon's RoPE
_ROUTED: dict = {}  # class forward -> the routed function (the forward itself where it cannot be routed)


def _loads_rope_as_global(code) -> bool:
    """Every use of the name in `code` (and the code nested in it) is a global load: renaming it changes no
    attribute access or store."""
    uses = [ins.opname for ins in dis.get_instructions(code) if ins.opcode in dis.hasname and ins.argval == _ROPE_NAME]
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return all(op == "LOAD_GLOBAL" for op in uses) and all(_loads_rope_as_global(c) for c in nested)


def _renamed(code):
    names = tuple(_ALIAS if n == _ROPE_NAME else n for n in code.co_names)
    consts = tuple(_renamed(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_names=names, co_consts=consts)


def _rope_routed(fn):
    """`fn` (an attention class's forward) as a function whose code reads the global `_tigon_apply_rotary_pos_emb`
    where it read `apply_rotary_pos_emb`: the same bytecode otherwise, the same (live) module globals, so it
    computes exactly what the class forward does with Tigon's RoPE, and torch.compile traces it as any function
    of that module. HF's apply_rotary_pos_emb is not touched: the other instances of the class keep it."""
    routed = _ROUTED.get(fn)
    if routed is None:
        code = getattr(fn, "__code__", None)
        if code is None or _ROPE_NAME not in code.co_names or not _loads_rope_as_global(code):
            routed = fn
        else:
            fn.__globals__.setdefault(_ALIAS, apply_rotary_pos_emb)
            routed = types.FunctionType(_renamed(code), fn.__globals__, fn.__name__, fn.__defaults__,
                                        fn.__closure__)
            routed.__kwdefaults__ = fn.__kwdefaults__
            routed.__qualname__, routed.__doc__, routed.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
            routed.__dict__.update(fn.__dict__)
        routed = _ROUTED.setdefault(fn, routed)
    return routed


def calls_rope(cls, modeling: str) -> bool:
    """The class forward is a function of the `modeling` module that calls that module's apply_rotary_pos_emb
    (and can be routed to Tigon's)."""
    fn = hf_class_forward(cls, inherited=True)
    return (getattr(fn, "__globals__", {}).get("__name__") == modeling and _rope_routed(fn) is not fn)


def _class_forward(module):
    """The forward of the module's class, with Tigon's RoPE where route_rope() routed this instance (its q/k norms
    and RoPE in one kernel where fuse_qk_norm_rope() fused them)."""
    fn = type(module).forward
    if not module.__dict__.get(ROPE):
        return fn
    return _qk_norm_rope_forward if QK_NORM_ROPE in module.__dict__ else _rope_routed(fn)


def _sync_forward(module) -> None:
    """Set `_attention_forward` on the module while RoPE routing or the tigon attention needs it, remove it when
    neither does; another library's instance forward is left alone."""
    current = module.__dict__.get("forward")
    if current is not None and getattr(current, "__func__", None) is not _attention_forward:
        return
    wanted = ROPE in module.__dict__ or "_tigon_rope_on_write" in module.__dict__
    if wanted and current is None:
        module.forward = BoundForward(_attention_forward, module)
    elif not wanted and current is not None:
        del module.forward


def route_rope(module) -> str:
    """Make this attention module (an instance of a class that `calls_rope`) run Tigon's RoPE, and only this one.
    Returns "" when routed (or already), else why not."""
    if not _call_shape_ok(type(module)):
        return f"{type(module).__name__}.forward does not take {', '.join(_CALL_SHAPE[1:])} first"
    current = module.__dict__.get("forward")
    if current is not None and getattr(current, "__func__", None) is not _attention_forward:
        return "another library replaced forward on the instance"
    module.__dict__[ROPE] = True
    _sync_forward(module)
    return ""


def unroute_rope(module) -> None:
    """Undo route_rope(module) (and fuse_qk_norm_rope)."""
    module.__dict__.pop(ROPE, None)
    module.__dict__.pop(QK_NORM_ROPE, None)
    _sync_forward(module)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                       **kwargs):
    """Installed on each attention module: a decode step over a RollingKVCache goes to tigon, the rest to the
    class forward (with Tigon's RoPE where the instance is routed)."""
    forward = _class_forward(self)
    layer = ring_layer(self, hidden_states, past_key_values)
    if layer is None:
        return forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    if self.__dict__.get("_tigon_rope_on_write"):
        out = _rope_on_write(self, layer, hidden_states, position_embeddings, attention_mask)
        if out is not None:
            return out
    return forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs,
                   **{_RING: layer})


@functools.cache
def _call_shape_ok(cls) -> bool:
    try:
        names = tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names[:len(_CALL_SHAPE)] == _CALL_SHAPE


def _unwrap(model, caller):
    return unwrap_model(model, caller)


_PLAIN_SWITCH = set()  # model classes whose set_attn_implementation was seen to only set the one config


def _set_impl(hf, name) -> None:
    # transformers' set_attn_implementation re-checks the class (reading its source) and walks the modules
    # for sub-models on every call: ~2.5 ms of each generate call's time to first token. A model with one
    # config (no sub-model of another config class) that switched once gets the config set directly.
    cls = type(hf)
    if cls in _PLAIN_SWITCH:
        hf.config._attn_implementation = name
        return
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(name)
        from transformers import PreTrainedModel

        if not any(isinstance(m, PreTrainedModel) and m is not hf and type(m.config) is not type(hf.config)
                   for m in hf.modules()):
            _PLAIN_SWITCH.add(cls)
    if hf.config._attn_implementation != name:  # a class that refuses dynamic switching: the config directly
        hf.config._attn_implementation = name


class _State(dict):
    """What use_tigon_attention records on the model: the implementation to restore and the wrapped modules. A
    model saved with "tigon" set loads in a process where the name is not registered yet: loading this registers
    it (and deepcopy goes the same way)."""

    def __reduce__(self):
        return _loaded_state, (dict(self),)


def _loaded_state(items):
    register()
    return _State(items)


class Installed(collections.Counter):
    """What `use_tigon_attention` installed: {piece: count} (the lines of a patch report), and `decode_modules`,
    the number of attention modules whose decode steps run on "tigon" (RoPE on write or decode_attention)."""

    decode_modules = 0


def use_tigon_attention(model) -> Installed:
    """Switch `model` (a transformers model, or a PEFT/other wrapper of one) to the "tigon" attention
    implementation and wrap its attention modules' forward (see the module docstring). Idempotent; undone by
    `restore_attention(model)` (and by `tigon.unpatch(model)` when installed through `tigon.patch`).
    Returns the count of each piece installed (`Installed`: `.decode_modules` is the coverage)."""
    register()
    hf = _unwrap(model, "tigon.hf.attention.use_tigon_attention")
    state = hf.__dict__.get(_STATE)
    if state is None:
        state = hf.__dict__[_STATE] = _State(impl=hf.config._attn_implementation, modules=[])
    counts = Installed()
    _set_impl(hf, NAME)
    counts["attention implementation 'tigon' (decode_attention over RollingKVCache)"] += 1
    for m in hf.modules():
        cls = type(m)
        if not cls.__name__.endswith("Attention") or not hasattr(m, "layer_idx") or not _call_shape_ok(cls):
            continue
        current = m.__dict__.get("forward")
        if current is not None and getattr(current, "__func__", None) is not _attention_forward:
            continue  # another library's instance forward: leave it alone
        if "_tigon_rope_on_write" not in m.__dict__:
            m._tigon_rope_on_write = rope_on_write_form(cls) is not None
            state["modules"].append(m)
            _sync_forward(m)
        if m._tigon_rope_on_write:
            counts[f"{cls.__name__} decode (RoPE on write)"] += 1
        else:
            counts[f"{cls.__name__} decode (decode_attention)"] += 1
        counts.decode_modules += 1
    return counts


def restore_attention(model) -> None:
    """Undo `use_tigon_attention`: the original implementation and the class forwards of the modules."""
    hf = _unwrap(model, "tigon.hf.attention.restore_attention")
    state = hf.__dict__.pop(_STATE, None)
    if state is None:
        return
    for m in state["modules"]:
        m.__dict__.pop("_tigon_rope_on_write", None)
        _sync_forward(m)  # the forward stays while tigon.patch routes the module's RoPE
    _set_impl(hf, state["impl"])
