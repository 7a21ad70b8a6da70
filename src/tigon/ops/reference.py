"""Pure-PyTorch reference of every op: the spec, the CPU fallback and the "eager" baseline.

Math is fp32 (or the input's precision when it is fp64), with one cast to the output dtype at the end,
except where the op's definition rounds in between (RMSNorm "llama" mode rounds the normalized value to
the input dtype before the weight, as transformers' LlamaRMSNorm does). Imports torch only.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

CASTING_MODES = ("llama", "gemma", "none")


def _f(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def rms_norm_out_dtype(x_dtype, w_dtype, casting_mode):
    if casting_mode == "llama" and w_dtype is not None:
        return torch.promote_types(x_dtype, w_dtype)
    return x_dtype


def rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    xf = _f(x)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = _f(weight) + offset if weight is not None else None
    out_dtype = rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype, casting_mode)
    if casting_mode == "llama":
        n = n.to(x.dtype).to(n.dtype)
    y = n if w is None else n * w
    return y.to(out_dtype)


def add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x.dtype, as in HF decoders."""
    s = (_f(x) + _f(residual)).to(x.dtype)
    return rms_norm(s, weight, eps, offset=offset, casting_mode=casting_mode), s


def layer_norm(x, weight, bias, eps=1e-5):
    xf = _f(x)
    w = None if weight is None else _f(weight)
    b = None if bias is None else _f(bias)
    return F.layer_norm(xf, (x.shape[-1],), w, b, eps).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_one(x, cos, sin):
    rd = cos.shape[-1]
    xf = _f(x)
    x_rot, x_pass = xf[..., :rd], xf[..., rd:]
    out = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((out, x_pass), dim=-1).to(x.dtype)


