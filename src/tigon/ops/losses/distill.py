"""Logit distillation on fused linear heads: generalized JSD (beta; forward KL at 0, reverse KL at 1) between a
student head and a teacher head (different hidden sizes, one vocabulary), at a temperature, mixed with the hard-label
cross-entropy of the student, as Liger-Kernel's LigerFusedLinearJSDLoss.

Every token's loss is its own (the denominators are counts known up front), so one pass suffices: per chunk of C
tokens, the student and teacher logits (two GEMMs into workspace scratch), `_jsd_kernel` (one program per row, three
walks over the row in fp32: the logsumexps, the divergence and the softmax-Jacobian sum, the gradient written over
the student chunk in place), then dh_c = dz_c W_s and dW_s += dz_c^T h_c. Math: docs/ops/losses.md.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _launch, _library, reference
from .._rolling_buffer import workspace
from . import _common, _engine


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    """ln x. FAST_LOG (compiled CUDA only; the interpreter has no inline asm): PTX lg2.approx, one MUFU op, where
    tl.log is libdevice's logf, ~30 instructions; the JSD's walks 2 and 3 take one log an id each, which was
    about half of their instructions (sm_90 PTX of the MODE 2 kernel)."""
    if FAST_LOG:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1) * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def _jsd_lse_tile(p_s, p_t, o_s, V, it, ms, ss, mt, st, mr, sr, MASKED: tl.constexpr, VEC: tl.constexpr,
                  UNTEMPERED: tl.constexpr):
    """Pass 1 on the [R, VEC] tile at slot starts o_s: the per-slot online logsumexps of z_s / T, z_t / T and z_s
    (one thread a slot: in-thread reductions only)."""
    o = o_s[:, None] + tl.arange(0, VEC)[None, :]
    if MASKED:
        m_ = o < V
        zr = tl.load(p_s + o, mask=m_, other=float("-inf")).to(tl.float32)
        zt = tl.load(p_t + o, mask=m_, other=float("-inf")).to(tl.float32)
    else:
        zr = tl.load(p_s + o).to(tl.float32)
        zt = tl.load(p_t + o).to(tl.float32)
    mxr = tl.max(zr, axis=1)
    if UNTEMPERED:
        xs, xt = zr, zt
        n_ms, n_mt = tl.maximum(ms, mxr), tl.maximum(mt, tl.max(zt, axis=1))
    else:
        xs, xt = zr * it, zt * it
        # max(z) / T == max(z / T) exactly (rounding is monotone and 1 / T > 0): one multiply a slot
        n_ms, n_mt = tl.maximum(ms, mxr * it), tl.maximum(mt, tl.max(zt, axis=1) * it)
        n_mr = tl.maximum(mr, mxr)
        sr = sr * tl.exp(mr - n_mr) + tl.sum(tl.exp(zr - n_mr[:, None]), axis=1)
        mr = n_mr
    ss = ss * tl.exp(ms - n_ms) + tl.sum(tl.exp(xs - n_ms[:, None]), axis=1)
    st = st * tl.exp(mt - n_mt) + tl.sum(tl.exp(xt - n_mt[:, None]), axis=1)
    return n_ms, ss, n_mt, st, mr, sr


@triton.jit
def _lse_combine(m, s):
    """logsumexp of a row from per-slot (max, sum exp(x - max)); a slot that saw no id (m -1e30) adds 0."""
    mx = tl.max(m, axis=0)
    return mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))


@triton.jit
def _jsd_div_tile(p_s, p_t, o_s, V, it, lse_s, lse_t, bt, soft, big_s, MASKED: tl.constexpr, VEC: tl.constexpr,
                  MODE: tl.constexpr, FAST_LOG: tl.constexpr):
    """Pass 2 on a tile: per-slot sums of the divergence term and of p_s g (g = d soft / d p_s)."""
    o = o_s[:, None] + tl.arange(0, VEC)[None, :]
    if MASKED:
        m_ = o < V
        zs = tl.load(p_s + o, mask=m_, other=0.0).to(tl.float32)
        zt = tl.load(p_t + o, mask=m_, other=0.0).to(tl.float32)
    else:
        zs = tl.load(p_s + o).to(tl.float32)
        zt = tl.load(p_t + o).to(tl.float32)
    ls = zs * it - lse_s
    lt = zt * it - lse_t
    if MODE == 0:
        term = tl.exp(lt) * (lt - ls)
        u = tl.zeros_like(term)
    elif MODE == 1:
        term = tl.exp(ls) * (ls - lt)  # and p_s g = term: S = soft
        u = tl.zeros_like(term)
    else:
        ps, pt = tl.exp(ls), tl.exp(lt)
        # log m = log((1 - beta) p_s + beta p_t): 2 exps and a log an id where logaddexp of the log-probs takes
        # 4 and a log; m below 1e-37 only where both p underflow, whose terms (< m |log m|) vanish in fp32
        lm = _log(tl.maximum((1.0 - bt) * ps + bt * pt, 1e-37), FAST_LOG)
        u = (1.0 - bt) * ps * (ls - lm)  # p_s g
        term = bt * pt * (lt - lm) + u
    if MASKED:
        term = tl.where(m_, term, 0.0)
        u = tl.where(m_, u, 0.0)
    soft += tl.sum(term, axis=1)
    if MODE == 2:
        big_s += tl.sum(u, axis=1)
    return soft, big_s


@triton.jit
def _jsd_grad_tile(p_s, p_t, o_s, V, t, it, lse_s, lse_t, lse_r, bt, big_s, c_soft, c_hard, MASKED: tl.constexpr,
                   VEC: tl.constexpr, MODE: tl.constexpr, UNTEMPERED: tl.constexpr, FAST_LOG: tl.constexpr):
    """Pass 3 on a tile: d loss / d z_s over the student logits (the last read of both rows: evict first)."""
    o = o_s[:, None] + tl.arange(0, VEC)[None, :]
    if MASKED:
        m_ = o < V
        zr = tl.load(p_s + o, mask=m_, other=0.0, eviction_policy="evict_first").to(tl.float32)
        zt = tl.load(p_t + o, mask=m_, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        zr = tl.load(p_s + o, eviction_policy="evict_first").to(tl.float32)
        zt = tl.load(p_t + o, eviction_policy="evict_first").to(tl.float32)
    ls = zr * it - lse_s
    lt = zt * it - lse_t
    ps = tl.exp(ls)
    if MODE == 0:
        d_soft = ps - tl.exp(lt)
    elif MODE == 1:
        d_soft = ps * ((ls - lt) - big_s)
    else:
        lm = _log(tl.maximum((1.0 - bt) * ps + bt * tl.exp(lt), 1e-37), FAST_LOG)
        d_soft = ps * ((1.0 - bt) * (ls - lm) - big_s)
    if UNTEMPERED:
        pr = ps  # z_s / 1 == z_s and lse_r == lse_s: the same bits
    else:
        pr = tl.exp(zr - lse_r)
    d = c_soft * d_soft + c_hard * (pr - tl.where(o == t, 1.0, 0.0))
    d = d.to(p_s.dtype.element_ty)
    if MASKED:
        tl.store(p_s + o, d, mask=m_, eviction_policy="evict_first")
    else:
        tl.store(p_s + o, d, eviction_policy="evict_first")


@triton.jit
def _jsd_kernel(
    ZS, ZT,  # [C, V] student / teacher chunk logits; ZS is overwritten by d loss / d student logits (its dtype)
    T,  # [C] labels
    SOFT, HARD,  # [C] fp32 per-row soft (divergence) and hard (CE) terms, 0 for ignored rows
    NVALID,  # [1] fp32 count of unignored labels of the whole batch (a tensor: no host sync)
    stride_s, stride_t, V, ignore_index,
    inv_t, beta, w_hard, w_soft,  # runtime floats
    MODE: tl.constexpr,  # 0: beta 0 (KL(T || S)), 1: beta 1 (KL(S || T)), 2: the generalized JSD
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr = 8,  # ids of a slot (16 bytes of bf16), each thread's unit of in-thread reduction
    UNTEMPERED: tl.constexpr = False,  # inv_t == 1: the CE's logsumexp is the student's, skip the third
    FAST_LOG: tl.constexpr = False,  # compiled for CUDA (not the interpreter): lg2.approx for the per-id logs
):
    # Three walks over the row, each with per-slot accumulators and one cross-slot combine after it (no
    # block-wide reduction inside a loop). Full tiles load unmasked, the ragged tail once with a mask. Walk order
    # zig-zags (1: up, 2: down, 3: up) so each walk starts on the tiles the previous one read last, still in L2.
    row = tl.program_id(0).to(tl.int64)
    p_s = ZS + row * stride_s
    p_t = ZT + row * stride_t
    t = tl.load(T + row).to(tl.int64)
    valid = t != ignore_index
    it = tl.cast(inv_t, tl.float32)
    bt = tl.cast(beta, tl.float32)
    R: tl.constexpr = BLOCK_V // VEC
    o_r = tl.arange(0, R) * VEC
    n_full = V // BLOCK_V
    v_tail = n_full * BLOCK_V
    # pass 1: three online logsumexps (tempered student, tempered teacher, raw student for the CE)
    ms = tl.full([R], -1e30, tl.float32)  # finite: exp(m_old - m_new) is never exp(-inf + inf)
    mt = tl.full([R], -1e30, tl.float32)
    mr = tl.full([R], -1e30, tl.float32)
    ss = tl.zeros([R], dtype=tl.float32)
    st = tl.zeros([R], dtype=tl.float32)
    sr = tl.zeros([R], dtype=tl.float32)
    for i in range(0, n_full):
        ms, ss, mt, st, mr, sr = _jsd_lse_tile(p_s, p_t, i * BLOCK_V + o_r, V, it, ms, ss, mt, st, mr, sr,
                                               MASKED=False, VEC=VEC, UNTEMPERED=UNTEMPERED)
    if v_tail < V:
        ms, ss, mt, st, mr, sr = _jsd_lse_tile(p_s, p_t, v_tail + o_r, V, it, ms, ss, mt, st, mr, sr,
                                               MASKED=True, VEC=VEC, UNTEMPERED=UNTEMPERED)
    lse_s, lse_t = _lse_combine(ms, ss), _lse_combine(mt, st)
    if UNTEMPERED:
        lse_r = lse_s
    else:
        lse_r = _lse_combine(mr, sr)
    # pass 2: the divergence and, for the JSD and reverse KL, S = sum_v p_s g_v with g = d soft / d p_s
    soft = tl.zeros([R], dtype=tl.float32)
    big_s = tl.zeros([R], dtype=tl.float32)
    if v_tail < V:
        soft, big_s = _jsd_div_tile(p_s, p_t, v_tail + o_r, V, it, lse_s, lse_t, bt, soft, big_s, MASKED=True,
                                    VEC=VEC, MODE=MODE, FAST_LOG=FAST_LOG)
    for i in range(0, n_full):
        soft, big_s = _jsd_div_tile(p_s, p_t, (n_full - 1 - i) * BLOCK_V + o_r, V, it, lse_s, lse_t, bt, soft,
                                    big_s, MASKED=False, VEC=VEC, MODE=MODE, FAST_LOG=FAST_LOG)
    soft_r = tl.sum(soft, axis=0)
    if MODE == 1:
        s_r = soft_r
    else:
        s_r = tl.sum(big_s, axis=0)
    zt_t = tl.load(p_s + tl.where(valid & (t >= 0) & (t < V), t, 0)).to(tl.float32)
    hard = lse_r - zt_t
    tl.store(SOFT + row, tl.where(valid, soft_r, 0.0))
    tl.store(HARD + row, tl.where(valid, hard, 0.0))
    n = tl.load(NVALID)
    c_soft = tl.where(valid, w_soft / n, 0.0) * it
    c_hard = tl.where(valid, w_hard / n, 0.0)
    # pass 3: d loss / d z_s = c_soft (p_s (g - S) | p_s - p_t) + c_hard (softmax(z_s) - onehot)
    for i in range(0, n_full):
        _jsd_grad_tile(p_s, p_t, i * BLOCK_V + o_r, V, t, it, lse_s, lse_t, lse_r, bt, s_r, c_soft, c_hard,
                       MASKED=False, VEC=VEC, MODE=MODE, UNTEMPERED=UNTEMPERED, FAST_LOG=FAST_LOG)
    if v_tail < V:
        _jsd_grad_tile(p_s, p_t, v_tail + o_r, V, t, it, lse_s, lse_t, lse_r, bt, s_r, c_soft, c_hard,
                       MASKED=True, VEC=VEC, MODE=MODE, UNTEMPERED=UNTEMPERED, FAST_LOG=FAST_LOG)


def _jsd_rows_torch(zs, zt, t, soft_out, hard_out, n, V, ignore_index, inv_t, beta, w_hard, w_soft, mode):
    """_jsd_kernel in torch (fp32), for CPU tensors without the interpreter: the per-row soft and hard terms into
    soft_out / hard_out, and d loss / d student logits over zs."""
    zr = zs.float()
    ls, lt = torch.log_softmax(zr * inv_t, -1), torch.log_softmax(zt.float() * inv_t, -1)
    lr = torch.log_softmax(zr, -1)
    ps, pt = ls.exp(), lt.exp()
    if mode == 0:
        term, d_soft = pt * (lt - ls), ps - pt
    else:
        if mode == 1:
            term = ps * (ls - lt)
            g = ls - lt
        else:
            lm = torch.logaddexp(ls + math.log(1.0 - beta), lt + math.log(beta))
            term = beta * pt * (lt - lm) + (1.0 - beta) * ps * (ls - lm)
            g = (1.0 - beta) * (ls - lm)
        d_soft = ps * (g - (ps * g).sum(-1, keepdim=True))
    valid = t != ignore_index
    ti = torch.where(valid & (t >= 0) & (t < V), t, 0).long()
    soft_out.copy_(torch.where(valid, term.sum(-1), 0.0))
    hard_out.copy_(torch.where(valid, -lr.gather(1, ti[:, None])[:, 0], 0.0))
    c_soft = (torch.where(valid, w_soft / n, 0.0) * inv_t)[:, None]
    c_hard = torch.where(valid, w_hard / n, 0.0)[:, None]
    onehot = torch.arange(V, device=zs.device) == t[:, None]
    zs.copy_(c_soft * d_soft + c_hard * (lr.exp() - onehot.float()))


def _jsd_launch(
    student: torch.Tensor, student_weight: torch.Tensor, teacher: torch.Tensor, teacher_weight: torch.Tensor,
    labels: torch.Tensor, student_bias: Optional[torch.Tensor], teacher_bias: Optional[torch.Tensor],
    floats: list[float], ignore_index: int, need_dh: bool, need_dw: bool, need_db: bool, cfg_ints: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """student [N, Hs], teacher [N, Ht], labels [N]. Returns (loss, soft, hard, dh, dW, db)."""
    cfg = _engine.config_from(cfg_ints)
    w_hard, w_soft, beta, temperature = floats
    N, Hs = student.shape
    V = student_weight.shape[0]
    dev = student.device
    labels = labels.contiguous()  # read at unit stride by the row kernel
    valid_all = labels != ignore_index
    n = valid_all.sum().clamp(min=1).float().reshape(1)
    ws, bs = _engine._lowp(student_weight, student_bias, student.dtype)
    wt, bt = _engine._lowp(teacher_weight, teacher_bias, teacher.dtype)
    dh = torch.empty_like(student) if need_dh else None
    dw = torch.zeros((V, Hs), dtype=torch.float32 if student_weight.dtype != student.dtype else student_weight.dtype,
                     device=dev) if need_dw else None
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_db and student_bias is not None else None
    rows = _engine.chunk_rows(N, V, student.element_size(), cfg)
    block, vec, warps = _engine.row_launch("jsd", V, student.element_size(), dev, cfg)
    soft_rows = torch.empty(N, dtype=torch.float32, device=dev)
    hard_rows = torch.empty(N, dtype=torch.float32, device=dev)
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    kernels = _engine.kernels_on(dev)
    fast_log = dev.type == "cuda" and not _library.interpreter_on()
    with workspace(dev).borrow(((rows, V), student.dtype), ((rows, V), teacher.dtype)) as (bufs, buft):
        for s in range(0, N, rows):
            e = min(N, s + rows)
            zs, zt, h_c = bufs[: e - s], buft[: e - s], student[s:e]
            _engine._gemm_logits(h_c, ws.t(), bs, zs)
            _engine._gemm_logits(teacher[s:e], wt.t(), bt, zt)
            if kernels:
                _jsd_kernel[(e - s,)](zs, zt, labels[s:e], soft_rows[s:e], hard_rows[s:e], n, zs.stride(0),
                                      zt.stride(0), V, ignore_index, 1.0 / temperature, beta, w_hard, w_soft,
                                      MODE=mode, BLOCK_V=block, VEC=vec, UNTEMPERED=temperature == 1.0,
                                      FAST_LOG=fast_log, num_warps=warps)
            else:
                _jsd_rows_torch(zs, zt, labels[s:e], soft_rows[s:e], hard_rows[s:e], n[0], V, ignore_index,
                                1.0 / temperature, beta, w_hard, w_soft, mode)
            # the chunk now holds d loss / d student logits
            if need_dh:
                torch.mm(zs, ws, out=dh[s:e])
            if need_dw:
                _engine.add_dw(dw, zs.t(), h_c, first=False)
            if db is not None:
                db += zs.sum(0, dtype=torch.float32)
    soft, hard = soft_rows.sum(), hard_rows.sum()
    soft, hard = soft / n[0], hard / n[0]
    loss = w_hard * hard + w_soft * soft
    return (loss, soft, hard, _engine.empty(student) if dh is None else dh,
            _engine.empty(student_weight) if dw is None else dw.to(student_weight.dtype),
            _engine.empty(student_weight) if db is None else db.to(student_bias.dtype))


def _jsd_fake(student, student_weight, teacher, teacher_weight, labels, student_bias, teacher_bias, floats,
              ignore_index, need_dh, need_dw, need_db, cfg_ints):
    s = [student.new_empty((), dtype=torch.float32) for _ in range(3)]
    return tuple(s) + (torch.empty_like(student) if need_dh else _engine.empty(student),
                       torch.empty_like(student_weight) if need_dw else _engine.empty(student_weight),
                       torch.empty_like(student_bias) if (need_db and student_bias is not None)
                       else _engine.empty(student_weight))


_JSD = _library.Op("fused_linear_jsd", _jsd_launch, _jsd_fake, _common.setup_saved_grads,
                   _common.backward_saved_grads("tigon.ops.fused_linear_jsd", (0, 1, 5)))


def fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                     teacher_bias=None, *, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, ignore_index=-100,
                     temperature=1.0, config=None):
    """JSD distillation: student_input [N, Hs] @ student_weight [V, Hs].T against the teacher's [N, Ht] @ [V, Ht].T
    (no gradient to the teacher), true_labels [N]. Returns (loss, soft_loss, hard_loss), fp32 scalars; gradients for
    the student's input, weight and bias."""
    op = "tigon.ops.fused_linear_jsd"
    _common.check_head(op, student_input, student_weight, student_bias, "student_input", "student_weight",
                       "student_bias")
    _common.check_head(op, teacher_input, teacher_weight, teacher_bias, "teacher_input", "teacher_weight",
                       "teacher_bias")
    N = student_input.shape[0]
    if teacher_input.shape[0] != N:
        raise ValueError(f"{op}: teacher_input must have {N} rows like student_input, got {teacher_input.shape[0]}")
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"{op}: teacher_weight must have the student's vocabulary {student_weight.shape[0]}, got "
                         f"{teacher_weight.shape[0]}")
    _common.check_ids(op, "true_labels", true_labels, (N,), student_input.device)
    _launch.check_same_device(op, "student_input", student_input, teacher_input=teacher_input)
    floats = [_launch.check_number(op, "weight_hard_loss", weight_hard_loss),
              _launch.check_number(op, "weight_soft_loss", weight_soft_loss),
              _launch.check_number(op, "beta", beta, 0.0, 1.0), _launch.check_number(op, "temperature", temperature)]
    if temperature <= 0:
        raise ValueError(f"{op}: temperature must be > 0, got {temperature}")
    _common.check_int(op, "ignore_index", ignore_index)
    cfg = _engine.check_config(op, config)
    _common.check_id_range(op, "true_labels", true_labels, student_weight.shape[0], ignore_index)
    if not _library.use_kernels("fused_linear_jsd", student_input):
        loss, soft, hard = reference.fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
            weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta, ignore_index=ignore_index,
            temperature=temperature)
        return _library.first_order_only(op, loss), soft.detach(), hard.detach()
    out = _JSD(
        student_input, student_weight, teacher_input.detach(), teacher_weight.detach(), true_labels, student_bias,
        None if teacher_bias is None else teacher_bias.detach(), floats, ignore_index, _common.needs(student_input),
        _common.needs(student_weight), _common.needs(student_bias), cfg.ints(),
        grad_from=(student_input, student_weight, student_bias))
    return out[:3]
