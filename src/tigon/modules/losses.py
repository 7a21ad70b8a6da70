"""Loss modules on tigon.ops (no parameters, no buffers): CrossEntropyLoss and LinearCrossEntropyLoss
(state_dict-compatible with torch.nn.CrossEntropyLoss), then the fused-linear preference, RL and distillation
losses, whose options go to the constructor and tensors to forward, which returns what the functional returns."""

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


class _FusedLinearLoss(torch.nn.Module):
    _fn = None

    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, *args, **kwargs):
        return type(self)._fn(*args, **kwargs, **self.options)

    def extra_repr(self):
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class FusedLinearDPOLoss(_FusedLinearLoss):
    """forward(hidden [B, T, H], weight [V, H], target [B, T], bias=None, *, ref_logps=, ref_hidden=, ref_weight=,
    ref_bias=) -> (loss, metrics); options as tigon.ops.fused_linear_dpo (loss_type, beta, alpha, ...)."""

    _fn = staticmethod(ops.fused_linear_dpo)


class FusedLinearORPOLoss(_FusedLinearLoss):
    """forward(hidden, weight, target, bias=None, *, nll_target=None) -> (loss, metrics); see fused_linear_orpo."""

    _fn = staticmethod(ops.fused_linear_orpo)


class FusedLinearCPOLoss(_FusedLinearLoss):
    """forward(hidden, weight, target, bias=None) -> (loss, metrics); see fused_linear_cpo."""

    _fn = staticmethod(ops.fused_linear_cpo)


class FusedLinearSimPOLoss(_FusedLinearLoss):
    """forward(hidden, weight, target, bias=None) -> (loss, metrics); see fused_linear_simpo."""

    _fn = staticmethod(ops.fused_linear_simpo)


class FusedLinearKTOLoss(_FusedLinearLoss):
    """forward(hidden, weight, target, preference_labels, bias=None, *, kl=, ref_...) -> (loss, metrics)."""

    _fn = staticmethod(ops.fused_linear_kto)


class FusedLinearGRPOLoss(_FusedLinearLoss):
    """forward(hidden, weight, selected_token_ids, attention_mask, advantages, bias=None, *, old_per_token_logps=,
    ref_per_token_logps=, ...) -> (loss, metrics); see fused_linear_grpo."""

    _fn = staticmethod(ops.fused_linear_grpo)


class FusedLinearJSDLoss(_FusedLinearLoss):
    """forward(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
    teacher_bias=None) -> (loss, soft_loss, hard_loss); see fused_linear_jsd."""

    _fn = staticmethod(ops.fused_linear_jsd)


class FusedLinearLogProbs(_FusedLinearLoss):
    """forward(hidden [..., H], weight, target [...], bias=None) -> (log_probs, entropy, log_sum_sq_probs,
    mean_logits, is_top1); options temperature, logit_scale, ignore_index, config."""

    _fn = staticmethod(ops.fused_linear_logprobs)