def apply_rope(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb in fp32; cos/sin may cover only the first rotary_dim of D."""
    cos = _f(cos).unsqueeze(unsqueeze_dim)
    sin = _f(sin).unsqueeze(unsqueeze_dim)
    return _rope_one(q, cos, sin), _rope_one(k, cos, sin)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    """q [B, T, Hq, D], k [B, T, Hk, D]: each head RMS-normalized over head_dim (its output rounded as rms_norm's),
    then rotate-half RoPE with cos, sin [1 or B, T, D]."""
    qn = rms_norm(q, q_weight, eps, offset=offset, casting_mode=casting_mode)
    kn = rms_norm(k, k_weight, eps, offset=offset, casting_mode=casting_mode)
    return apply_rope(qn, kn, cos, sin, unsqueeze_dim=2)


def swiglu(gate, up):
    return (F.silu(_f(gate)) * _f(up)).to(gate.dtype)


def geglu(gate, up):
    return (F.gelu(_f(gate), approximate="tanh") * _f(up)).to(gate.dtype)


def _glu_mlp(glu, x, gate_weight, up_weight, down_weight):
    gate_up = x @ gate_weight.t()
    gate, up = (gate_up, x @ up_weight.t()) if up_weight is not None else gate_up.chunk(2, dim=-1)
    return glu(gate, up) @ down_weight.t()


def swiglu_mlp(x, gate_weight, up_weight, down_weight):
    """(silu(x W_g^T) * (x W_u^T)) W_d^T; up_weight None: gate_weight is packed [2I, H] = [gate; up]."""
    return _glu_mlp(swiglu, x, gate_weight, up_weight, down_weight)


def geglu_mlp(x, gate_weight, up_weight, down_weight):
    return _glu_mlp(geglu, x, gate_weight, up_weight, down_weight)


def cross_entropy(
    logits,
    target,
    *,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss_scale=0.0,
    softcap: Optional[float] = None,
    num_items_in_batch=None,
):
    """F.cross_entropy on fp32 logits, plus z-loss (z * lse^2 per token) and optional tanh softcap.

    reduction "mean" divides by the number of non-ignored tokens (NaN when there are none, like
    F.cross_entropy); with `num_items_in_batch` the loss is sum / num_items_in_batch instead.
    """
    V = logits.shape[-1]
    x = _f(logits).reshape(-1, V)
    t = target.reshape(-1)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    valid = t != ignore_index
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    # Ignored rows take no part, as in the kernel (which never reads them): NaN or inf padding there gives a
    # zero gradient, where F.cross_entropy's would be NaN (0 * NaN in the softmax backward).
    x = torch.where(valid[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    # lse shifted by the row max, as F.cross_entropy and the kernel compute it: a +inf logit gives NaN (inf -
    # inf) there, where torch.logsumexp would special-case it to inf. The max is a constant for autograd.
    m = x.detach().amax(dim=-1, keepdim=True)
    lse = (m + (x - m).exp().sum(dim=-1, keepdim=True).log()).squeeze(-1)
    loss = lse - x.gather(1, t_safe[:, None]).squeeze(1)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - x.mean(dim=-1))
    if z_loss_scale:
        loss = loss + z_loss_scale * lse.pow(2)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if num_items_in_batch is not None:
        return loss.sum() / num_items_in_batch
    if reduction == "mean":
        return loss.sum() / valid.sum()
    if reduction == "sum":
        return loss.sum()
    return loss.reshape(target.shape)


def linear_cross_entropy(hidden, weight, target, bias=None, **ce_kwargs):
    """cross_entropy(hidden @ weight.T + bias, target): builds the full logits (that is the point of the spec)."""
    h = _f(hidden).reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # -1 is ambiguous when H = 0
    logits = h @ _f(weight).t()
    if bias is not None:
        logits = logits + _f(bias)
    loss = cross_entropy(logits, target.reshape(-1), **ce_kwargs)
    return loss.reshape(target.shape) if loss.dim() else loss


# Decode ops (inference): a ring-buffer KV cache, the attention that reads it in place, the projections with
# their neighbours fused in. Each of these writes or reads cache slots exactly as the kernel does.


def ring_slot(p, sink, recent, *, out=None):
    """Slot of absolute position p in a ring of `sink + recent` slots whose first `sink` never roll: p itself
    below the sinks, else `sink + (p - sink) % recent`. p: an int64 tensor; sink, recent: ints or one-element
    int64 tensors (a decode step's device constants). out: an int64 tensor other than p to write the slot into
    (no allocation). The one definition of the rule; kernels use its copy, kv_write._ring_slot."""
    if out is None:
        laps = torch.div(p - sink, recent, rounding_mode="floor").clamp(min=0)  # below the sinks: no lap
        return p - laps * recent
    torch.sub(p, sink, out=out)
    out.div_(recent, rounding_mode="floor").clamp_(min=0).mul_(recent)
    return torch.sub(p, out, out=out)


def rope_kv_write(key, value, cos, sin, k_cache, v_cache, slots, *, query=None):
    """RoPE(key) and value into k_cache / v_cache at `slots` (a slot outside [0, C) is skipped), rotation in
    fp32 (`apply_rope`), one cast at the store. Returns RoPE(query) or None. Syncs on the slots."""
    q_embed, k_embed = apply_rope(query if query is not None else key, key, cos, sin)
    keep = ((slots >= 0) & (slots < k_cache.shape[2])).nonzero().flatten()
    k_cache.index_copy_(2, slots[keep], k_embed.index_select(2, keep).to(k_cache.dtype))
    v_cache.index_copy_(2, slots[keep], value.index_select(2, keep).to(v_cache.dtype))
    return q_embed if query is not None else None


def rope_kv_append(key, value, cos, sin, k_cache, v_cache, positions, next_position, *, sink=0, query=None):
    """rope_kv_write at the ring slots of positions next_position + t (`ring_slot`), recorded in `positions`;
    next_position is not advanced. A negative position's slot is negative: nothing of that token is written, as
    in the kernel. Syncs on the slots."""
    p = next_position.reshape(1) + torch.arange(key.shape[2], device=next_position.device)
    slots = ring_slot(p, sink, k_cache.shape[2] - sink)
    kept = p >= 0
    positions.index_copy_(0, slots[kept], p[kept])
    return rope_kv_write(key, value, cos, sin, k_cache, v_cache, slots, query=query)


def decode_attention(q, k_cache, v_cache, slot_pos, q_pos, *, scale=None, sliding_window=None, softcap=None):
    """One query token per sequence over a cache whose slots hold arbitrary positions: slot s is attended iff
    0 <= slot_pos[s] <= q_pos (and q_pos - slot_pos[s] < sliding_window). q [B, Hq, 1, D], caches
    [B, Hkv, C, D], slot_pos [B, C] or [C], q_pos [B], [1] or []. softcap c: scores c * tanh(s / c). fp32 math
    (fp64 for fp64 inputs), one cast at the end; a row with no attended slot is NaN."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hq, _, D = q.shape
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.to(ct).reshape(B, Hkv, Hq // Hkv, D)
    sp = slot_pos.expand(B, C)
    qp = q_pos.reshape(-1, 1)  # [B, 1] or [1, 1]
    allowed = (sp >= 0) & (sp <= qp)
    if sliding_window:
        allowed = allowed & (qp - sp < sliding_window)
    s = torch.einsum("bhgd,bhcd->bhgc", qf, k_cache.to(ct)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)  # a row with nothing allowed is NaN
    # What unattended slots hold (stale values, an uninitialized cache's NaN) must not leak in via 0 * NaN.
    vf = v_cache.to(ct).masked_fill(~allowed[:, None, :, None], 0.0)
    out = torch.einsum("bhgc,bhcd->bhgd", p, vf)
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def decode_linear(x, weights, *, norm_weight=None, eps=1e-6, residual=None, activation=None):
    """[rms_norm(x)] @ W_i^T for 1-3 weights (concatenated), or act(x gate^T) * (x up^T) with activation "silu" /
    "gelu_tanh", then + residual: the unfused modules in fp32 (fp64 for fp64 inputs), rounding to x.dtype where
    they round (the norm output, each projection, the GLU product, the sum)."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    outs = [(h.to(ct) @ w.to(ct).t()).to(x.dtype) for w in weights]
    if activation is not None:
        glu = swiglu if activation == "silu" else geglu
        y = glu(outs[0], outs[1])
    else:
        y = torch.cat(outs, dim=-1)
    if residual is not None:
        y = (y.to(ct) + residual.to(ct)).to(x.dtype)
    return y


# The formulas as Hugging Face models write them, run in the input dtype: the "torch in dtype" side of
# the tests' error bound and the "eager" provider of the benchmarks.


def eager_rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    if casting_mode == "llama":  # LlamaRMSNorm
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        w = weight if not offset else offset + weight
        return w * h.to(x.dtype)
    if casting_mode == "gemma":  # GemmaRMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (offset + weight.float())).type_as(x)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (offset + weight)


def eager_add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    s = x + residual
    return eager_rms_norm(s, weight, eps, offset=offset, casting_mode=casting_mode), s


def eager_layer_norm(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def eager_apply_rope(q, k, cos, sin, unsqueeze_dim=1):  # transformers' apply_rotary_pos_emb
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_swiglu(gate, up):
    return F.silu(gate) * up


def eager_geglu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def eager_cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """What HF's loss does: upcast the logits to fp32, then F.cross_entropy."""
    V = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, V), target.reshape(-1), ignore_index=ignore_index,
        reduction=reduction, label_smoothing=label_smoothing,
    )


# ---------------------------------------------------------------------------------------------------------------
# Fused-linear preference, RL and distillation losses (tigon.ops.losses): the full logits, then each method's
# formula. fp32 math, or fp64 for fp64 inputs; differentiable in every input that requires grad.
# ---------------------------------------------------------------------------------------------------------------


def _head_logp(hidden, weight, bias, target, ignore_index, temperature=1.0):
    """(per-token log p(target) [..], mask [..], log-softmax [.., V], logits [.., V]) of hidden @ weight.T + b."""
    logits = _f(hidden) @ _f(weight).T
    if bias is not None:
        logits = logits + _f(bias)
    logsm = torch.log_softmax(logits / temperature, -1)
    mask = target != ignore_index
    lp = logsm.gather(-1, torch.where(mask, target, 0).long().unsqueeze(-1)).squeeze(-1)
    return lp * mask, mask.to(lp.dtype), logsm, logits


def _seq_logp(lp, mask, average):
    return lp.sum(-1) / mask.sum(-1) if average else lp.sum(-1)


def fused_linear_preference(hidden, weight, target, bias=None, *, kind="dpo", loss_type="sigmoid", beta=0.1,
                            alpha=1.0, label_smoothing=0.0, gamma=0.5, discopop_tau=0.05, ignore_index=-100,
                            compute_nll_loss=False, nll_target=None, average_log_prob=False, ref_logps=None,
                            ref_hidden=None, ref_weight=None, ref_bias=None):
    """Pairwise preference losses, chosen half first: DPO (Rafailov et al. 2023) and its variants, ORPO (Hong et
    al. 2024), CPO (Xu et al. 2024), SimPO (Meng et al. 2024); the outputs of liger-kernel 0.8.5."""
    B, T = target.shape
    P = B // 2
    lp, mask, _, logits = _head_logp(hidden, weight, bias, target, ignore_index)
    seq = _seq_logp(lp, mask, average_log_prob)
    pc, pr = seq[:P], seq[P:]
    if ref_logps is not None:
        rc, rr = _f(ref_logps)[:P], _f(ref_logps)[P:]
    elif ref_hidden is not None:
        with torch.no_grad():
            rlp, rmask, _, _ = _head_logp(ref_hidden, ref_weight, ref_bias, target, ignore_index)
            ref = _seq_logp(rlp, rmask, average_log_prob)
        rc, rr = ref[:P], ref[P:]
    else:
        rc = rr = torch.zeros((), dtype=seq.dtype)
    nll = torch.zeros((), dtype=seq.dtype)
    if compute_nll_loss:
        if nll_target is None:
            nll = -lp[:P].sum() / mask[:P].sum()
        else:
            nlp, nmask, _, _ = _head_logp(hidden, weight, bias, nll_target, ignore_index)
            nll = -nlp[:P].sum() / nmask[:P].sum()
    ls = label_smoothing
    extra = ()
    if kind == "orpo":
        # log odds(y) = log p - log(1 - p), p the (mean-token) sequence probability
        lo = (pc - torch.log(-torch.expm1(pc))) - (pr - torch.log(-torch.expm1(pr)))
        ratio = torch.log(torch.sigmoid(lo))
        pref = -beta * ratio.mean()
        cw, rw = beta * pc, beta * pr
        extra = (ratio.mean(), lo.mean())
    elif kind in ("cpo", "simpo"):
        u = beta * (pc - pr) - (gamma if kind == "simpo" else 0.0)
        pref = (-(1 - ls) * torch.log(torch.sigmoid(u)) - ls * torch.log(torch.sigmoid(-u))).mean()
        cw, rw = beta * pc, beta * pr
    else:
        cw, rw = beta * (pc - rc), beta * (pr - rr)
        u = cw - rw
        sig, logsig = torch.sigmoid, lambda v: torch.log(torch.sigmoid(v))
        per_pair = {
            "sigmoid": lambda: -logsig(u),
            "hinge": lambda: torch.clamp(1 - u, min=0),
            "exo_pair": lambda: sig(u) * (logsig(u) - math.log(1 - ls)) + sig(-u) * (logsig(-u) - math.log(ls)),
            "nca_pair": lambda: -logsig(cw) - 0.5 * logsig(-cw) - 0.5 * logsig(-rw),
            "robust": lambda: ((1 - ls) * -logsig(u) - ls * -logsig(-u)) / (1 - 2 * ls),
            "bco_pair": lambda: -logsig(cw) - logsig(-rw),
            "sppo_hard": lambda: (cw / beta - 1 / (2 * beta)) ** 2 + (rw / beta + 1 / (2 * beta)) ** 2,
            "apo_zero": lambda: (1 - sig(cw)) + sig(rw),
            "apo_down": lambda: sig(cw) + (1 - sig(u)),
            "discopop": lambda: -logsig(u) * (1 - sig(u / discopop_tau)) + torch.exp(-u) * sig(u / discopop_tau),
        }[loss_type]
        pref = per_pair().mean()
    n = P * T * weight.shape[0]
    aux = (pc, pr, logits[:P].sum() / n, logits[P:].sum() / n, nll, cw, rw) + extra
    return alpha * nll + pref, tuple(a.detach() for a in aux)


def fused_linear_kto(hidden, weight, target, preference_labels, bias=None, *, beta=0.1, ignore_index=-100,
                     average_log_prob=False, kl=None, ref_logps=None, ref_hidden=None, ref_weight=None,
                     ref_bias=None):
    """KTO (Ethayarajh et al. 2024) as liger-kernel 0.8.5: mean over sequences of 1 - sigmoid(beta (r - kl)) for
    desirable, 1 - sigmoid(beta (kl - r)) for undesirable ones, r the policy-minus-reference log-ratio."""
    lp, mask, _, logits = _head_logp(hidden, weight, bias, target, ignore_index)
    seq = _seq_logp(lp, mask, average_log_prob)
    if ref_logps is not None:
        ref = _f(ref_logps)
    elif ref_hidden is not None:
        with torch.no_grad():
            rlp, rmask, _, _ = _head_logp(ref_hidden, ref_weight, ref_bias, target, ignore_index)
            ref = _seq_logp(rlp, rmask, average_log_prob)
    else:
        ref = torch.zeros_like(seq)
    r = seq - ref
    k = torch.zeros_like(r) if kl is None else _f(kl)
    lab = preference_labels.bool()
    loss = torch.where(lab, 1 - torch.sigmoid(beta * (r - k)), 1 - torch.sigmoid(beta * (k - r))).mean()
    rows = logits.sum((-1, -2))
    aux = (seq[lab].sum(), seq[~lab].sum(), rows[lab].sum(), rows[~lab].sum(), beta * r[lab].sum(),
           beta * r[~lab].sum())
    return loss, tuple(a.detach() for a in aux)


def fused_linear_logprobs(hidden, weight, target, bias=None, *, temperature=1.0, logit_scale=1.0, ignore_index=-100):
    """(log p(target) [N], entropy [N]) of softmax(logit_scale * (hidden @ weight.T + bias) / temperature);
    0 log-prob for ignored targets (their entropy is still the row's)."""
    x = _f(hidden) @ _f(weight).T
    if bias is not None:
        x = x + _f(bias)
    logsm = torch.log_softmax(x * (logit_scale / temperature), -1)
    valid = (target != ignore_index) & (target >= 0) & (target < weight.shape[0])
    lp = logsm.gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1)).squeeze(-1) * valid
    return lp, -(logsm.exp() * logsm).sum(-1)


