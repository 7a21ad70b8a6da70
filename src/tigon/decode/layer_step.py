"""The fused decoder-layer step: a whole Llama-style layer for one decode step over a RollingKVCache in six
kernels at batch 1, eight from 2 rows (`decode_layer_step`), and the first prompt chunk's layer without the
module-by-module host time (`prefill_layer_step`); and how a model gets it (`install`, `uninstall`,
`fused_decode`).

How it is reached: the decoder forward that `tigon.patch` gives Llama-style layers
(`tigon.hf.causal_lm.fused_prenorm_decoder_forward`) calls `layer.__dict__["_tigon_layer_step"]` when the
layer holds one, in a no-grad step with a cache; `install(model)` puts `layer_step` there on every layer that
runs that forward. `tigon.patch(model)` installs it (so HF's own `model.generate` over a RollingKVCache on the
"tigon" attention runs it), `tigon.unpatch(model)` takes it away, and `tigon.generate` holds it for its call
(`fused_decode`: a class-level patched model gets it too). `hf/` never imports this package.

The module-by-module decode step launches ~25 kernels per layer (norms, three projections, the cache's slot
arithmetic, RoPE, attention, residual adds, the GLU), most far too small to fill an H200, and cuBLAS reads
the small projections at a third of the bandwidth. `decode_layer_step` runs instead:

    qkv = decode_linear(h, [Wq, Wk, Wv], norm=input_layernorm)         # RMSNorm fused, q/k/v in one launch
    q   = rope_kv_append(k, v, ..., query=q)                            # RoPE, ring slot and K/V write
    a   = decode_attention(q, ring, advance_q_pos=True)                 # + its split merge, which advances
                                                                        # the ring's next position
    h2  = decode_linear(a, Wo, residual=h)                              # residual add fused
    m   = decode_linear(h2, [Wgate, Wup], norm=post_attention_layernorm, activation=act)
    out = decode_linear(m, Wdown, residual=h2)

From SEPARATE_NORM_ROWS rows (batch >= 2) the two RMSNorms run as launches of their own (`rms_norm_rows`) and the
projections take the normalized rows: every projection program would otherwise re-read all rows of x from L2 for
the statistics, which at 8 rows cost the Llama-3-8B gate/up launch 8 us (eight kernels a layer then, docs/ops/
decode_linear.md, "The norm as its own launch").

The roundings are the unfused modules' (each projection output, the norm output and the GLU product are
rounded to the model dtype where they would be). It applies only where that is exactly what the layer's own
forward computes: the "tigon" attention with RoPE on write (`hf.forward_source.rope_on_write_form`: Llama,
Mistral, Qwen2 without q/k/v bias, Qwen3, ...),
Tigon's RMSNorm modules in "llama" casting with no offset, plain bias-free nn.Linear projections in the model
dtype, a SwiGLU or GeGLU MLP, no hooks, no autograd. Anything else returns None and the layer runs its forward
as before. (Fusing RoPE and the cache write into the q/k/v projection measured slower: docs/ops/decode_linear.md.)

Quantized layers (every projection a `tigon.quant.QuantLinear`, from `tigon.quantize` or adopted from a checkpoint
by `tigon.patch`, or a PEFT LoRA layer around one) run `_quantized_step`: the same step on `quant_linear` launches
over weights stacked once a layer (`tigon.quant.stack`), biases allowed; their first prompt chunk runs
`prefill_layer_step` on the same launches (quant_linear's GEMM at prefill rows: from 256 rows on a GPU it
dequantizes each weight once and runs cuBLAS), so a recorded prefill (`prefill_graph`) covers them too.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..hf.causal_lm import fused_prenorm_decoder_forward
from ..hf.forward_source import has_qk_norm, sliding_window_of
from ..hf.instance_forward import is_tigon_forward
from ..hf.lora import plan_qlora
from ..hf.ring_decode import NAME, mask_usable, ring_decode, ring_layer, slot_positions
from ..memory.kv_cache import RollingKVCache
from ..modules import RMSNorm
from ..modules.mlp import GeGLUMLP, SwiGLUMLP, member, plain_linear
from ..ops._launch import DECODE_ROWS
from ..ops.rms_norm import rms_norm_rows
from ..ops.rope import check_cos_sin
from ..ops.swiglu import glu_rows
from ..quant import stack as quant_stack
from ..quant.module import QuantLinear

_ACT = {SwiGLUMLP: "silu", GeGLUMLP: "gelu_tanh"}
# From this many rows a decode step normalizes in an RMSNorm launch of its own before the q/k/v and gate/up
# projections; below, the projections fuse the norm (every program recomputes the row statistics from x: at 8
# rows that is 8 x K elements of L2 reads a program, before its first weight tile). Measured on the H200
# (docs/ops/decode_linear.md): at 8 rows the 8B step 5.131 -> 4.879 ms; at 1 row the 1.5B launches lose ~0.9 us
# each with the extra launch.
SEPARATE_NORM_ROWS = 2


def _plain(lin, dtype) -> bool:
    if not plain_linear(lin):
        return False
    weight = member(lin, "weight")
    return weight.dtype == dtype and weight.is_contiguous()


def _norm_ok(norm, dtype) -> bool:
    if type(norm) is not RMSNorm or norm.offset != 0.0 or norm.casting_mode != "llama":
        return False
    weight = member(norm, "weight")
    return (weight is not None and weight.dtype == dtype and not norm._forward_hooks
            and not norm._forward_pre_hooks)


def _layer_ok(layer, dtype):
    """(attention, MLP, activation) when the layer's norms, MLP kind and hooks are what the fused step computes
    (the projections are checked apart: plain or quantized), else None."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return None
    attn, mlp = member(layer, "self_attn"), member(layer, "mlp")
    if not (_norm_ok(member(layer, "input_layernorm"), dtype)
            and _norm_ok(member(layer, "post_attention_layernorm"), dtype)):
        return None
    act = _ACT.get(type(mlp))
    if act is None or mlp._forward_hooks or mlp._forward_pre_hooks:
        return None
    if has_qk_norm(attn) and not (_norm_ok(member(attn, "q_norm"), dtype) and _norm_ok(member(attn, "k_norm"), dtype)):
        return None
    return attn, mlp, act


