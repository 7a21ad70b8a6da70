"""A decode step of the "tigon" attention over a RollingKVCache ring: one query token attends the ring in place.

`ring_layer` says whether a call is such a step (a RollingKVCache, one token, grad off, the model on "tigon").
`ring_decode` runs `tigon.ops.decode_attention` over the ring; `rope_on_write` is Llama's whole attention forward
for one step with RoPE fused into the cache write (one `tigon.ops.rope_kv_write` kernel, the cache layer's
`update_rope`). The step never syncs the host: the slot positions and the query position are the cache's device
tensors, and HF's 4-D decode mask is folded into per-row slot positions with one `torch.where` (`slot_positions`: a
masked slot becomes empty, -1), which keeps left padding exact. Called by the attention function (`hf.attention`),
the forward installed on each attention module (`hf.instance_forward`) and the fused decoder-layer step
(`tigon.decode.layer_step`).
"""

import torch

from ..memory.kv_cache import RollingKVCache
from ..ops import decode_attention
from .forward_source import has_qk_norm, sliding_window_of

NAME = "tigon"  # the attention implementation whose decode steps run here (registered by hf.attention)
RING_KWARG = "_tigon_ring"  # kwargs key that carries the cache layer from the module forward to the attention function


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


def rope_on_write(module, layer, hidden_states, position_embeddings, attention_mask):
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