def fused_linear_grpo(hidden, weight, selected_token_ids, attention_mask, advantages, bias=None, *,
                      ref_per_token_logps=None, old_per_token_logps=None, ref_hidden=None, ref_weight=None,
                      ref_bias=None, beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
                      max_completion_length=None, importance_sampling_level="token", temperature=1.0, delta=None,
                      num_items_in_batch=None, entropy_coef=0.0):
    """GRPO (Shao et al. 2024) with the normalizations of GRPO, BNPO, Dr. GRPO (Liu et al. 2025) and DAPO (Yu et al.
    2025): per-token loss -min(w A, clip(w, 1 - eps_lo, 1 + eps_hi) A) + beta k3(ref, logp) - entropy_coef H,
    w = exp(logp - old) (token level) or exp(mean_t(logp - old)) (sequence level, GSPO). Returns (loss, metrics:
    [mean k3 if beta], clip fraction)."""
    B, T = selected_token_ids.shape
    x = _f(hidden) @ _f(weight).T
    if bias is not None:
        x = x + _f(bias)
    logsm = torch.log_softmax(x / temperature, -1)
    lp = logsm.gather(-1, selected_token_ids.long().unsqueeze(-1)).squeeze(-1)
    m = _f(attention_mask)
    if ref_per_token_logps is not None:
        ref = _f(ref_per_token_logps)
    elif ref_hidden is not None:
        with torch.no_grad():
            rx = _f(ref_hidden) @ _f(ref_weight).T + (0 if ref_bias is None else _f(ref_bias))
            ref = torch.log_softmax(rx / temperature, -1)
            ref = ref.gather(-1, selected_token_ids.long().unsqueeze(-1)).squeeze(-1)
    else:
        ref = lp.detach()
    old = lp.detach() if old_per_token_logps is None else _f(old_per_token_logps)
    log_ratio = lp - old
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)
    w = torch.exp(log_ratio)
    lo, hi = 1 - epsilon_low, 1 + epsilon_high
    a = _f(advantages).unsqueeze(1)
    w1 = w if delta is None else torch.clamp(w, max=delta)
    per_tok = -torch.minimum(w1 * a, torch.clamp(w, lo, hi) * a)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    if beta:
        per_tok = per_tok + beta * kl
    if entropy_coef:
        per_tok = per_tok + entropy_coef * (logsm.exp() * logsm).sum(-1)
    if loss_type == "grpo":
        loss = ((per_tok * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / B
    elif loss_type == "bnpo":
        loss = (per_tok * m).sum() / m.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        loss = (per_tok * m).sum() / (B * max_completion_length)
    else:  # dapo
        n = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=m.dtype)
        loss = (per_tok * m).sum() / n.clamp(min=1)
    total = m.sum().clamp(min=1)
    clipped = ((w < lo) & (a < 0)) | ((w > hi) & (a > 0))
    metrics = ([(kl * m).sum().detach() / total] if beta else []) + [(clipped.expand_as(m) * m).sum() / total]
    return loss, metrics


def fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                     teacher_bias=None, *, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100,
                     temperature=1.0):
    """Generalized JSD distillation (Agarwal et al. 2024, GKD) with a hard-label CE mix, as liger-kernel 0.8.5:
    soft = sum over unignored tokens of beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S of the
    temperature-scaled softmaxes (beta 0: KL(T || S), beta 1: KL(S || T)); hard = CE of the untempered student
    logits; each divided by the number of unignored tokens. Returns (loss, soft, hard)."""
    zs = _f(student_input) @ _f(student_weight).T + (0 if student_bias is None else _f(student_bias))
    with torch.no_grad():
        zt = _f(teacher_input) @ _f(teacher_weight).T + (0 if teacher_bias is None else _f(teacher_bias))
    mask = true_labels != ignore_index
    n = mask.sum().clamp(min=1)
    hard = F.cross_entropy(zs, true_labels.long(), ignore_index=ignore_index, reduction="sum") / n
    s, t = torch.softmax(zs / temperature, -1), torch.softmax(zt / temperature, -1)
    ls, lt = torch.log_softmax(zs / temperature, -1), torch.log_softmax(zt / temperature, -1)
    if beta == 0:
        per = (t * (lt - ls)).sum(-1)
    elif beta == 1:
        per = (s * (ls - lt)).sum(-1)
    else:
        lm = torch.log(beta * t + (1 - beta) * s)
        per = beta * (t * (lt - lm)).sum(-1) + (1 - beta) * (s * (ls - lm)).sum(-1)
    soft = (per * mask).sum() / n
    return weight_hard_loss * hard + weight_soft_loss * soft, soft, hard


