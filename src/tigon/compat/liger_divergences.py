"""Liger-Kernel 0.8.5's divergence losses (liger_kernel.transformers): LigerFusedLinearJSD on Tigon's fused JSD
kernel, the cross-entropy terms on Tigon's cross-entropy kernel, the rest (JSD, KL, TVD on given distributions) in
plain PyTorch with Liger's formulas and reductions. As in Liger, the target / teacher side gets no gradient.
"""

import math
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import ops

_REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _check_reduction(cls, reduction, allowed=_REDUCTIONS):
    if reduction not in allowed:
        raise ValueError(f"{cls}: reduction must be one of {allowed}, got {reduction!r}")


def _kept_rows(cls, n, labels, ignore_index, device):
    """([N] bool of the rows that count, their number as a float tensor) from optional labels [N]."""
    if labels is None:
        return torch.ones(n, dtype=torch.bool, device=device), torch.tensor(float(n), device=device)
    if labels.shape != (n,):
        raise ValueError(f"{cls}: shift_labels must have shape ({n},), got {tuple(labels.shape)}")
    keep = labels != ignore_index
    return keep, keep.sum().float()


def jsd_rows(log_q, log_p, beta):
    """Per-element generalized JSD of Liger (student log_q, teacher log_p, fp32): forward KL(P||Q) at beta 0,
    reverse KL(Q||P) at beta 1, else beta P (log P - log M) + (1 - beta) Q (log Q - log M), M = beta P +
    (1 - beta) Q."""
    if beta == 0.0:
        return log_p.exp() * (log_p - log_q)
    if beta == 1.0:
        return log_q.exp() * (log_q - log_p)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))
    return beta * log_p.exp() * (log_p - log_m) + (1 - beta) * log_q.exp() * (log_q - log_m)


class LigerJSD(nn.Module):
    """Generalized JSD between log-probabilities: forward(log_q [N, V] student, log_p [N, V] teacher,
    shift_labels [N] or None) -> scalar, summed over the rows whose label is not ignore_index and divided by their
    number. beta in [0, 1]."""

    def __init__(self, beta: float = 0.5, ignore_index: int = -100):
        super().__init__()
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"LigerJSD: beta must be in [0, 1], got {beta!r}")
        self.beta, self.ignore_index = beta, ignore_index

    def forward(self, log_q: torch.Tensor, log_p: torch.Tensor, shift_labels: Optional[torch.LongTensor] = None):
        keep, n = _kept_rows("LigerJSD", log_q.shape[0], shift_labels, self.ignore_index, log_q.device)
        rows = jsd_rows(log_q.float(), log_p.detach().float(), self.beta).sum(-1)
        return (torch.where(keep, rows, 0.0).sum() / n).to(log_q.dtype)


class LigerKLDIVLoss(nn.KLDivLoss):
    """torch.nn.KLDivLoss with Liger's eps: forward(y_pred [N, V] log-probabilities, y_true [N, V]) ->
    y_true * (log(max(y_true, eps)) - y_pred) (log_target: exp(y_true) * (y_true - y_pred)); "batchmean" divides
    by N, "mean" by N * V, "sum" sums, "none" keeps [N, V]."""

    def __init__(self, eps: float = 1e-10, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_reduction("LigerKLDIVLoss", self.reduction)
        self.eps = eps

    def forward(self, y_pred, y_true):
        x, t = y_pred.float(), y_true.detach().float()
        loss = t.exp() * (t - x) if self.log_target else t * (t.clamp_min(self.eps).log() - x)
        if self.reduction == "none":
            return loss.to(y_pred.dtype)
        total = loss.sum()
        scale = {"sum": 1, "batchmean": y_pred.shape[0], "mean": y_pred.shape[0] * y_pred.shape[-1]}[self.reduction]
        return (total / scale).to(y_pred.dtype)


class LigerTVDLoss(nn.Module):
    """Total variation distance 0.5 |p - q| between probabilities p, q [N, V], gradient to p only; rows whose
    shift_labels entry is ignore_index count for nothing. "batchmean" divides the sum by the counted rows, "mean"
    by counted rows * V, "sum" sums, "none" keeps [N, V] (ignored rows zero)."""

    def __init__(self, reduction="batchmean", ignore_index: int = -100):
        super().__init__()
        _check_reduction("LigerTVDLoss", reduction)
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, p, q, shift_labels=None):
        keep, n = _kept_rows("LigerTVDLoss", p.shape[0], shift_labels, self.ignore_index, p.device)
        loss = torch.where(keep[:, None], 0.5 * (p.float() - q.detach().float()).abs(), 0.0)
        if self.reduction == "none":
            return loss.to(p.dtype)
        scale = {"sum": 1, "batchmean": n, "mean": n * p.shape[-1]}[self.reduction]
        return (loss.sum() / scale).to(p.dtype)