def _weights(layer, dtype):
    """(attention projections, gate, up, down, activation) when the fused step computes the layer exactly.
    Every prefill and decode-step forward checks it, so modules and weights are read with `member` (24 us a
    layer less on a 2-core x86 CI machine: 32 -> 12 us)."""
    found = _layer_ok(layer, dtype)
    if found is None:
        return None
    attn, mlp, act = found
    projs = [member(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(_plain(p, dtype) for p in projs):
        return None
    down = member(mlp, "down_proj")
    if not _plain(down, dtype):
        return None
    if mlp.fused_gate_up:
        gate_up = member(mlp, "gate_up_proj")
        if not _plain(gate_up, dtype):
            return None
        gate, up = member(gate_up, "weight").chunk(2, dim=0)
    else:
        gate, up = member(mlp, "gate_proj"), member(mlp, "up_proj")
        if not (_plain(gate, dtype) and _plain(up, dtype)):
            return None
        gate, up = member(gate, "weight"), member(up, "weight")
    return [member(p, "weight") for p in projs], gate, up, member(down, "weight"), act


def _tigon_attention(layer, position_embeddings):
    """The layer's attention module when it runs the "tigon" implementation with RoPE on write, unhooked."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not attn.__dict__.get("_tigon_rope_on_write") or position_embeddings is None:
        return None
    return attn if is_tigon_forward(attn) else None


def _rotary_ok(position_embeddings, b, t, head_dim, device) -> bool:
    """cos, sin as `ops.rope.check_cos_sin` takes them (`[1 or b, t, rd]`, rd even and <= head_dim), floating,
    of one dtype, on `device`: what the ring's unchecked write (`RollingKVLayer.prefill_rope`) reads."""
    if not isinstance(position_embeddings, (tuple, list)) or len(position_embeddings) != 2:
        return False
    cos, sin = position_embeddings
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.is_floating_point()
            and sin.dtype == cos.dtype and cos.device == device and sin.device == device):
        return False
    try:
        check_cos_sin("prefill_layer_step", cos, sin, b, t, head_dim)
    except ValueError:
        return False
    return True


# torch >= 2.5 attends grouped K/V heads in SDPA itself (`enable_gqa`); before, HF's function repeats them.
_SDPA_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def _causal_attention(attn, q, keys, values, key_mask=None):
    """HF's sdpa attention without a mask, `[b, t, heads, head_dim]` out: what `sdpa_attention_forward` calls
    where SDPA takes grouped heads itself (head_dim <= 256, as HF decides), without its ~12 us of host time a
    call; elsewhere that function. Causal from 2 query rows (one query row: the last position, every key, or the
    keys where `key_mask` `[keys]` is true)."""
    mask = None if key_mask is None else key_mask.view(1, 1, 1, -1)
    if _SDPA_GQA and keys.shape[-1] <= 256 and getattr(attn, "is_causal", True):
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=q.shape[2] > 1,
                                             scale=attn.scaling, enable_gqa=q.shape[1] != keys.shape[1])
        return out.transpose(1, 2)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(attn, q, keys, values, mask, dropout=0.0, scaling=attn.scaling)[0]