# LoRA linear (tigon.ops.lora_linear): PEFT's lora.Linear forward, the base projection plus each adapter's scaled
# low-rank product; the spec of the fused op and its CPU fallback. lora_add: the adapters alone, over a base output.


def _add_lora(out, xf, lora_a, lora_b, scaling, dropout_p, masks):
    """out + sum_i scaling_i * drop_i(xf) A_i^T B_i^T in fp32, the adapters added in order."""
    for i, (a, b, s) in enumerate(zip(lora_a, lora_b, scaling)):
        p = 0.0 if dropout_p is None else dropout_p[i]
        mask = None if masks is None else masks[i]
        if mask is not None:
            xin = xf * mask / (1 - p)
        elif p > 0:
            xin = F.dropout(xf, p, training=True)
        else:
            xin = xf
        out = out + s * ((xin @ _f(a).T) @ _f(b).T)
    return out


def lora_linear(x, weight, bias, lora_a, lora_b, scaling, dropout_p=None, masks=None):
    """x W^T + bias + sum_i scaling_i * drop_i(x) A_i^T B_i^T (PEFT's lora.Linear), fp32 math, cast to x.dtype.
    lora_a, lora_b, scaling: one entry per adapter; dropout_p: None (no dropout) or one p per adapter; masks:
    None (dropout drawn here) or one bool [..., in] mask per adapter (None where p == 0), to replay a mask."""
    xf = _f(x)
    out = xf @ _f(weight).T
    if bias is not None:
        out = out + _f(bias)
    return _add_lora(out, xf, lora_a, lora_b, scaling, dropout_p, masks).to(x.dtype)


