"""Pairwise (DPO, ORPO, CPO, SimPO) and unpaired (KTO) preference losses on the fused linear head.

Batch layout as Liger-Kernel's: hidden [B, T, H], target [B, T]; pairwise losses take the B / 2 chosen
sequences first, then their B / 2 rejected ones. Per-sequence log-probabilities are sums (or means) of the
per-token log p(target) over tokens whose target is not ignore_index. Reference-model log-probabilities are
passed in (`ref_logps` [B]) or computed in the stats pass from reference hidden states and head (no
gradient). Formulas and the VJP: docs/ops/losses.md.
"""

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _launch, _library, reference
from . import _common, _engine

DPO_LOSS_TYPES = ("sigmoid", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
                  "apo_down", "discopop")
KINDS = ("dpo", "orpo", "cpo", "simpo")


def pair_loss(kind, loss_type, c, r, rc, rr, P, beta, label_smoothing, gamma, discopop_tau):
    """(loss, chosen_rewards [P], rejected_rewards [P], extra1, extra2) from sequence log-probs; the math of
    liger-kernel 0.8.5's preference_loss_fn of each method, summed over pairs and divided by P."""
    zero = c.new_zeros(())
    if kind == "orpo":
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        ratio = F.logsigmoid(log_odds)
        return -beta * ratio.sum() / P, beta * c, beta * r, ratio.sum() / P, log_odds.sum() / P
    if kind in ("cpo", "simpo"):
        x = beta * (c - r) - (gamma if kind == "simpo" else 0.0)
        loss = (-F.logsigmoid(x) * (1 - label_smoothing) - F.logsigmoid(-x) * label_smoothing).sum() / P
        return loss, beta * c, beta * r, zero, zero
    cl, rl = c - rc, r - rr
    cw, rw = beta * cl, beta * rl
    d = beta * (cl - rl)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(d)
    elif loss_type == "hinge":
        losses = torch.relu(1 - d)
    elif loss_type == "exo_pair":
        eps = label_smoothing
        losses = (torch.sigmoid(d) * (F.logsigmoid(d) - math.log1p(-eps))
                  + torch.sigmoid(-d) * (F.logsigmoid(-d) - math.log(eps)))
    elif loss_type == "nca_pair":
        losses = -F.logsigmoid(cw) - 0.5 * F.logsigmoid(-cw) - 0.5 * F.logsigmoid(-rw)
    elif loss_type == "robust":
        ls = label_smoothing
        losses = (-(1 - ls) * F.logsigmoid(d) + ls * F.logsigmoid(-d)) / (1 - 2 * ls)
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(cw) - F.logsigmoid(-rw)
    elif loss_type == "sppo_hard":
        losses = (cl - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = 1 - torch.sigmoid(cw) + torch.sigmoid(rw)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(cw) + 1 - torch.sigmoid(d)
    else:  # discopop
        mod = torch.sigmoid(d / discopop_tau)
        losses = -F.logsigmoid(d) * (1 - mod) + torch.exp(-d) * mod
    return losses.sum() / P, cw, rw, zero, zero


def _seq(lp_tok, mask, average):
    s = (lp_tok * mask).sum(-1)
    return s / mask.sum(-1) if average else s


def _ref_seq(ref_hidden, ref_weight, ref_bias, target, mask, average, cfg):
    B, T = target.shape
    st = _engine.logp_stats(ref_hidden, ref_weight, ref_bias, target.reshape(-1), cfg=cfg)
    return _seq((st["xt"] - st["lse"]).view(B, T), mask, average)


def _halves(x, P, T, paired):
    """(chosen [k, T], rejected [k, T]) views of per-token values: chosen-first [2P T] or pair-ordered [k, 2, T]."""
    if paired:
        x = x.view(-1, 2, T)
        return x[:, 0], x[:, 1]
    x = x.view(2 * P, T)
    return x[:P], x[P:]


def _pair_order(x, P, T):
    """Rows of the chosen-first layout [2 P T, ...] reordered pair by pair (c_0, r_0, c_1, r_1, ...): one copy."""
    return x.reshape(2, P, T, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def _chosen_first(x, P, T):
    """Inverse of _pair_order."""
    return x.reshape(P, 2, T, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def _pref_loss(lp, lp2, masks, ref, P, T, paired, kind, loss_type, floats, compute_nll, average, n_nll):
    """(loss, c, r, nll, chosen_rewards, rejected_rewards, extra1, extra2) of the k pairs whose token log-probs lp
    (and lp2: of the NLL target) are given, chosen-first (k = P) or pair-ordered. The loss of all pairs is the
    sum of the losses of any split of them into such groups (pair_loss divides by the batch's P, the NLL by the
    batch's n_nll), which is what lets the one-pass walk get each pair's coefficients alone."""
    beta, alpha, ls, gamma, tau = floats
    m_c, m_r, m2_c = masks
    lp_c, lp_r = _halves(lp, P, T, paired)
    c, r = _seq(lp_c, m_c, average), _seq(lp_r, m_r, average)
    nll = lp.new_zeros(())
    if compute_nll:
        nll = -((lp_c * m_c).sum() if lp2 is None else (_halves(lp2, P, T, paired)[0] * m2_c).sum()) / n_nll
    pref, cw, rw, e1, e2 = pair_loss(kind, loss_type, c, r, ref[0], ref[1], P, beta, ls, gamma, tau)
    return alpha * nll + pref, c, r, nll, cw, rw, e1, e2


def _preference_launch(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
    nll_target: Optional[torch.Tensor], ref_hidden: Optional[torch.Tensor], ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor], kind: str, loss_type: str,
    floats: list[float], ignore_index: int, compute_nll: bool, average_log_prob: bool, need_dh: bool,
    need_dw: bool, need_db: bool, cfg_ints: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B*T, H] (B = 2P, chosen first), target [B, T]. Returns (loss, chosen_logps [P], rejected_logps
    [P], chosen_logits_mean, rejected_logits_mean, nll_loss, chosen_rewards [P], rejected_rewards [P], extra1,
    extra2, dh, dW, db): gradients for grad_output 1, empty when not asked.

    Two walks: the two-pass one (stats of every token, then the coefficients, then the grad pass: 4 policy
    GEMMs), or, when a pair's logits fit cfg.one_pass_bytes, one walk over chunks of whole pairs in pair order
    (stats, that chunk's coefficients, gradient: 3 policy GEMMs, one copy of hidden and dh to reorder rows)."""
    cfg = _engine.config_from(cfg_ints)
    B, T = target.shape
    P, V = B // 2, weight.shape[0]
    t = target.reshape(-1)
    mask = (target != ignore_index).float()
    t2 = m2 = None
    if compute_nll and nll_target is not None:
        t2 = torch.cat([nll_target[:P].reshape(-1), torch.full_like(t[P * T:], ignore_index)])
        m2 = (nll_target[:P] != ignore_index).float()
    n_nll = (mask[:P] if m2 is None else m2).sum()
    if ref_logps is not None:
        ref = ref_logps[:P].float(), ref_logps[P:].float()
    elif ref_hidden is not None:
        seqs = _ref_seq(ref_hidden, ref_weight, ref_bias, target, mask, average_log_prob, cfg)
        ref = seqs[:P], seqs[P:]
    else:
        ref = (hidden.new_zeros((), dtype=torch.float32),) * 2
    args = (kind, loss_type, floats, compute_nll, average_log_prob, n_nll)
    grads = need_dh or need_dw or need_db
    pair_bytes = 2 * T * V * hidden.element_size()
    per_chunk = min(P, cfg.one_pass_bytes // pair_bytes) if cfg.one_pass_bytes else 0
    dh = dw = db = None
    if grads and per_chunk > 0:
        lp_all = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
        lp2_all = torch.empty_like(lp_all) if t2 is not None else None
        xs_all = torch.empty_like(lp_all)
        mask_p, m2_p = _pair_order(mask.reshape(-1), P, T), None if m2 is None else m2.reshape(-1)

        def coef_fn(s, e, st):
            j0, j1 = s // (2 * T), e // (2 * T)
            xs_all[s:e].copy_(st["xsum"])
            with _engine.autograd_inside():
                lp = torch.sub(st["xt"], st["lse"], out=lp_all[s:e]).requires_grad_()
                lp2 = None if t2 is None else torch.sub(st["xt2"], st["lse"], out=lp2_all[s:e]).requires_grad_()
                m_c, m_r = _halves(mask_p[s:e], P, T, True)
                masks = m_c, m_r, None if m2_p is None else m2_p.view(P, T)[j0:j1]
                part = tuple(x if x.dim() == 0 else x[j0:j1] for x in ref)
                loss = _pref_loss(lp, lp2, masks, part, P, T, True, *args)[0]
                coef = _engine.coefficients(loss, [lp] + ([lp2] if lp2 is not None else []))
            return coef[0], None, coef[1] if lp2 is not None else None

        dh, dw, db = _engine.logp_grads(
            _pair_order(hidden, P, T), weight, bias, _pair_order(t, P, T), None, None, None,
            target2=None if t2 is None else _pair_order(t2, P, T), need_dh=need_dh, need_dw=need_dw,
            need_db=need_db and bias is not None, cfg=dataclasses.replace(cfg, chunk_rows=per_chunk * 2 * T),
            coef_fn=coef_fn)
        dh = None if dh is None else _chosen_first(dh, P, T)
        lp = _chosen_first(lp_all, P, T)
        lp2 = None if lp2_all is None else _chosen_first(lp2_all, P, T)
        xsum = _chosen_first(xs_all, P, T)
        res = _pref_loss(lp, lp2, (mask[:P], mask[P:], m2), ref, P, T, False, *args)
    else:
        st = _engine.logp_stats(hidden, weight, bias, t, t2, cfg=cfg)
        xsum = st["xsum"]
        with _engine.autograd_inside():
            lp = (st["xt"] - st["lse"]).requires_grad_()
            lp2 = (st["xt2"] - st["lse"]).requires_grad_() if t2 is not None else None
            res = _pref_loss(lp, lp2, (mask[:P], mask[P:], m2), ref, P, T, False, *args)
            coef = _engine.coefficients(res[0], [lp] + ([lp2] if lp2 is not None else [])) if grads else None
        if coef is not None:
            dh, dw, db = _engine.logp_grads(
                hidden, weight, bias, t, st["lse"], st["ent"], coef[0], coef[1] if t2 is not None else None,
                target2=t2, need_dh=need_dh, need_dw=need_dw, need_db=need_db and bias is not None, cfg=cfg)
    loss, c, r, nll, cw, rw, e1, e2 = (x.detach() for x in res)
    xs = xsum.view(B, T)
    denom = float(P * T * V)
    outs = [loss, c, r, xs[:P].sum() / denom, xs[P:].sum() / denom, nll, cw, rw, e1, e2]
    return tuple(o.clone() for o in outs) + _engine.grads_out(hidden, weight, dh, dw, db)


def _preference_fake(hidden, weight, target, bias, nll_target, ref_hidden, ref_weight, ref_bias, ref_logps, kind,
                     loss_type, floats, ignore_index, compute_nll, average_log_prob, need_dh, need_dw, need_db,
                     cfg_ints):
    P = target.shape[0] // 2
    s = hidden.new_empty((), dtype=torch.float32)
    v = hidden.new_empty((P,), dtype=torch.float32)
    return (s, v, v.clone(), s.clone(), s.clone(), s.clone(), v.clone(), v.clone(), s.clone(), s.clone(),
            torch.empty_like(hidden) if need_dh else _engine.empty(hidden),
            torch.empty_like(weight) if need_dw else _engine.empty(weight),
            torch.empty_like(bias) if (need_db and bias is not None) else _engine.empty(weight))


_PREFERENCE = _library.Op("fused_linear_preference", _preference_launch, _preference_fake, _common.setup_saved_grads,
                          _common.backward_saved_grads("tigon.ops.fused_linear_preference", (0, 1, 3)))


def _check_ref(op, hidden, target, ref_hidden, ref_weight, ref_bias, ref_logps):
    if ref_logps is not None:
        return _common.check_float_tensor(op, "ref_logps", ref_logps, (target.shape[0],), hidden.device), None
    if ref_hidden is None:
        return None, None
    if ref_weight is None:
        raise ValueError(f"{op}: ref_weight is required with ref_hidden")
    _common.check_head(op, ref_hidden, ref_weight, ref_bias, "ref_hidden", "ref_weight", "ref_bias", 3)
    if tuple(ref_hidden.shape[:2]) != tuple(hidden.shape[:2]):
        raise ValueError(f"{op}: ref_hidden must have shape ({hidden.shape[0]}, {hidden.shape[1]}, H_ref), got "
                         f"{tuple(ref_hidden.shape)}")
    return None, _launch.as_rows(ref_hidden.detach())


def fused_linear_preference(hidden, weight, target, bias=None, *, kind="dpo", loss_type="sigmoid", beta=0.1,
                            alpha=1.0, label_smoothing=0.0, gamma=0.5, discopop_tau=0.05, ignore_index=-100,
                            compute_nll_loss=False, nll_target=None, average_log_prob=False, ref_logps=None,
                            ref_hidden=None, ref_weight=None, ref_bias=None, config=None):
    """Pairwise preference loss of the head hidden [B, T, H] @ weight [V, H].T (+ bias [V]) against target
    [B, T], B = 2P with the chosen half first, never building the [B T, V] logits.

    kind: "dpo" (loss_type one of DPO_LOSS_TYPES), "orpo", "cpo", "simpo"; `alpha * nll + preference`, where nll
    is the chosen half's mean token NLL (of nll_target when given) and only counts with compute_nll_loss.
    Reference log-probs: ref_logps [B] (chosen first), or ref_hidden [B, T, H_ref] with ref_weight [V, H_ref]
    (+ ref_bias), or none (0). Returns (loss, (chosen_logps, rejected_logps, chosen_logits_mean,
    rejected_logits_mean, nll_loss, chosen_rewards, rejected_rewards[, log_odds_ratio, log_odds_chosen for ORPO]))
    as liger-kernel 0.8.5. Gradients for hidden, weight and bias; the loss and metrics are fp32.
    """
    # errors name the op the user called: fused_linear_dpo / _orpo / _cpo / _simpo wrap this one
    op = f"tigon.ops.fused_linear_{kind}" if isinstance(kind, str) and kind in KINDS else \
        "tigon.ops.fused_linear_preference"
    _common.check_head(op, hidden, weight, bias, hidden_dim=3)
    B, T = hidden.shape[:2]
    if B == 0 or B % 2:
        raise ValueError(f"{op}: hidden's batch must be 2 * pairs (chosen first), got {B}")
    _common.check_ids(op, "target", target, (B, T), hidden.device)
    _common.check_choice(op, "kind", kind, KINDS)
    _common.check_choice(op, "loss_type", loss_type, DPO_LOSS_TYPES)
    _common.check_int(op, "ignore_index", ignore_index)
    floats = [_launch.check_number(op, n, v) for n, v in (("beta", beta), ("alpha", alpha),
              ("label_smoothing", label_smoothing), ("gamma", gamma), ("discopop_tau", discopop_tau))]
    if kind == "dpo" and loss_type == "exo_pair" and not label_smoothing > 0:
        raise ValueError(f"{op}: label_smoothing must be > 0 for loss_type='exo_pair', got {label_smoothing}")
    if kind == "dpo" and loss_type == "robust" and not 0 <= label_smoothing < 0.5:
        raise ValueError(f"{op}: label_smoothing must be in [0, 0.5) for loss_type='robust', got {label_smoothing}")
    for n, v in (("compute_nll_loss", compute_nll_loss), ("average_log_prob", average_log_prob)):
        _launch.check_bool(op, n, v)
    if nll_target is not None:
        _common.check_ids(op, "nll_target", nll_target, (B, T), hidden.device)
    cfg = _engine.check_config(op, config)
    _common.check_id_range(op, "target", target, weight.shape[0], ignore_index)
    if nll_target is not None:
        _common.check_id_range(op, "nll_target", nll_target, weight.shape[0], ignore_index)
    ref_logps, ref_rows = _check_ref(op, hidden, target, ref_hidden, ref_weight, ref_bias, ref_logps)
    if ref_rows is not None and ref_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"{op}: ref_weight must have {weight.shape[0]} rows (the vocabulary), "
                         f"got {ref_weight.shape[0]}")
    if not _library.use_kernels("fused_linear_preference", hidden):
        loss, aux = reference.fused_linear_preference(
            hidden, weight, target, bias, kind=kind, loss_type=loss_type, beta=beta, alpha=alpha,
            label_smoothing=label_smoothing, gamma=gamma, discopop_tau=discopop_tau, ignore_index=ignore_index,
            compute_nll_loss=compute_nll_loss, nll_target=nll_target, average_log_prob=average_log_prob,
            ref_logps=ref_logps, ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias)
        return _library.first_order_only(op, loss), tuple(a.detach() for a in aux)
    out = _PREFERENCE(
        _launch.as_rows(hidden), weight, target, bias, nll_target, ref_rows,
        None if ref_rows is None else ref_weight.detach(), None if ref_bias is None else ref_bias.detach(),
        ref_logps, kind, loss_type, floats, ignore_index, compute_nll_loss, average_log_prob, _common.needs(hidden),
        _common.needs(weight), _common.needs(bias), cfg.ints(), grad_from=(hidden, weight, bias))
    aux = out[1:8] + (out[8:10] if kind == "orpo" else ())
    return out[0], aux


def fused_linear_dpo(hidden, weight, target, bias=None, **kw):
    """fused_linear_preference(kind="dpo"): DPO and its loss_type variants (RPO: compute_nll_loss=True, alpha)."""
    return fused_linear_preference(hidden, weight, target, bias, kind="dpo", **kw)


def fused_linear_orpo(hidden, weight, target, bias=None, *, beta=0.1, compute_nll_loss=True, nll_target=None,
                      ignore_index=-100, config=None):
    """ORPO (liger's defaults: mean token log-probs, NLL on the chosen half, alpha 1)."""
    return fused_linear_preference(hidden, weight, target, bias, kind="orpo", beta=beta,
                                   compute_nll_loss=compute_nll_loss, nll_target=nll_target, average_log_prob=True,
                                   ignore_index=ignore_index, config=config)


def fused_linear_cpo(hidden, weight, target, bias=None, *, beta=0.1, alpha=1.0, label_smoothing=0.0,
                     compute_nll_loss=True, average_log_prob=False, ignore_index=-100, config=None):
    """CPO: -log sigmoid(beta (c - r)) with label smoothing, plus alpha * NLL."""
    return fused_linear_preference(hidden, weight, target, bias, kind="cpo", beta=beta, alpha=alpha,
                                   label_smoothing=label_smoothing, compute_nll_loss=compute_nll_loss,
                                   average_log_prob=average_log_prob, ignore_index=ignore_index, config=config)


def fused_linear_simpo(hidden, weight, target, bias=None, *, beta=0.1, alpha=1.0, gamma=0.5, label_smoothing=0.0,
                       compute_nll_loss=False, ignore_index=-100, config=None):
    """SimPO: -log sigmoid(beta (mean c - mean r) - gamma) with label smoothing (mean token log-probs)."""
    return fused_linear_preference(hidden, weight, target, bias, kind="simpo", beta=beta, alpha=alpha, gamma=gamma,
                                   label_smoothing=label_smoothing, compute_nll_loss=compute_nll_loss,
                                   average_log_prob=True, ignore_index=ignore_index, config=config)


def _kto_launch(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, preference_labels: torch.Tensor,
    bias: Optional[torch.Tensor], ref_hidden: Optional[torch.Tensor], ref_weight: Optional[torch.Tensor],
    ref_bias: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor], kl: Optional[torch.Tensor], beta: float,
    ignore_index: int, average_log_prob: bool, need_dh: bool, need_dw: bool, need_db: bool, cfg_ints: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [B*T, H], target [B, T], preference_labels [B] bool. Returns (loss, chosen_logps_sum,
    rejected_logps_sum, chosen_logits_sum, rejected_logits_sum, chosen_rewards_sum, rejected_rewards_sum, dh,
    dW, db)."""
    cfg = _engine.config_from(cfg_ints)
    B, T = target.shape
    t = target.reshape(-1)
    mask = (target != ignore_index).float()
    st = _engine.logp_stats(hidden, weight, bias, t, cfg=cfg)
    if ref_logps is not None:
        ref = ref_logps.float()
    elif ref_hidden is not None:
        ref = _ref_seq(ref_hidden, ref_weight, ref_bias, target, mask, average_log_prob, cfg)
    else:
        ref = None
    lab = preference_labels.bool()
    sign = torch.where(lab, 1.0, -1.0)
    kl_f = None if kl is None else kl.float()

    def kto(lp, rows):  # (loss summed over the sequences `rows` of lp [k T], their log-probs, log-ratios)
        seq = _seq(lp.view(-1, T), mask[rows], average_log_prob)
        ratio = seq if ref is None else seq - ref[rows]
        z = ratio if kl_f is None else ratio - (kl_f if kl_f.dim() == 0 else kl_f[rows])
        return (1 - torch.sigmoid(beta * z * sign[rows])).sum() / B, seq, ratio

    grads = need_dh or need_dw or need_db
    per_chunk = min(B, cfg.one_pass_bytes // (T * weight.shape[0] * hidden.element_size())) if cfg.one_pass_bytes else 0
    dh = dw = db = None
    if grads and per_chunk > 0:  # chunks of whole sequences: each one's coefficients from its own statistics
        lp_all = torch.empty(B * T, dtype=torch.float32, device=hidden.device)
        xs_all = torch.empty_like(lp_all)

        def coef_fn(s, e, st):
            xs_all[s:e].copy_(st["xsum"])
            with _engine.autograd_inside():
                lp = torch.sub(st["xt"], st["lse"], out=lp_all[s:e]).requires_grad_()
                return _engine.coefficients(kto(lp, slice(s // T, e // T))[0], [lp])[0], None

        dh, dw, db = _engine.logp_grads(hidden, weight, bias, t, None, None, None, need_dh=need_dh, need_dw=need_dw,
                                        need_db=need_db and bias is not None,
                                        cfg=dataclasses.replace(cfg, chunk_rows=per_chunk * T), coef_fn=coef_fn)
        loss, seq, ratio = kto(lp_all, slice(None))
        xsum = xs_all
    else:
        st = _engine.logp_stats(hidden, weight, bias, t, cfg=cfg)
        xsum = st["xsum"]
        with _engine.autograd_inside():
            lp = (st["xt"] - st["lse"]).requires_grad_()
            loss, seq, ratio = kto(lp, slice(None))
            coef = _engine.coefficients(loss, [lp]) if grads else None
        if coef is not None:
            dh, dw, db = _engine.logp_grads(hidden, weight, bias, t, st["lse"], st["ent"], coef[0], need_dh=need_dh,
                                            need_dw=need_dw, need_db=need_db and bias is not None, cfg=cfg)
    rewards = (beta * ratio).detach()
    seq = seq.detach()
    xs = xsum.view(B, T).sum(-1)
    outs = [loss.detach(), (seq * lab).sum(), (seq * ~lab).sum(), (xs * lab).sum(), (xs * ~lab).sum(),
            (rewards * lab).sum(), (rewards * ~lab).sum()]
    return tuple(o.clone() for o in outs) + _engine.grads_out(hidden, weight, dh, dw, db)


def _kto_fake(hidden, weight, target, preference_labels, bias, ref_hidden, ref_weight, ref_bias, ref_logps, kl, beta,
              ignore_index, average_log_prob, need_dh, need_dw, need_db, cfg_ints):
    s = [hidden.new_empty((), dtype=torch.float32) for _ in range(7)]
    return tuple(s) + (torch.empty_like(hidden) if need_dh else _engine.empty(hidden),
                       torch.empty_like(weight) if need_dw else _engine.empty(weight),
                       torch.empty_like(bias) if (need_db and bias is not None) else _engine.empty(weight))


_KTO = _library.Op("fused_linear_kto", _kto_launch, _kto_fake, _common.setup_saved_grads,
                   _common.backward_saved_grads("tigon.ops.fused_linear_kto", (0, 1, 4)))


def fused_linear_kto(hidden, weight, target, preference_labels, bias=None, *, beta=0.1, ignore_index=-100,
                     average_log_prob=False, kl=None, ref_logps=None, ref_hidden=None, ref_weight=None, ref_bias=None,
                     config=None):
    """KTO (unpaired) of the head hidden [B, T, H] @ weight.T (+ bias) against target [B, T]; preference_labels
    [B] bool (True: desirable). loss = mean_b 1 - sigmoid(beta (logratio_b - kl) sign_b), logratio = policy minus
    reference sequence log-prob (ref_logps [B], or from ref_hidden/ref_weight, or none); kl: a tensor [] or [B]
    or None. Returns (loss, (chosen_logps_sum, rejected_logps_sum, chosen_logits_sum, rejected_logits_sum,
    chosen_rewards_sum, rejected_rewards_sum)) as liger-kernel 0.8.5."""
    op = "tigon.ops.fused_linear_kto"
    _common.check_head(op, hidden, weight, bias, hidden_dim=3)
    B, T = hidden.shape[:2]
    _common.check_ids(op, "target", target, (B, T), hidden.device)
    if not isinstance(preference_labels, torch.Tensor) or preference_labels.shape != (B,):
        raise ValueError(f"{op}: preference_labels must be a tensor of shape ({B},), got "
                         f"{getattr(preference_labels, 'shape', type(preference_labels).__name__)}")
    beta = _launch.check_number(op, "beta", beta)
    _common.check_int(op, "ignore_index", ignore_index)
    _launch.check_bool(op, "average_log_prob", average_log_prob)
    if kl is not None:
        if not isinstance(kl, torch.Tensor) or kl.numel() not in (1, B):
            raise ValueError(f"{op}: kl must be a tensor with 1 or {B} elements, got {kl!r}")
        kl = kl.detach().reshape(-1) if kl.numel() == B else kl.detach().reshape(())
    cfg = _engine.check_config(op, config)
    _common.check_id_range(op, "target", target, weight.shape[0], ignore_index)
    ref_logps, ref_rows = _check_ref(op, hidden, target, ref_hidden, ref_weight, ref_bias, ref_logps)
    if not _library.use_kernels("fused_linear_kto", hidden):
        loss, aux = reference.fused_linear_kto(
            hidden, weight, target, preference_labels, bias, beta=beta, ignore_index=ignore_index,
            average_log_prob=average_log_prob, kl=kl, ref_logps=ref_logps, ref_hidden=ref_hidden,
            ref_weight=ref_weight, ref_bias=ref_bias)
        return _library.first_order_only(op, loss), tuple(a.detach() for a in aux)
    out = _KTO(
        _launch.as_rows(hidden), weight, target, preference_labels.bool(), bias, ref_rows,
        None if ref_rows is None else ref_weight.detach(), None if ref_bias is None else ref_bias.detach(),
        ref_logps, kl, beta, ignore_index, average_log_prob, _common.needs(hidden), _common.needs(weight),
        _common.needs(bias), cfg.ints(), grad_from=(hidden, weight, bias))
    return out[0], out[1:7]
