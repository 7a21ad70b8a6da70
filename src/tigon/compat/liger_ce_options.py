"""Liger's cross-entropy options beyond the loss (return_z_loss, return_token_accuracy, return_predicted_tokens,
use_token_scaling, class weights) on top of Tigon's cross-entropy kernels, with Liger 0.8.5's values:

- the loss comes from Tigon's kernel with reduction="none", then Liger's normalization ("mean": / non-ignored
  tokens) and token scaling (each token's loss times its detached target probability) are applied to it;
- z-loss, accuracy, predicted tokens and the scaling probabilities come from one no-grad pass over the logits
  (for the fused linear loss: one more logits GEMM, chunk by chunk, never the whole [N, V]);
- class weights (ce_weight / weight) take a plain-PyTorch path that forms the [N, V] logits: Liger's formula,
  the weighted loss divided by the summed weights of the non-ignored targets, the z-loss unweighted.
"""

import dataclasses
from typing import Optional

import torch

from .. import ops

_STATS_ROWS = 4096


@dataclasses.dataclass
class CrossEntropyOutput:
    """What Liger's losses return when asked for more than the loss."""

    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def _logits(hidden, weight, bias, softcap):
    z = hidden.float() if weight is None else torch.nn.functional.linear(hidden, weight, bias).float()
    return z if softcap is None else softcap * torch.tanh(z / softcap)


@torch.no_grad()
def _stats(hidden, weight, bias, target, softcap):
    """(lse, argmax, probability of the target) per row, fp32, in chunks of rows."""
    lse, top, p_target = [], [], []
    for i in range(0, hidden.shape[0], _STATS_ROWS):
        z = _logits(hidden[i:i + _STATS_ROWS], weight, bias, softcap)
        row_lse = z.logsumexp(-1)
        t = target[i:i + _STATS_ROWS].clamp(0, z.shape[-1] - 1)
        lse.append(row_lse)
        top.append(z.argmax(-1))
        p_target.append((z.gather(-1, t[:, None]).squeeze(-1) - row_lse).exp())
    return torch.cat(lse), torch.cat(top), torch.cat(p_target)


def _weighted_rows(hidden, weight, bias, target, class_weight, keep, label_smoothing, softcap):
    """Liger's weighted per-token loss (no z-loss, not normalized), with autograd, on the full logits."""
    z = _logits(hidden, weight, bias, softcap)
    t = target.clamp(0, z.shape[-1] - 1)
    lse = z.logsumexp(-1)
    w = class_weight.float()
    loss = w[t] * (lse - z.gather(-1, t[:, None]).squeeze(-1))
    if label_smoothing > 0:
        smooth = (label_smoothing / z.shape[-1]) * ((lse[:, None] - z) * w).sum(-1)
        loss = loss * (1 - label_smoothing) + smooth
    return torch.where(keep, loss, 0.0)


def liger_cross_entropy_with_options(hidden, weight, bias, target, *, class_weight=None, ignore_index=-100,
                                     lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
                                     return_z_loss=False, use_token_scaling=False, return_token_accuracy=False,
                                     return_predicted_tokens=False, accum_dtype=None):
    """Liger's cross-entropy with every option: hidden [N, H] and weight [V, H] (bias [V] or None), or the logits
    [N, V] as hidden with weight None. Returns the loss, or a CrossEntropyOutput when a return_* flag is set."""
    hidden, target = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    keep = target != ignore_index
    n = keep.sum().float()
    lse, top, p_target = _stats(hidden, weight, bias, target, softcap)
    z_rows = torch.where(keep, lse_square_scale * lse * lse, 0.0)
    if class_weight is not None:
        ce_rows = _weighted_rows(hidden, weight, bias, target, class_weight, keep, label_smoothing, softcap)
        denominator = class_weight.float()[target.clamp(0, class_weight.shape[0] - 1)][keep].sum()
        loss_rows = ce_rows / denominator + z_rows / n if reduction == "mean" else ce_rows + z_rows
    else:
        kw = dict(ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing,
                  z_loss_scale=lse_square_scale, softcap=softcap)
        loss_rows = (ops.cross_entropy(hidden, target, **kw) if weight is None else
                     ops.linear_cross_entropy(hidden, weight, target, bias, accum_dtype=accum_dtype, **kw)).float()
        if reduction == "mean":
            loss_rows = loss_rows / n
    if reduction == "mean":
        z_rows = z_rows / n
    if use_token_scaling:
        scale = torch.where(keep, p_target, 0.0)
        loss_rows, z_rows = loss_rows * scale, z_rows * scale
    correct = torch.where(keep, (top == target).float(), 0.0)
    if reduction == "none":
        loss, z_loss, accuracy = loss_rows, z_rows, correct
    else:
        loss, z_loss, accuracy = loss_rows.sum(), z_rows.sum(), correct.sum() / n
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss if return_z_loss else None,
                              token_accuracy=accuracy if return_token_accuracy else None,
                              predicted_tokens=torch.where(keep, top, -1) if return_predicted_tokens else None)


def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index: int = -100,
                                     lse_square_scale: float = 0.0, label_smoothing: float = 0.0,
                                     reduction: str = "mean", softcap: Optional[float] = None,
                                     return_z_loss: bool = False, accum_dtype=None, use_token_scaling: bool = False,
                                     return_token_accuracy: bool = False, return_predicted_tokens: bool = False,
                                     chunk_mem_const: int = 1):
    """liger_kernel.transformers.functional.liger_fused_linear_cross_entropy: input [N, H], weight [V, H]. Returns
    the loss alone, or a CrossEntropyOutput when a return_* flag is set, as Liger's. chunk_mem_const (Liger's chunk
    sizing) is accepted; Tigon chunks by its own measured configuration."""
    return liger_cross_entropy_with_options(
        input, weight, bias, target, class_weight=ce_weight, ignore_index=ignore_index,
        lse_square_scale=lse_square_scale, label_smoothing=label_smoothing, reduction=reduction, softcap=softcap,
        return_z_loss=return_z_loss, use_token_scaling=use_token_scaling, return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens, accum_dtype=accum_dtype)