def lora_add(base_out, x, lora_a, lora_b, scaling, dropout_p=None, masks=None):
    """base_out + sum_i scaling_i * drop_i(x) A_i^T B_i^T (tigon.ops.lora_add: the adapters of PEFT's bitsandbytes
    LoRA layers over their base output), fp32 math, cast to x.dtype; arguments as lora_linear's."""
    return _add_lora(_f(base_out), _f(x), lora_a, lora_b, scaling, dropout_p, masks).to(x.dtype)


def _moe_valid(pos, n_rows):
    """[T * K] bool: the pairs whose row of the expert-sorted buffer is below n_rows (all of them for None)."""
    flat = pos.reshape(-1)
    return torch.ones_like(flat, dtype=torch.bool) if n_rows is None else flat < n_rows.reshape(())


def moe_combine(y, weights, pos, n_rows=None):
    """out[t] = sum_k weights[t, k] * y[pos[t, k]] in fp32, cast to y.dtype (the routed experts' weighted sum).
    y [S, H] rows in expert order; weights [T, K] or None (all ones); pos [T, K] ints, a permutation of
    range(S = T * K); n_rows None or a 1-element int tensor: rows of y at or past it read as zero."""
    T, K = pos.shape
    rows = _f(y)[pos.reshape(-1).long()]
    rows = torch.where(_moe_valid(pos, n_rows)[:, None], rows, 0.0)
    if weights is not None:
        rows = rows * _f(weights).reshape(-1, 1)
    return rows.view(T, K, -1).sum(1).to(y.dtype)


