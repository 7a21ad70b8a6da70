"""RL losses on the fused linear head: GRPO and its normalizations (BNPO, Dr. GRPO, DAPO; token- or sequence-level
importance ratios), and the per-token log-prob + entropy op at a temperature that TRL's fused head computes.

Layout as Liger-Kernel's GRPO: hidden [B, T, H] (B completions), selected_token_ids [B, T], attention_mask [B, T],
advantages [B]. Math and VJP: docs/ops/losses.md.
"""

import math
from typing import Optional

import torch

from .. import _launch, _library, reference
from . import _common, _engine

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LOGPROB_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def grpo_token_loss(lp, ent, m, adv, ref, old, beta, eps_lo, eps_hi, level, delta, ent_coef):
    """(per-token loss [B, T], k3 [B, T], clipped [B, T]) of GRPO from per-token log-probs (liger 0.8.5's math)."""
    old = lp.detach() if old is None else old
    ref = lp.detach() if ref is None else ref
    log_w = lp - old
    if level == "sequence":
        log_w = ((log_w * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    w = torch.exp(log_w)
    w_clip = torch.clamp(w, 1 - eps_lo, 1 + eps_hi)
    a = adv.unsqueeze(1)
    w1 = w if math.isnan(delta) else torch.clamp(w, max=delta)
    per_tok = -torch.min(w1 * a, w_clip * a)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1.0
    if beta != 0.0:
        per_tok = per_tok + beta * k3
    if ent_coef != 0.0:
        per_tok = per_tok - ent_coef * ent
    clipped = ((w < 1 - eps_lo) & (a < 0)) | ((w > 1 + eps_hi) & (a > 0))
    return per_tok, k3, clipped.expand_as(m)


def grpo_reduce(per_tok, m, loss_type, max_len, num_items):
    B = m.shape[0]
    if loss_type == "grpo":
        return ((per_tok * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / B
    if loss_type == "bnpo":
        return (per_tok * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_tok * m).sum() / (B * max_len)
    n = m.sum() if num_items is None else num_items.float().reshape(())
    return (per_tok * m).sum() / n.clamp(min=1.0)


def _grpo_launch(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, attention_mask: torch.Tensor,
    advantages: torch.Tensor, bias: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
    old_logps: Optional[torch.Tensor], ref_hidden: Optional[torch.Tensor], ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor], num_items: Optional[torch.Tensor], floats: list[float], loss_type: str,
    level: str, max_len: int, need_dh: bool, need_dw: bool, need_db: bool, cfg_ints: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B*T, H], ids/attention_mask [B, T], advantages [B]. Returns (loss, mean k3, clip fraction, dh, dW,
    db) with the gradients for grad_output 1 (empty when not asked)."""
    cfg = _engine.config_from(cfg_ints)
    beta, eps_lo, eps_hi, temperature, delta, ent_coef = floats
    B, T = ids.shape
    t = ids.reshape(-1)
    inv_t = 1.0 / temperature
    m = attention_mask.float()
    ref = None if ref_logps is None else ref_logps.float()
    if ref is None and ref_hidden is not None:
        rs = _engine.logp_stats(ref_hidden, ref_weight, ref_bias, t, scale=inv_t, cfg=cfg)
        ref = (rs["xt"] - rs["lse"]).view(B, T)
    grads = need_dh or need_dw or need_db
    if grads and level == "token":
        return _grpo_one_pass(hidden, weight, bias, t, m, advantages.float(), ref, old_logps, floats, loss_type,
                              max_len, num_items, need_dh, need_dw, need_db, cfg)
    st = _engine.logp_stats(hidden, weight, bias, t, scale=inv_t, cfg=cfg)
    with _engine.autograd_inside():
        lp = (st["xt"] - st["lse"]).requires_grad_()
        ent = st["ent"].clone().requires_grad_()
        per_tok, k3, clipped = grpo_token_loss(
            lp.view(B, T), ent.view(B, T), m, advantages.float(), ref, None if old_logps is None else old_logps.float(),
            beta, eps_lo, eps_hi, level, delta, ent_coef)
        loss = grpo_reduce(per_tok, m, loss_type, max_len, num_items)
        coef = _engine.coefficients(loss, [lp, ent]) if grads else None
    total = m.sum().clamp(min=1.0)
    outs = (loss.detach(), (k3.detach() * m).sum() / total, (clipped * m).sum() / total)
    dh = dw = db = None
    if coef is not None:
        dh, dw, db = _engine.logp_grads(hidden, weight, bias, t, st["lse"], st["ent"], coef[0],
                                        e=coef[1] if ent_coef != 0.0 else None, scale=inv_t, need_dh=need_dh,
                                        need_dw=need_dw, need_db=need_db and bias is not None, cfg=cfg)
    return tuple(o.clone() for o in outs) + _engine.grads_out(hidden, weight, dh, dw, db)


def _token_weights(m, loss_type, max_len, num_items):
    """d loss / d per-token loss: the normalization of each loss type, known before any log-prob."""
    B = m.shape[0]
    if loss_type == "grpo":
        return m / m.sum(-1, keepdim=True).clamp(min=1.0) / B
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return m / (B * max_len)
    n = m.sum() if num_items is None else num_items.float().reshape(())
    return m / n.clamp(min=1.0)


def _token_coef(lp, adv, old, ref, omega, beta, eps_lo, eps_hi, delta):
    """d loss / d log p per token of token-level GRPO in closed form: what autograd gives through
    grpo_token_loss (ties of the min split in half as torch.minimum's backward does, clamps pass the gradient
    on their closed interval), without a graph: a dozen [C] kernels a chunk instead of autograd's hundred."""
    w = torch.ones_like(lp) if old is None else torch.exp(lp - old)
    if math.isnan(delta):
        w1, d1 = w, w
    else:
        w1, d1 = torch.clamp(w, max=delta), torch.where(w <= delta, w, 0.0)
    lo, hi = 1 - eps_lo, 1 + eps_hi
    wc, dc = torch.clamp(w, lo, hi), torch.where((w >= lo) & (w <= hi), w, 0.0)
    x1, x2 = w1 * adv, wc * adv
    dmin = torch.where(x1 < x2, d1, torch.where(x2 < x1, dc, 0.5 * (d1 + dc)))
    g = -adv * dmin
    if beta != 0.0 and ref is not None:  # d k3 / d lp = 1 - exp(ref - lp); 0 with ref = the detached policy
        g = g + beta * (1.0 - torch.exp(ref - lp))
    return g * omega


def _grpo_one_pass(hidden, weight, bias, t, m, adv, ref, old, floats, loss_type, max_len, num_items, need_dh,
                   need_dw, need_db, cfg):
    """Token-level ratios: a token's loss depends on its own log-prob and entropy only, and the normalization is
    known up front, so each chunk gets its coefficients right after its stats: one pass, 3 GEMMs, no second
    logits GEMM. The coefficients are closed-form (`_token_coef`); the loss and its metrics come once at the end
    from the [N] log-probs and entropies the chunks left behind."""
    beta, eps_lo, eps_hi, temperature, delta, ent_coef = floats
    B, T = m.shape
    omega = _token_weights(m, loss_type, max_len, num_items).reshape(-1)
    adv_t = adv.repeat_interleave(T)
    ref_f = None if ref is None else ref.reshape(-1)
    old_f = None if old is None else old.float().reshape(-1)
    lp_all = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
    ent_all = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
    e_coef = None

    def coef_fn(s, e, st):
        lp = torch.sub(st["xt"], st["lse"], out=lp_all[s:e])
        ent_all[s:e].copy_(st["ent"])
        col = slice(s, e)
        a = _token_coef(lp, adv_t[col], None if old_f is None else old_f[col], None if ref_f is None else ref_f[col],
                        omega[col], beta, eps_lo, eps_hi, delta)
        return a, None if e_coef is None else e_coef[col]

    if ent_coef != 0.0:
        e_coef = (-ent_coef * omega).contiguous()
    dh, dw, db = _engine.logp_grads(hidden, weight, bias, t, None, None, None, scale=1.0 / temperature,
                                    need_dh=need_dh, need_dw=need_dw, need_db=need_db and bias is not None, cfg=cfg,
                                    coef_fn=coef_fn, want_e=ent_coef != 0.0)
    per_tok, k3, clipped = grpo_token_loss(lp_all.view(B, T), ent_all.view(B, T), m, adv, ref,
                                           None if old_f is None else old_f.view(B, T), beta, eps_lo, eps_hi, "token",
                                           delta, ent_coef)
    total = m.sum().clamp(min=1.0)
    loss = (per_tok.reshape(-1) * omega).sum()
    return (loss, (k3 * m).sum() / total, (clipped * m).sum() / total) + _engine.grads_out(hidden, weight, dh, dw, db)


def _grpo_fake(hidden, weight, ids, attention_mask, advantages, bias, ref_logps, old_logps, ref_hidden, ref_weight,
               ref_bias, num_items, floats, loss_type, level, max_len, need_dh, need_dw, need_db, cfg_ints):
    s = [hidden.new_empty((), dtype=torch.float32) for _ in range(3)]
    return tuple(s) + (torch.empty_like(hidden) if need_dh else _engine.empty(hidden),
                       torch.empty_like(weight) if need_dw else _engine.empty(weight),
                       torch.empty_like(bias) if (need_db and bias is not None) else _engine.empty(weight))


_GRPO = _library.Op("fused_linear_grpo", _grpo_launch, _grpo_fake, _common.setup_saved_grads,
                    _common.backward_saved_grads("tigon.ops.fused_linear_grpo", (0, 1, 5)))


# GRPO's default chunk: 384 MiB (1324 rows at V 151936 in bf16). Its one pass accumulates dW once a chunk, so the
# [V, H] gradient is read and written N / C times; at 8 x 1024 tokens, H 3584, V 151936 on an H200 (dee7388,
# bench_losses.py, same call) 192 MiB chunks took 46.4 ms and 384 MiB 43.1 ms (+168 MiB peak, 2543 MiB).
GRPO_DEFAULT = _engine.FusedLinearLossConfig(chunk_bytes=384 << 20)


def fused_linear_grpo(hidden, weight, selected_token_ids, attention_mask, advantages, bias=None, *,
                      ref_per_token_logps=None, old_per_token_logps=None, ref_hidden=None, ref_weight=None,
                      ref_bias=None, beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
                      max_completion_length=None, importance_sampling_level="token", temperature=1.0, delta=None,
                      num_items_in_batch=None, entropy_coef=0.0, config=None):
    """GRPO loss of the head hidden [B, T, H] @ weight.T (+ bias) at `temperature`, never building the logits.

    Per token: -min(w A, clip(w, 1 - epsilon_low, 1 + epsilon_high) A) (w clamped to delta when given), plus
    beta * k3(ref, logp) and minus entropy_coef * entropy; w = exp(logp - old) (old: the detached policy when
    None). loss_type: "grpo" (mean per sequence, then over B), "bnpo" (over the mask), "dr_grpo" (over B *
    max_completion_length), "dapo" (over num_items_in_batch or the mask). Returns (loss, [mean k3 if beta, clip
    fraction]) as liger-kernel 0.8.5."""
    op = "tigon.ops.fused_linear_grpo"
    _common.check_head(op, hidden, weight, bias, hidden_dim=3)
    B, T = hidden.shape[:2]
    dev = hidden.device
    _common.check_ids(op, "selected_token_ids", selected_token_ids, (B, T), dev)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"{op}: attention_mask must be a tensor of shape ({B}, {T}), got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    advantages = _common.check_float_tensor(op, "advantages", advantages, (B,), dev, optional=False)
    ref = _common.check_float_tensor(op, "ref_per_token_logps", ref_per_token_logps, (B, T), dev)
    old = _common.check_float_tensor(op, "old_per_token_logps", old_per_token_logps, (B, T), dev)
    _common.check_choice(op, "loss_type", loss_type, GRPO_LOSS_TYPES)
    _common.check_choice(op, "importance_sampling_level", importance_sampling_level, ("token", "sequence"))
    if loss_type == "dr_grpo" and (not isinstance(max_completion_length, int) or max_completion_length < 1):
        raise ValueError(f"{op}: max_completion_length must be an int >= 1 for loss_type='dr_grpo', got "
                         f"{max_completion_length!r}")
    floats = [_launch.check_number(op, "beta", beta), _launch.check_number(op, "epsilon_low", epsilon_low),
              _launch.check_number(op, "epsilon_high", epsilon_high),
              _launch.check_number(op, "temperature", temperature, 1e-6),
              math.nan if delta is None else _launch.check_number(op, "delta", delta, 1e-12),
              _launch.check_number(op, "entropy_coef", entropy_coef)]
    if temperature <= 0:
        raise ValueError(f"{op}: temperature must be > 0, got {temperature}")
    cfg = GRPO_DEFAULT if config is None else _engine.check_config(op, config)
    _common.check_id_range(op, "selected_token_ids", selected_token_ids, weight.shape[0])
    ref_rows = None
    if ref is None and ref_hidden is not None:
        if ref_weight is None:
            raise ValueError(f"{op}: ref_weight is required with ref_hidden")
        _common.check_head(op, ref_hidden, ref_weight, ref_bias, "ref_hidden", "ref_weight", "ref_bias", 3)
        ref_rows = _launch.as_rows(ref_hidden.detach())
    num_items = None
    if num_items_in_batch is not None:
        num_items = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=dev).detach().reshape(())
    if not _library.use_kernels("fused_linear_grpo", hidden):
        loss, metrics = reference.fused_linear_grpo(
            hidden, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps=ref,
            old_per_token_logps=old, ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias, beta=beta,
            epsilon_low=epsilon_low, epsilon_high=epsilon_high, loss_type=loss_type,
            max_completion_length=max_completion_length, importance_sampling_level=importance_sampling_level,
            temperature=temperature, delta=delta, num_items_in_batch=num_items, entropy_coef=entropy_coef)
        return _library.first_order_only(op, loss), [x.detach() for x in metrics]
    out = _GRPO(
        _launch.as_rows(hidden), weight, selected_token_ids, attention_mask, advantages, bias, ref, old, ref_rows,
        None if ref_rows is None else ref_weight.detach(), None if ref_bias is None else ref_bias.detach(), num_items,
        floats, loss_type, importance_sampling_level, int(max_completion_length or 0), _common.needs(hidden),
        _common.needs(weight), _common.needs(bias), cfg.ints(), grad_from=(hidden, weight, bias))
    return out[0], ([out[1]] if beta != 0.0 else []) + [out[2]]


def _logprobs_launch(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor], scale: float,
    ignore_index: int, cfg_ints: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H], target [N]. Returns (log p(target) [N] (0 where ignored), entropy [N], log sum p^2 [N],
    mean x [N], is-top-1 [N] bool, lse [N]) of x = scale * (hidden @ weight.T + bias)."""
    st = _engine.logp_stats(hidden, weight, bias, target, scale=scale, cfg=_engine.config_from(cfg_ints))
    valid = (target != ignore_index) & (target >= 0) & (target < weight.shape[0])
    lp = torch.where(valid, st["xt"] - st["lse"], 0.0)
    return lp, st["ent"], st["lsq"], st["xsum"] / weight.shape[0], st["top1"] > 0, st["lse"]


def _logprobs_fake(hidden, weight, target, bias, scale, ignore_index, cfg_ints):
    v = [hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(6)]
    v[4] = hidden.new_empty(hidden.shape[0], dtype=torch.bool)
    return tuple(v)


def _logprobs_bwd_launch(
    grad_lp: torch.Tensor, grad_ent: Optional[torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor,
    target: torch.Tensor, bias: Optional[torch.Tensor], lse: torch.Tensor, ent: torch.Tensor, scale: float,
    ignore_index: int, need_dh: bool, need_dw: bool, need_db: bool, cfg_ints: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recompute each chunk's logits and fold the per-token grad_outputs into the gradient kernel."""
    valid = (target != ignore_index) & (target >= 0) & (target < weight.shape[0])
    a = torch.where(valid, grad_lp.float(), 0.0).contiguous()
    e = None if grad_ent is None else grad_ent.float().contiguous()
    dh, dw, db = _engine.logp_grads(hidden, weight, bias, target, lse, ent, a, e=e, scale=scale, need_dh=need_dh,
                                    need_dw=need_dw, need_db=need_db and bias is not None,
                                    cfg=_engine.config_from(cfg_ints))
    return (_engine.empty(hidden) if dh is None else dh, _engine.empty(weight) if dw is None else dw,
            _engine.empty(weight) if db is None else db)


def _logprobs_bwd_fake(grad_lp, grad_ent, hidden, weight, target, bias, lse, ent, scale, ignore_index, need_dh,
                       need_dw, need_db, cfg_ints):
    return (torch.empty_like(hidden) if need_dh else _engine.empty(hidden),
            torch.empty_like(weight) if need_dw else _engine.empty(weight),
            torch.empty_like(bias) if (need_db and bias is not None) else _engine.empty(weight))


_LOGPROBS_BWD = _library.Kernel("fused_linear_logprobs_bwd", _logprobs_bwd_launch, _logprobs_bwd_fake)


def _lp_setup(ctx, inputs, output):
    hidden, weight, target, bias, scale, ignore_index, cfg_ints = inputs
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, target, bias, output[5], output[1])
    ctx.args = (scale, ignore_index, cfg_ints)


