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

Where each part lives (each module imports only those below it):
- `hf.attention` (here): registration (`register`), the mask builder (`tigon_mask`), the attention function
  (`tigon_attention_forward`), `use_tigon_attention` / `restore_attention`;
- `hf.instance_forward`: the forward set on each attention module (`installed_forward`: a decode step to the
  ring, the rest to the class forward), and `route_rope` / `unroute_rope`, what `tigon.patch(model)` uses to
  give one instance Tigon's RoPE;
- `hf.ring_decode`: the decode step over the ring (`ring_layer`, `slot_positions`, `ring_decode`,
  `rope_on_write`), also run by the fused decoder-layer step (`tigon.decode.layer_step`); `NAME` is defined there;
- `hf.qk_norm_rope_forward`: Qwen3's q/k norms and RoPE in one `tigon.ops.qk_norm_rope` kernel
  (`fuse_qk_norm_rope` for an instance, `qk_norm_rope_class_forward` for a class patch);
- `hf.rope_routing`: the class forward with Tigon's RoPE for one instance, by a bytecode rename;
- `hf.forward_source`: transformers' forward read as code (`rope_on_write_form`, `hf_class_forward`, the pinned
  LlamaAttention version);
- `hf.training_attention`: every call that is not a ring decode step (training, prefill, eval).
"""

import collections

from .forward_source import rope_on_write_form
from .instance_forward import call_shape_ok, installed_forward, sync_forward
from .ring_decode import NAME, RING_KWARG, mask_usable, ring_decode, slot_positions
from .unwrap import unwrap_model

_STATE = "_tigon_attention"  # hf.__dict__ key: the implementation to restore and the wrapped modules
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


def tigon_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **kwargs):
    """The AttentionInterface function "tigon": decode_attention on the ring when the module's forward handed
    over its RollingKVCache layer for a decode step, else the HF fallback. Returns ([B, T, Hq, D], None)."""
    layer = kwargs.pop(RING_KWARG, None)
    if (layer is not None and not dropout and query.shape[2] == 1 and key.shape[2] == layer.ring
            and mask_usable(attention_mask, query.shape[0], layer.ring)):
        slot_pos = slot_positions(layer, attention_mask, query.shape[0])
        return ring_decode(layer, query, key, value, slot_pos, scaling=scaling, sliding_window=sliding_window,
                       softcap=softcap), None
    return _fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     sliding_window=sliding_window, softcap=softcap, **kwargs)


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
        if not cls.__name__.endswith("Attention") or not hasattr(m, "layer_idx") or not call_shape_ok(cls):
            continue
        current = m.__dict__.get("forward")
        if current is not None and getattr(current, "__func__", None) is not installed_forward:
            continue  # another library's instance forward: leave it alone
        if "_tigon_rope_on_write" not in m.__dict__:
            m._tigon_rope_on_write = rope_on_write_form(cls) is not None
            state["modules"].append(m)
            sync_forward(m)
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
        sync_forward(m)  # the forward stays while tigon.patch routes the module's RoPE
    _set_impl(hf, state["impl"])
