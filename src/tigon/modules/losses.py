"""Loss modules on tigon.ops' fused-linear preference, RL and distillation losses (no parameters, no buffers): the
options go to the constructor, the tensors to forward, which returns what the functional returns."""

import torch

from .. import ops


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
