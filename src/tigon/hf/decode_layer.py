"""A whole Llama-style decoder layer for one decode step over a RollingKVCache, in six kernels.

The module-by-module decode step launches ~25 kernels per layer (norms, three projections, the cache's slot
arithmetic, RoPE, attention, residual adds, the GLU), most far too small to fill an H200, and cuBLAS reads
the small projections at a third of the bandwidth. `decode_layer_step` runs instead:

    qkv = decode_linear(h, [Wq, Wk, Wv], norm=input_layernorm)        # RMSNorm fused, q/k/v in one launch
    q   = rope_kv_append(k, v, ..., query=q)                           # RoPE, slot and K/V write, one launch
    a   = decode_attention(q, ring)                                    # (+ its split merge)
    h2  = decode_linear(a, Wo, residual=h)                             # residual add fused
    m   = decode_linear(h2, [Wgate, Wup], norm=post_attention_layernorm, activation=act)
    out = decode_linear(m, Wdown, residual=h2)

with the roundings of the unfused modules (each projection output, the norm output and the GLU product are
rounded to the model dtype where they would be). It applies only where that is exactly what the layer's own
forward computes: the "tigon" attention with RoPE on write (Llama, Mistral, Qwen2 without q/k/v bias, Qwen3),
Tigon's RMSNorm modules in "llama" casting with no offset, plain bias-free nn.Linear projections in the model
dtype, a SwiGLU or GeGLU MLP, no hooks, no autograd. Anything else returns None and the layer runs its
forward as before.
"""

from torch import nn

from .. import ops
from ..modules import RMSNorm
from ..modules.mlp import GeGLUMLP, SwiGLUMLP
from .attention import _attention_forward, _decode, _mask_usable, _ring_layer, _slot_positions, _window

_ACT = {SwiGLUMLP: "silu", GeGLUMLP: "gelu_tanh"}


def _plain(lin, dtype) -> bool:
    return (type(lin) is nn.Linear and lin.bias is None and not lin._forward_hooks and not lin._forward_pre_hooks
            and lin.weight.dtype == dtype and lin.weight.is_contiguous())


def _norm_ok(norm, dtype) -> bool:
    return (type(norm) is RMSNorm and norm.offset == 0.0 and norm.casting_mode == "llama"
            and norm.weight is not None and norm.weight.dtype == dtype and not norm._forward_hooks
            and not norm._forward_pre_hooks)


def _weights(layer, dtype):
    """(attention projections, gate, up, down, activation) when the fused step computes the layer exactly."""
    attn, mlp = layer.self_attn, layer.mlp
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return None
    if not (_norm_ok(layer.input_layernorm, dtype) and _norm_ok(layer.post_attention_layernorm, dtype)):
        return None
    projs = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    if not all(_plain(p, dtype) for p in projs):
        return None
    act = _ACT.get(type(mlp))
    if act is None or mlp._forward_hooks or mlp._forward_pre_hooks or not _plain(mlp.down_proj, dtype):
        return None
    if mlp.fused_gate_up:
        if not _plain(mlp.gate_up_proj, dtype):
            return None
        gate, up = mlp.gate_up_proj.weight.chunk(2, dim=0)
    else:
        if not (_plain(mlp.gate_proj, dtype) and _plain(mlp.up_proj, dtype)):
            return None
        gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    if hasattr(attn, "q_norm") and not (_norm_ok(attn.q_norm, dtype) and _norm_ok(attn.k_norm, dtype)):
        return None
    return [p.weight for p in projs], gate, up, mlp.down_proj.weight, act


def decode_layer_step(layer, hidden_states, attention_mask, past_key_values, position_embeddings):
    """The layer's output for one decode step, or None where the layer must run its own forward."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not attn.__dict__.get("_tigon_rope_on_write") or position_embeddings is None:
        return None
    if (getattr(attn.__dict__.get("forward"), "__func__", None) is not _attention_forward or attn._forward_hooks
            or attn._forward_pre_hooks):
        return None
    ring = _ring_layer(attn, hidden_states, past_key_values)
    if ring is None or hidden_states.shape[0] > 16:  # the fused projections are for decode-sized batches
        return None
    b = hidden_states.shape[0]
    if not _mask_usable(attention_mask, b, ring.ring) or not hidden_states.is_contiguous():
        return None
    found = _weights(layer, hidden_states.dtype)
    if found is None:
        return None
    (wq, wk, wv, wo), gate, up, down, act = found
    x = hidden_states.view(b, -1)
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv = ops.decode_linear(x, [wq, wk, wv], norm_weight=ln1.weight, eps=ln1.eps)
    nq, nk, d = wq.shape[0], wk.shape[0], attn.head_dim
    q = qkv[:, :nq].view(b, 1, -1, d)
    k = qkv[:, nq:nq + nk].view(b, 1, -1, d)
    v = qkv[:, nq + nk:].view(b, 1, -1, d)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm on the head dim before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = position_embeddings
    keys, values, q = ring.update_rope(k.transpose(1, 2), v.transpose(1, 2), cos, sin, q.transpose(1, 2))
    slot_pos = _slot_positions(ring, attention_mask, b)
    out = _decode(ring, q, keys, values, slot_pos, scaling=attn.scaling, sliding_window=_window(attn),
                  softcap=None)
    h = ops.decode_linear(out.reshape(b, -1), wo, residual=x)
    m = ops.decode_linear(h, [gate, up], norm_weight=ln2.weight, eps=ln2.eps, activation=act)
    return ops.decode_linear(m, down, residual=h).view_as(hidden_states)