def moe_permute(x, pos, n_rows=None):
    """out[pos[t, k]] = x[t]: the [S = T * K, H] expert-sorted copy of the tokens x [T, H], rows at or past n_rows
    zero. pos, n_rows as in moe_combine."""
    T, K = pos.shape
    src = torch.where(_moe_valid(pos, n_rows)[:, None], _f(x).repeat_interleave(K, 0), 0.0)
    out = src.new_zeros(T * K, x.shape[-1]).index_copy(0, pos.reshape(-1).long(), src)
    return out.to(x.dtype)


def grad_norm(grads):
    """The total 2-norm of a list of tensors, fp32 (clip_grad_norm_'s, before it scales)."""
    return torch.sqrt(sum((_f(g).pow(2).sum() for g in grads), torch.zeros((), device=grads[0].device)))


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step, maximize=False,
                norm=None, max_grad_norm=None, master_params=None):
    """torch.optim.AdamW's update of step `step` in place, in fp32 (fp64 for fp64 tensors), one rounding per
    store; the gradients scaled by min(1, max_grad_norm / (norm + 1e-6)) first when max_grad_norm is set. With
    master_params the update reads and writes them, and params receive its rounding."""
    coef = None if max_grad_norm is None else torch.clamp(max_grad_norm / (_f(norm).reshape(()) + 1e-6), max=1.0)
    step_size = lr / (1.0 - beta1**step)
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    masters = master_params if master_params is not None else [None] * len(params)
    for p, g, m, v, w in zip(params, grads, exp_avgs, exp_avg_sqs, masters):
        gf = _f(g) if coef is None else _f(g) * coef
        gf = -gf if maximize else gf
        mf = beta1 * _f(m) + (1.0 - beta1) * gf
        vf = beta2 * _f(v) + (1.0 - beta2) * gf * gf
        pf = _f(p if w is None else w) * (1.0 - lr * weight_decay)
        pf = pf - step_size * mf / (vf.sqrt() / bc2_sqrt + eps)
        if w is not None:
            w.copy_(pf)
        p.copy_(pf)
        m.copy_(mf)
        v.copy_(vf)