def _label_fill(ignore_index):
    return 0 if ignore_index != 0 else 1


class LigerFusedLinearJSD(nn.Module):
    """Generalized JSD of student_input [N, Hs] @ student_weight [V, Hs].T against teacher_input [N, Ht] @
    teacher_weight [V, Ht].T at a temperature, without the [N, V] logits, on tigon.ops.fused_linear_jsd (its soft
    term alone). Averaged over the rows whose shift_labels entry is not ignore_index (all rows for None).
    accum_dtype is kept as an attribute: Tigon's kernel chooses the dW accumulation itself."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if temperature == 0:
            raise ValueError("LigerFusedLinearJSD: temperature cannot be 0")
        self.jsd_beta, self.temperature, self.ignore_index, self.accum_dtype = (jsd_beta, temperature, ignore_index,
                                                                               accum_dtype)

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
        if shift_labels is None:  # every row counts: a label that is not ignore_index (the hard term has weight 0)
            shift_labels = torch.full(student_input.shape[:1], _label_fill(self.ignore_index), dtype=torch.long,
                                      device=student_input.device)
        loss, _, _ = ops.fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                          weight_hard_loss=0.0, weight_soft_loss=1.0, beta=self.jsd_beta,
                                          ignore_index=self.ignore_index, temperature=self.temperature)
        return loss


def _kl_chunk(x, w, target, keep, temperature, eps):
    log_q = torch.log_softmax((x @ w.t()).float() / temperature, dim=-1)
    t = target.float()
    rows = (t * (t.clamp_min(eps).log() - log_q)).sum(-1)
    return torch.where(keep, rows, 0.0).sum()


class LigerFusedLinearKLDivLoss(nn.Module):
    """KL(target || softmax(student_input [N, H] @ student_weight [V, H].T / temperature)) for target
    probabilities [N, V], rows whose shift_labels entry is ignore_index left out. "batchmean" divides by the counted
    rows, "mean" by counted rows * V, "sum" sums ("none" is not supported, as in Liger). Plain PyTorch over chunks
    of rows, each recomputed in backward (torch.utils.checkpoint): one [chunk, V] of logits at a time."""

    _CHUNK_ROWS = 1024

    def __init__(self, reduction: Optional[str] = "batchmean", ignore_index: int = -100, temperature: float = 1.0,
                 eps: float = 1e-10, accum_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if temperature == 0:
            raise ValueError("LigerFusedLinearKLDivLoss: temperature cannot be 0")
        _check_reduction("LigerFusedLinearKLDivLoss", reduction, ("sum", "mean", "batchmean"))
        self.reduction, self.temperature, self.ignore_index = reduction, temperature, ignore_index
        self.eps, self.accum_dtype = eps, accum_dtype

    def forward(self, student_input, student_weight, target, shift_labels=None):
        n_rows = student_input.shape[0]
        keep, n = _kept_rows("LigerFusedLinearKLDivLoss", n_rows, shift_labels, self.ignore_index,
                             student_input.device)
        target = target.detach()
        total = sum(checkpoint(_kl_chunk, student_input[i:i + self._CHUNK_ROWS], student_weight,
                               target[i:i + self._CHUNK_ROWS], keep[i:i + self._CHUNK_ROWS], self.temperature,
                               self.eps, use_reentrant=False)
                    for i in range(0, n_rows, self._CHUNK_ROWS))
        scale = {"sum": 1, "batchmean": n, "mean": n * student_weight.shape[0]}[self.reduction]
        return total / scale

    def extra_repr(self):
        return (f"reduction={self.reduction}, ignore_index={self.ignore_index}, temperature={self.temperature}, "
                f"eps={self.eps}, accum_dtype={self.accum_dtype}")


class LigerFusedCETVDLoss(nn.Module):
    """Per-token cross-entropy (tigon.ops.cross_entropy) and total variation distance 0.5 sum |p - q| between
    softmax(student_logits) and softmax(teacher_logits) (teacher: no gradient), both [N] fp32 and unreduced; rows
    whose target is ignore_index give 0 for both. forward(student_logits [N, V], teacher_logits [N, V], target)."""

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index

    def forward(self, student_logits, teacher_logits, target):
        if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
            raise ValueError("LigerFusedCETVDLoss: student_logits and teacher_logits must be [N, V] of one shape, got "
                             f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
        ce = ops.cross_entropy(student_logits, target, ignore_index=self.ignore_index, reduction="none")
        p = torch.softmax(student_logits.float(), -1)
        q = torch.softmax(teacher_logits.detach().float(), -1)
        tvd = torch.where(target != self.ignore_index, 0.5 * (p - q).abs().sum(-1), 0.0)
        return ce.float(), tvd


class LigerVocabParallelCrossEntropy(nn.Module):
    """Per-token cross-entropy over [S, B, V] logits -> [S, B] fp32, on tigon.ops.cross_entropy. Label smoothing
    "pytorch" (alpha / V on every class) or "megatron" (alpha / (V - 1) on the other classes). One rank only: a
    tp_group of more than one rank (the vocabulary split across ranks) raises NotImplementedError."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "none",
                 label_smoothing_formula: str = "pytorch", label_smoothing_mode: str = "global"):
        super().__init__()
        cls = "LigerVocabParallelCrossEntropy"
        if reduction != "none":
            raise ValueError(f"{cls}: reduction must be 'none' (per-token loss), got {reduction!r}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"{cls}: label_smoothing must be in [0, 1), got {label_smoothing!r}")
        if label_smoothing_formula not in ("pytorch", "megatron"):
            raise ValueError(f"{cls}: label_smoothing_formula must be 'pytorch' or 'megatron', got "
                             f"{label_smoothing_formula!r}")
        if label_smoothing_mode not in ("global", "partition"):
            raise ValueError(f"{cls}: label_smoothing_mode must be 'global' or 'partition', got "
                             f"{label_smoothing_mode!r}")
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction
        self.label_smoothing_formula, self.label_smoothing_mode = label_smoothing_formula, label_smoothing_mode

    def forward(self, vocab_parallel_logits, target, tp_group=None):
        if vocab_parallel_logits.dim() != 3:
            raise ValueError("LigerVocabParallelCrossEntropy: vocab_parallel_logits must be [seq, batch, vocab], got "
                             f"shape {tuple(vocab_parallel_logits.shape)}")
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            raise NotImplementedError("LigerVocabParallelCrossEntropy: Tigon has no vocabulary-parallel "
                                      "cross-entropy across ranks; gather the logits, or use liger-kernel's")
        V = vocab_parallel_logits.shape[-1]
        alpha = self.label_smoothing
        if self.label_smoothing_formula == "megatron" and V > 1:
            alpha = alpha * V / (V - 1)  # the same two-term form with alpha_eff (Liger's rescaling)
        loss = ops.cross_entropy(vocab_parallel_logits.reshape(-1, V), target.reshape(-1),
                                 ignore_index=self.ignore_index, reduction="none", label_smoothing=alpha)
        return loss.float().view(target.shape)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"reduction={self.reduction!r}, label_smoothing_formula={self.label_smoothing_formula!r}, "
                f"label_smoothing_mode={self.label_smoothing_mode!r}")


__all__ = ["LigerFusedCETVDLoss", "LigerFusedLinearJSD", "LigerFusedLinearKLDivLoss", "LigerJSD", "LigerKLDIVLoss",
           "LigerTVDLoss", "LigerVocabParallelCrossEntropy"]
