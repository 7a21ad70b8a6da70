"""Logit distillation on fused linear heads: generalized JSD (beta; forward KL at 0, reverse KL at 1) between a
student head and a teacher head (different hidden sizes, one vocabulary), at a temperature, mixed with the hard-label
cross-entropy of the student, as Liger-Kernel's LigerFusedLinearJSDLoss.

Every token's loss is its own (the denominators are counts known up front), so one pass suffices: per chunk of C
tokens, the student and teacher logits (two GEMMs into workspace scratch), the per-row math in fp32 and its
gradient for the chunk, then dh_c = dz_c W_s and dW_s += dz_c^T h_c. Math: docs/ops/losses.md.
"""

from typing import Optional

import torch

from .. import _launch, _library, reference
from .._workspace import workspace
from . import _common, _engine


def _chunk_math(zs, zt, t, valid, n, inv_t, beta, w_hard, w_soft):
    """(soft sum, hard sum, d(w_hard hard / n + w_soft soft / n) / d zs) for one chunk; zs, zt [C, V] fp32."""
    zs = zs.requires_grad_()
    ls = torch.log_softmax(zs * inv_t, -1)
    lt = torch.log_softmax(zt * inv_t, -1)
    if beta == 0.0:
        per = (lt.exp() * (lt - ls)).sum(-1)
    elif beta == 1.0:
        per = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(ls + torch.log1p(torch.tensor(-beta)), lt + torch.log(torch.tensor(beta)))
        per = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    soft = (per * valid).sum()
    lsm = torch.log_softmax(zs, -1)
    hard = -(lsm.gather(-1, torch.where(valid, t, 0).long().unsqueeze(-1)).squeeze(-1) * valid).sum()
    loss = (w_hard * hard + w_soft * soft) / n
    (g,) = torch.autograd.grad(loss, [zs])
    return soft.detach(), hard.detach(), g


@torch.library.custom_op("tigon::fused_linear_jsd", mutates_args=())
def fused_linear_jsd_op(
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
    valid_all = labels != ignore_index
    n = valid_all.sum().clamp(min=1).float()
    ws, bs = _engine._lowp(student_weight, student_bias, student.dtype)
    wt, bt = _engine._lowp(teacher_weight, teacher_bias, teacher.dtype)
    dh = torch.empty_like(student) if need_dh else None
    dw = torch.zeros((V, Hs), dtype=torch.float32, device=dev) if need_dw else None
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_db and student_bias is not None else None
    soft = torch.zeros((), dtype=torch.float32, device=dev)
    hard = torch.zeros((), dtype=torch.float32, device=dev)
    # fp32 math on the chunk holds ~8 [C, V] fp32 temporaries: chunks of a quarter of the usual rows
    rows = max(1, _engine.chunk_rows(N, V, 4 * student.element_size(), cfg))
    with workspace(dev).borrow(((rows, V), student.dtype), ((rows, V), teacher.dtype)) as (bufs, buft):
        for s in range(0, N, rows):
            e = min(N, s + rows)
            zs, zt, h_c = bufs[: e - s], buft[: e - s], student[s:e]
            _engine._gemm_logits(h_c, ws.t(), bs, zs)
            _engine._gemm_logits(teacher[s:e], wt.t(), bt, zt)
            with _engine.autograd_inside():
                cs, ch, g = _chunk_math(zs.float(), zt.float(), labels[s:e], valid_all[s:e], n, 1.0 / temperature,
                                        beta, w_hard, w_soft)
            soft += cs
            hard += ch
            g = g.to(student.dtype)
            if need_dh:
                torch.mm(g, ws, out=dh[s:e])
            if need_dw:
                dw.addmm_(g.t().float(), h_c.float())
            if db is not None:
                db += g.sum(0, dtype=torch.float32)
    soft, hard = soft / n, hard / n
    loss = w_hard * hard + w_soft * soft
    return (loss, soft, hard, _engine.empty(student) if dh is None else dh,
            _engine.empty(student_weight) if dw is None else dw.to(student_weight.dtype),
            _engine.empty(student_weight) if db is None else db.to(student_bias.dtype))


@fused_linear_jsd_op.register_fake
def _(student, student_weight, teacher, teacher_weight, labels, student_bias, teacher_bias, floats, ignore_index,
      need_dh, need_dw, need_db, cfg_ints):
    s = [student.new_empty((), dtype=torch.float32) for _ in range(3)]
    return tuple(s) + (torch.empty_like(student) if need_dh else _engine.empty(student),
                       torch.empty_like(student_weight) if need_dw else _engine.empty(student_weight),
                       torch.empty_like(student_bias) if (need_db and student_bias is not None)
                       else _engine.empty(student_weight))


fused_linear_jsd_op.register_autograd(_common.backward_saved_grads("tigon.ops.fused_linear_jsd", (0, 1, 5)),
                                      setup_context=_common.setup_saved_grads(3))


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
    out = torch.ops.tigon.fused_linear_jsd(
        student_input, student_weight, teacher_input.detach(), teacher_weight.detach(), true_labels, student_bias,
        None if teacher_bias is None else teacher_bias.detach(), floats, ignore_index, _common.needs(student_input),
        _common.needs(student_weight), _common.needs(student_bias), cfg.ints())
    return out[:3]
