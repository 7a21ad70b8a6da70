"""Loss modules on tigon.ops.cross_entropy and tigon.ops.linear_cross_entropy (no parameters, no buffers:
state_dict-compatible with torch.nn.CrossEntropyLoss)."""

import torch

from .. import ops


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss for class-index targets, plus z-loss and softcap; forward(logits [..., V],
    target [...], num_items_in_batch=None) -> fp32 loss."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss_scale=0.0, softcap=None,
                 inplace_backward=False):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss_scale, self.softcap, self.inplace_backward = z_loss_scale, softcap, inplace_backward

    def forward(self, logits, target, num_items_in_batch=None):
        return ops.cross_entropy(
            logits, target, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, z_loss_scale=self.z_loss_scale, softcap=self.softcap,
            inplace_backward=self.inplace_backward, num_items_in_batch=num_items_in_batch,
        )

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss_scale={self.z_loss_scale}, softcap={self.softcap}")


class LinearCrossEntropyLoss(torch.nn.Module):
    """Cross-entropy of hidden @ weight.T + bias without the logits; forward(hidden [..., H], weight [V, H],
    target [...], bias=None, num_items_in_batch=None) -> fp32 loss."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss_scale=0.0, softcap=None,
                 accum_dtype=None, skip_ignored=False):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss_scale, self.softcap, self.accum_dtype = z_loss_scale, softcap, accum_dtype
        self.skip_ignored = skip_ignored

    def forward(self, hidden, weight, target, bias=None, num_items_in_batch=None):
        return ops.linear_cross_entropy(
            hidden, weight, target, bias, ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, z_loss_scale=self.z_loss_scale, softcap=self.softcap,
            num_items_in_batch=num_items_in_batch, accum_dtype=self.accum_dtype, skip_ignored=self.skip_ignored,
        )

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss_scale={self.z_loss_scale}, "
                f"softcap={self.softcap}, accum_dtype={self.accum_dtype}, skip_ignored={self.skip_ignored}")