# AdamW with 8-bit block-quantized moments (ops/adamw8bit.py, docs/ops/adamw8bit.md): a block of MOMENT_BLOCK
# consecutive elements shares one fp32 scale, its absmax; each element is a uint8 code.
MOMENT_BLOCK = 256
MOMENT_CMAX = (127, 255)  # exp_avg (signed: sign bit | 0..127), exp_avg_sq (0..255)
MOMENT_BIAS = (1016 - 127, 1016 - 255)  # code c is fp32 bits (c + bias) << 20: c = cmax is exactly 1.0
_U32 = 0xFFFFFFFF


def _div_rn(a, b) -> torch.Tensor:
    """a / b of fp32 values (tensors, or floats that are fp32 values), correctly rounded to fp32 whatever torch's
    own kernels do: the quotient in fp64 rounds to the fp32 one (53 >= 2 * 24 + 2 bits)."""
    return (torch.as_tensor(a).double() / torch.as_tensor(b).double()).float()


def _sqrt_rn(a: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 sqrt (torch's vectorized CPU sqrt is up to 1 ulp off; Triton's sqrt_rn is not)."""
    return a.double().sqrt().float()


def _fp32(x: float) -> float:
    """The Python float x rounded to fp32, as a kernel receives a float argument."""
    return torch.tensor(x, dtype=torch.float32).item()


def moment_seed(step: int, salt: int) -> int:
    """The hash seed of one step's stochastic rounding (salt 1 for exp_avg, 2 for exp_avg_sq): < 2^31."""
    return ((step * 0x9E3779B9) ^ (salt * 0x85EBCA6B)) & 0x7FFFFFFF


def _mul_u32(x, c: int):
    """x * c mod 2^32 for x in [0, 2^32), in int64 without overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _U32


def moment_hash(index: torch.Tensor, seed: int) -> torch.Tensor:
    """The 32-bit hash of (index mod 2^32) ^ seed, an int64 tensor of uint32 values; `>> 12` of it is the 20-bit
    random integer of the stochastic rounding."""
    x = (index.long() & _U32) ^ seed
    x = x ^ (x >> 16)
    x = _mul_u32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul_u32(x, 0x846CA68B)
    return x ^ (x >> 16)


def encode_moment(x: torch.Tensor, seed: int, signed: bool, start: int = 0):
    """(uint8 codes [n], fp32 scales [cdiv(n, 256)]) of the flattened x, whose first element has index `start`
    (a multiple of 256) in the whole tensor: per block, scale = absmax; per element u = |x| / scale in fp32,
    c = clamp(((bits(u) + r) >> 20) - bias, 0, cmax) with r the element's 20 random bits; the sign bit 0x80
    for negative x when `signed`. A NaN is left out of its block's absmax and takes code cmax."""
    x = x.reshape(-1).float()
    n, cmax, bias = x.numel(), MOMENT_CMAX[not signed], MOMENT_BIAS[not signed]
    nb = -(-n // MOMENT_BLOCK)
    a = F.pad(x.abs(), (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
    scales = torch.where(a.isnan(), 0.0, a).amax(1)  # a NaN stays in its element (code cmax)
    u = _div_rn(a, torch.where(scales > 0, scales, 1.0)[:, None]).reshape(-1)[:n]
    bits = (u.view(torch.int32).long() & 0x7FFFFFFF).clamp(max=0x3F800000)  # u <= 1.0; a NaN's bits become 1.0's
    r = moment_hash(torch.arange(start, start + n, device=x.device), seed) >> 12
    c = (((bits + r) >> 20) - bias).clamp(0, cmax)
    if signed:
        c = c | torch.where(x < 0, 0x80, 0)
    return c.to(torch.uint8), scales


def decode_moment(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 [n] from uint8 codes [n] and fp32 scales [cdiv(n, 256)]: c = 0 is 0, else fp32 bits
    ((c + bias) << 20) times the block's scale (negated for a set sign bit when `signed`)."""
    n = codes.numel()
    c = codes.reshape(-1).long()
    mag = c & 0x7F if signed else c
    bits = ((mag + MOMENT_BIAS[not signed]) << 20).int()
    nb = -(-n // MOMENT_BLOCK)
    val = F.pad(bits.view(torch.float32), (0, nb * MOMENT_BLOCK - n)).view(nb, MOMENT_BLOCK)
    val = (val * scales.reshape(nb, 1).float()).reshape(-1)[:n]
    val = torch.where(mag == 0, 0.0, val)
    return torch.where(c >= 0x80, -val, val) if signed else val


def quantize_moments(exp_avg, exp_avg_sq, *, step=0):
    """(m_codes, m_scales, v_codes, v_scales) of float moments, with step `step`'s stochastic rounding."""
    m = encode_moment(exp_avg, moment_seed(step, 1), True)
    v = encode_moment(exp_avg_sq, moment_seed(step, 2), False)
    return (*m, *v)


def dequantize_moments(m_codes, m_scales, v_codes, v_scales, shape):
    """(exp_avg, exp_avg_sq), fp32 tensors of `shape`."""
    return (decode_moment(m_codes, m_scales, True).view(shape), decode_moment(v_codes, v_scales, False).view(shape))


def adamw8bit_step_(param, grad, m_codes, m_scales, v_codes, v_scales, *, lr, beta1, beta2, eps, weight_decay, step,
                    maximize=False, norm=None, max_grad_norm=None):
    """torch.optim.AdamW's update of step `step` in place, in fp32, with the moments decoded from and encoded back
    to 8-bit codes (the update itself uses the new moments before quantization); param rounded once. Each fp32
    operation is one IEEE rounding (divisions and sqrt through fp64), as in the kernel: the same bits, but for
    the GPU's fused multiply-adds."""
    g = grad.reshape(-1).float()
    if max_grad_norm is not None:
        g = g * torch.clamp(_div_rn(_fp32(max_grad_norm), norm.reshape(()).float() + 1e-6), max=1.0)
    g = -g if maximize else g
    m = beta1 * decode_moment(m_codes, m_scales, True) + (1.0 - beta1) * g
    v = beta2 * decode_moment(v_codes, v_scales, False) + (1.0 - beta2) * g * g
    p = param.reshape(-1).float() * (1.0 - lr * weight_decay)
    denom = _div_rn(_sqrt_rn(v), _fp32(math.sqrt(1.0 - beta2**step))) + eps
    p = p - _div_rn(lr / (1.0 - beta1**step) * m, denom)
    new = (*encode_moment(m, moment_seed(step, 1), True), *encode_moment(v, moment_seed(step, 2), False))
    for dst, src in zip((m_codes, m_scales, v_codes, v_scales), new):
        dst.copy_(src)
    param.copy_(p.view(param.shape))