def _lp_backward(ctx, g_lp, g_ent, *_):
    _library.refuse_double_backward("tigon.ops.fused_linear_logprobs")
    hidden, weight, target, bias, lse, ent = ctx.saved_tensors
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
    if (g_lp is None and g_ent is None) or not any(need):
        return (None,) * 7
    if g_lp is None:
        g_lp = torch.zeros_like(lse)
    scale, ignore_index, cfg_ints = ctx.args
    dh, dw, db = _LOGPROBS_BWD.on(ctx)(g_lp, g_ent, hidden, weight, target, bias, lse, ent, scale, ignore_index,
                                       *need, cfg_ints)
    dh, dw, db = (g if n else None for g, n in zip((dh, dw, db), need))
    return dh, dw, None, db, None, None, None


_LOGPROBS = _library.Op("fused_linear_logprobs_fwd", _logprobs_launch, _logprobs_fake, _lp_setup, _lp_backward)


def fused_linear_logprobs(hidden, weight, target, bias=None, *, temperature=1.0, logit_scale=1.0, ignore_index=-100,
                          config=None):
    """Per-token log p(target) and entropy of softmax(logit_scale * (hidden @ weight.T + bias) / temperature)
    for hidden [..., H], target [...], without the logits: (log_probs, entropy, log_sum_sq_probs, mean_logits,
    is_top1), each [...]; log_probs and entropy are differentiable (backward recomputes the chunks: 2 GEMMs
    forward-side, 3 in backward), the rest are metrics. Ignored targets get log-prob 0."""
    op = "tigon.ops.fused_linear_logprobs"
    _common.check_head(op, hidden, weight, bias, hidden_dim=hidden.dim() if hidden.dim() >= 1 else 1)
    _common.check_ids(op, "target", target, hidden.shape[:-1], hidden.device)
    t = _launch.check_number(op, "temperature", temperature)
    if t <= 0:
        raise ValueError(f"{op}: temperature must be > 0, got {temperature}")
    scale = _launch.check_number(op, "logit_scale", logit_scale) / t
    _common.check_int(op, "ignore_index", ignore_index)
    cfg = _engine.check_config(op, config)
    _common.check_id_range(op, "target", target, weight.shape[0], ignore_index)
    lead = target.shape
    if not _library.use_kernels("fused_linear_logprobs", hidden):
        lp, ent = reference.fused_linear_logprobs(hidden, weight, target, bias, temperature=temperature,
                                                  logit_scale=logit_scale, ignore_index=ignore_index)
        with torch.no_grad():  # the metrics, from the full logits as the reference does
            x = (hidden.float() @ weight.float().T + (0 if bias is None else bias.float())) * scale
            lsm = torch.log_softmax(x, -1)
            lsq = torch.logsumexp(2 * lsm, -1)
            valid = (target != ignore_index) & (target >= 0) & (target < weight.shape[0])
            top1 = valid & (x.argmax(-1) == target)
        return (_library.first_order_only(op, lp), _library.first_order_only(op, ent), lsq, x.mean(-1), top1)
    out = _LOGPROBS(_launch.as_rows(hidden), weight, target.reshape(-1), bias, scale, ignore_index, cfg.ints(),
                    grad_from=(hidden, weight, bias))
    return tuple(o.view(lead) for o in out[:5])