def prefill_layer_step(layer, hidden_states, attention_mask, past_key_values, position_embeddings):
    """The layer's output for a first, unpadded prompt chunk that fits the ring, or None (its own forward).

    The same kernels and cuBLAS calls as the module-by-module forward (RMSNorm, q/k/v, RoPE, the cache write,
    HF's sdpa attention with is_causal, o_proj, the fused residual add and norm, the MLP), called directly: a
    prefill of a 1-2 B model is bound by the host's time per op, and the module calls, the attention
    interface and the cache dispatch around ~20 kernels a layer cost as much as the kernels themselves.

    The model's last layer, when the cache says its caller reads the last position only
    (`RollingKVCache.last_position_only`, set by tigon.generate around its prefill), writes every position's
    keys and values but computes the query, attention, o_proj and the MLP for the last position alone, and
    returns `[b, 1, hidden]`: the rest of that layer's rows feed nothing the caller reads (1/n_layers of the
    prefill's FLOPs)."""
    attn = _tigon_attention(layer, position_embeddings)
    if (attn is None or attention_mask is not None or not isinstance(past_key_values, RollingKVCache)
            or torch.is_grad_enabled() or attn.config._attn_implementation != NAME):
        return None
    b, t = hidden_states.shape[0], hidden_states.shape[1]
    idx = getattr(attn, "layer_idx", None)
    if t < 2 or not isinstance(idx, int) or not 0 <= idx < len(past_key_values.layers):
        return None
    ring = past_key_values.layers[idx]
    window = sliding_window_of(attn)
    if ring.seen != 0 or t > ring.ring or b > ring.batch_size or (window and t > window):
        return None  # a later chunk, a chunk past the ring or the window: HF's masks are needed
    if not hidden_states.is_contiguous() or not _rotary_ok(position_embeddings, b, t, attn.head_dim,
                                                           hidden_states.device):
        return None
    found = _weights(layer, hidden_states.dtype)
    quantized = _quantized(layer, hidden_states.dtype) if found is None else None
    if found is None and quantized is None:
        return None

    last_only = past_key_values.last_position_only and idx == len(past_key_values.layers) - 1
    # The norms and the GLU through their unchecked row entries: `_weights` checked the modules and dtypes,
    # and every tensor here is a fresh contiguous [b * t, ...] product of this function.
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    rows = b * t
    h, _ = rms_norm_rows(hidden_states.view(rows, -1), ln1.weight, ln1.eps)
    shape = (b, t, -1, attn.head_dim)  # of each [rows, N] projection of h
    residual = hidden_states.view(rows, -1)
    if quantized is not None:  # every plan before the ring is written (None: the layer's own forward)
        stack, plans, act = quantized
        plans = [_adapters(group, h) for group in plans]
        if any(p is None for p in plans):
            return None
        q_all, k, v = (y.view(shape) for y in _outputs(stack.qkv, h, plans[0]))
    else:
        _, gate, up, down, act = found
        q_all = None
        k = F.linear(h, attn.k_proj.weight).view(shape)
        v = F.linear(h, attn.v_proj.weight).view(shape)
    cos, sin = position_embeddings
    key_mask = None
    if last_only:  # one query row a sequence: RoPE at the last position, attention over every key (no mask)
        real = past_key_values.prefill_rows
        if real is None:
            def pick(x):  # [b, t, ...] -> the last row, [b, 1, ...]
                return x[:, -1:]
        else:  # a chunk padded on the right: its last real row, and the keys before it
            at = real - 1

            def pick(x):
                return x.index_select(1, at)

            key_mask = torch.arange(t, device=real.device) < real
        residual = pick(hidden_states).view(b, -1)
        if q_all is None:
            q = F.linear(pick(h.view(b, t, -1)).view(b, -1), attn.q_proj.weight).view(b, 1, -1, attn.head_dim)
        else:  # the stacked launch computed every row's query, as the module forward does; the last one is kept
            q = pick(q_all)
        if has_qk_norm(attn):
            q, k = attn.q_norm(q), attn.k_norm(k)
        keys, values, _ = ring.prefill_rope(k.transpose(1, 2), v.transpose(1, 2), cos, sin)
        q = q.transpose(1, 2)
        q, _ = ops.apply_rope(q, q, pick(cos), pick(sin))
        rows = b
    else:
        q = F.linear(h, attn.q_proj.weight).view(shape) if q_all is None else q_all
        if has_qk_norm(attn):  # Qwen3: RMSNorm on the head dim before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        keys, values, q = ring.prefill_rope(k.transpose(1, 2), v.transpose(1, 2), cos, sin, q.transpose(1, 2))
    out = _causal_attention(attn, q, keys, values, key_mask)
    past_key_values.fused_prefill_layers += 1
    if quantized is not None:
        y = _quantized_tail(stack, plans[1:], act, out.reshape(rows, -1), residual.contiguous(), ln2)
        return y.view(b, rows // b, -1)
    o = F.linear(out.reshape(rows, -1), attn.o_proj.weight)
    normed, h2 = rms_norm_rows(o, ln2.weight, ln2.eps, residual=residual.contiguous())
    # the MLP's inference forward without its four module calls: the same GEMMs and GLU kernel
    if layer.mlp.fused_gate_up:
        m = glu_rows(F.linear(normed, layer.mlp.gate_up_proj.weight), None, act)
    else:
        m = glu_rows(F.linear(normed, gate), F.linear(normed, up), act)
    return (h2 + F.linear(m, down)).view(b, rows // b, -1)


def _normed_projection(x, norm, weights, activation=None):
    """decode_linear of `norm(x)`: the norm fused into the projection below SEPARATE_NORM_ROWS rows, from there
    an rms_norm_rows launch of its own first."""
    if x.shape[0] >= SEPARATE_NORM_ROWS:
        return ops.decode_linear(rms_norm_rows(x, norm.weight, norm.eps)[0], weights, activation=activation)
    return ops.decode_linear(x, weights, norm_weight=norm.weight, eps=norm.eps, activation=activation)


def _attend(attn, ring, q, k, v, attention_mask, position_embeddings):
    """The attention output `[b, heads * head_dim]` of one decode step from the q, k, v projections `[b, N]`
    (views are fine): the q/k norms where the layer has them, RoPE and the ring write, decode attention."""
    b, d = q.shape[0], attn.head_dim
    q, k, v = q.view(b, 1, -1, d), k.view(b, 1, -1, d), v.view(b, 1, -1, d)
    if has_qk_norm(attn):  # Qwen3: RMSNorm on the head dim before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = position_embeddings
    # The ring's next position advances in the attention kernel, not in a kernel of its own.
    keys, values, q = ring.update_rope(k.transpose(1, 2), v.transpose(1, 2), cos, sin, q.transpose(1, 2),
                                       advance=False)
    slot_pos = slot_positions(ring, attention_mask, b)
    out = ring_decode(ring, q, keys, values, slot_pos, scaling=attn.scaling, sliding_window=sliding_window_of(attn),
                      softcap=None, advanced=False)
    return out.reshape(b, -1)


def decode_layer_step(layer, hidden_states, attention_mask, past_key_values, position_embeddings):
    """The layer's output for one decode step, or None where the layer must run its own forward."""
    attn = _tigon_attention(layer, position_embeddings)
    if attn is None:
        return None
    ring = ring_layer(attn, hidden_states, past_key_values)
    if ring is None or hidden_states.shape[0] > DECODE_ROWS:  # decode-sized batches only
        return None
    b = hidden_states.shape[0]
    if not mask_usable(attention_mask, b, ring.ring) or not hidden_states.is_contiguous():
        return None
    found = _weights(layer, hidden_states.dtype)
    if found is None:
        return _quantized_step(layer, attn, ring, hidden_states, attention_mask, position_embeddings)
    (wq, wk, wv, wo), gate, up, down, act = found
    x = hidden_states.view(b, -1)
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    nq, nk = wq.shape[0], wk.shape[0]
    qkv = _normed_projection(x, ln1, [wq, wk, wv])
    out = _attend(attn, ring, qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:], attention_mask, position_embeddings)
    h = ops.decode_linear(out, wo, residual=x)
    m = _normed_projection(h, ln2, [gate, up], activation=act)
    return ops.decode_linear(m, down, residual=h).view_as(hidden_states)


def _quantized(layer, dtype):
    """(LayerStack, the projection modules by group, activation) when every projection of the layer is a
    QuantLinear or a PEFT LoRA layer around one (`tigon.quant.stack`) and the rest is what the fused step
    computes; else None."""
    found = _layer_ok(layer, dtype)
    if found is None:
        return None
    attn, mlp, act = found
    qkv = [member(attn, name) for name in ("q_proj", "k_proj", "v_proj")]
    gate_up = [member(mlp, "gate_up_proj")] if mlp.fused_gate_up else [member(mlp, "gate_proj"),
                                                                        member(mlp, "up_proj")]
    o, down = member(attn, "o_proj"), member(mlp, "down_proj")
    stack = quant_stack.layer_stack(layer, qkv, o, gate_up, down, dtype)
    return None if stack is None else (stack, (qkv, [o], gate_up, [down]), act)


def _adapters(modules, x):
    """Per module, None (a QuantLinear) or the LoRA adapters ([A], [B], [scaling], [p]) PEFT's forward adds to its
    base layer's product (`hf.lora.plan_qlora`: the conditions under which lora_add computes it); None in place
    of the list where a module must run its own forward (no plan, or dropout active)."""
    found = []
    for m in modules:
        if type(m) is QuantLinear:
            found.append(None)
            continue
        plan = plan_qlora(m, x, (), {}) if hasattr(m, "lora_A") else None  # a PEFT LoRA layer, else no plan
        if plan is None or any(p > 0 for p in plan[3]):
            return None
        found.append(plan)
    return found


def _outputs(group, x, adapters):
    """Each projection's output `[b, N_i]` of x for a stacked group (views of one quant_linear launch) or one
    launch a projection, with its adapters added (lora_add), as the modules compute them."""
    if group.stacked:
        w, bias = group.weights[0]
        y = ops.quant_linear(x, w, bias=bias)
        outs = y.split(group.sizes, dim=-1) if len(group.sizes) > 1 else (y,)
    else:
        outs = [ops.quant_linear(x, w, bias=bias) for w, bias in group.weights]
    return [y if a is None else ops.lora_add(y.contiguous(), x, *a) for y, a in zip(outs, adapters)]


def _quantized_step(layer, attn, ring, hidden_states, attention_mask, position_embeddings):
    """`decode_layer_step` for a layer of quantized projections (QuantLinear), or None:

        h1  = rms_norm_rows(x, input_layernorm)
        qkv = quant_linear(h1, [Wq; Wk; Wv])                 # one launch where the layouts stack
        a   = the plain step's RoPE, ring write and attention (`_attend`)
        h   = quant_linear(a, Wo, residual=x)
        m   = quant_linear(rms_norm_rows(h), [Wgate; Wup], activation=act)
        out = quant_linear(m, Wdown, residual=h)

    The norms always run as launches of their own (quant_linear has no norm prologue). A PEFT LoRA layer around
    a QuantLinear (a QLoRA model adopted by tigon.patch) adds its adapters to its slice of the output
    (`ops.lora_add`, as `hf.lora.qlora_forward`); its residual add and GLU then run after the adapters."""
    found = _quantized(layer, hidden_states.dtype)
    if found is None:
        return None
    stack, modules, act = found
    b = hidden_states.shape[0]
    x = hidden_states.view(b, -1)
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    h1, _ = rms_norm_rows(x, ln1.weight, ln1.eps)
    # every plan before the ring is written: the adapters depend on the inputs' dtype and device only
    plans = [_adapters(group, h1) for group in modules]
    if any(p is None for p in plans):
        return None
    q, k, v = _outputs(stack.qkv, h1, plans[0])
    out = _attend(attn, ring, q, k, v, attention_mask, position_embeddings)
    return _quantized_tail(stack, plans[1:], act, out, x, ln2).view_as(hidden_states)


def _quantized_tail(stack, plans, act, out, x, ln2):
    """A quantized layer after its attention, `[rows, hidden]` out: o_proj with the residual x added, the second
    norm, the GLU MLP and down_proj with its residual; `plans` the o, gate/up and down groups' adapters
    (`_adapters`). Rows are a decode step's or a prefill's (quant_linear picks its kernel by the row count)."""
    o_a, gate_up_a, down_a = plans
    if o_a[0] is None:
        w, bias = stack.o.weights[0]
        h = ops.quant_linear(out, w, bias=bias, residual=x)
        h2, _ = rms_norm_rows(h, ln2.weight, ln2.eps)
    else:  # the residual add after the adapters: fused into the norm, as the module forward does
        h2, h = rms_norm_rows(_outputs(stack.o, out, o_a)[0], ln2.weight, ln2.eps, residual=x)
    if stack.gate_up.stacked and all(a is None for a in gate_up_a):
        w, bias = stack.gate_up.weights[0]
        m = ops.quant_linear(h2, w, bias=bias, activation=act)
    else:
        parts = _outputs(stack.gate_up, h2, gate_up_a)
        m = glu_rows(parts[0], None, act) if len(parts) == 1 else glu_rows(parts[0], parts[1], act)
    if down_a[0] is None:
        w, bias = stack.down.weights[0]
        y = ops.quant_linear(m, w, bias=bias, residual=h)
    else:
        y = h + _outputs(stack.down, m, down_a)[0]
    return y


LAYER_STEP = "_tigon_layer_step"  # the key fused_prenorm_decoder_forward reads in the layer's __dict__
_INSTALLED = "_tigon_layer_steps_installed"  # on the model: install() ran (tigon.patch), unpatch clears it


def layer_step(layer, hidden_states, attention_mask, past_key_values, position_embeddings):
    """The hook `install` puts on a layer: the fused decode step for one token, the direct prefill for a chunk;
    None where the layer runs its own forward."""
    step = decode_layer_step if hidden_states.shape[1] == 1 else prefill_layer_step
    return step(layer, hidden_states, attention_mask, past_key_values, position_embeddings)


def _runs_fused_forward(module) -> bool:
    """The module's forward is tigon.patch's pre-norm decoder forward (on the instance or, class-level, on the
    class; functools.wraps keeps the function as `__wrapped__`)."""
    forward = module.__dict__.get("forward")
    if forward is not None:
        return getattr(forward, "__func__", None) is fused_prenorm_decoder_forward
    cls_forward = getattr(type(module), "forward", None)
    return fused_prenorm_decoder_forward in (cls_forward, getattr(cls_forward, "__wrapped__", None))


def install(model) -> list:
    """Put the fused layer step on every layer of `model` that runs Tigon's pre-norm decoder forward and does
    not hold it yet, and record on `model` that it holds it (a later `fused_decode` then skips the module walk,
    ~0.1-0.4 ms of a call's TTFT for a 16-layer model). Returns those layers."""
    layers = [m for m in model.modules() if LAYER_STEP not in m.__dict__ and _runs_fused_forward(m)]
    for layer in layers:
        layer.__dict__[LAYER_STEP] = layer_step
    model.__dict__[_INSTALLED] = True
    return layers


def uninstall(model, layers=None) -> None:
    """Take the fused layer step off `layers` (default: every layer of `model`, and the record of `install`)."""
    if layers is None:
        model.__dict__.pop(_INSTALLED, None)
        quant_stack.drop_stacks(model)  # the quantized layers' stacked weights (kept across fused_decode calls)
    for layer in model.modules() if layers is None else layers:
        layer.__dict__.pop(LAYER_STEP, None)


@contextlib.contextmanager
def fused_decode(model):
    """Within the block the layers of a patched `model` run the fused layer step (see the module docstring);
    on exit the layers this installed it on lose it again, also on an exception. Yields the number installed
    (0 where `install(model)` ran before: `tigon.patch(model)`)."""
    if model.__dict__.get(_INSTALLED):
        yield 0
        return
    layers = install(model)
    try:
        yield len(layers)
    finally:
        model.__dict__.pop(_INSTALLED, None)
        uninstall(model, layers)
