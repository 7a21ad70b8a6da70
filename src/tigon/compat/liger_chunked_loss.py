"""Liger-Kernel 0.8.5's chunked-loss modules (`liger_kernel.chunked_loss`) on Tigon's fused-linear losses: the same
class names, constructor arguments (defaults included), forward signatures and return values, so code written for
them runs unchanged. `compiled` and `chunk_size` are accepted and ignored: Tigon's losses chunk by rows
(tigon.ops.FusedLinearLossConfig) and are one torch.compile node already."""

import torch

from .. import ops

__all__ = [
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearGRPOLoss",
    "LigerFusedLinearJSDLoss",
    "LigerFusedLinearKTOLoss",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOLoss",
]


class LigerFusedLinearDPOLoss(torch.nn.Module):
    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, compute_nll_loss: bool = False,
                 compiled: bool = True, use_ref_model: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                 discopop_tau: float = 0.05):
        super().__init__()
        if loss_type not in ops.DPO_LOSS_TYPES:
            raise ValueError(f"Unsupported loss_type: {loss_type}. Supported types are: {set(ops.DPO_LOSS_TYPES)}")
        if loss_type == "exo_pair" and label_smoothing <= 0.0:
            raise ValueError("label_smoothing must be > 0 for loss_type='exo_pair'. The EXO paper recommends 1e-3.")
        if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0.0, 0.5) for loss_type='robust'. Got {label_smoothing}.")
        self.ignore_index, self.beta, self.alpha, self.compute_nll_loss = ignore_index, beta, alpha, compute_nll_loss
        self.compiled, self.use_ref_model, self.average_log_prob = compiled, use_ref_model, average_log_prob
        self.chunk_size, self.loss_type, self.label_smoothing = chunk_size, loss_type, label_smoothing
        self.discopop_tau = discopop_tau

    def forward(self, lin_weight, _input, target, bias=None, ref_input=None, ref_weight=None, ref_bias=None):
        use_ref = self.use_ref_model and ref_input is not None
        return ops.fused_linear_dpo(
            _input, lin_weight, target, bias, loss_type=self.loss_type, beta=self.beta, alpha=self.alpha,
            label_smoothing=self.label_smoothing, discopop_tau=self.discopop_tau, ignore_index=self.ignore_index,
            compute_nll_loss=self.compute_nll_loss, average_log_prob=self.average_log_prob,
            ref_hidden=ref_input if use_ref else None, ref_weight=ref_weight if use_ref else None,
            ref_bias=ref_bias if use_ref else None)


class LigerFusedLinearORPOLoss(torch.nn.Module):
    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compute_nll_loss: bool = True,
                 compiled: bool = True, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.compute_nll_loss = ignore_index, beta, compute_nll_loss
        self.compiled, self.chunk_size = compiled, chunk_size

    def forward(self, lin_weight, _input, target, bias=None, nll_target=None):
        return ops.fused_linear_orpo(_input, lin_weight, target, bias, beta=self.beta,
                                     compute_nll_loss=self.compute_nll_loss, nll_target=nll_target,
                                     ignore_index=self.ignore_index)


class LigerFusedLinearCPOLoss(torch.nn.Module):
    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, average_log_prob: bool = False,
                 chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled, self.average_log_prob = compute_nll_loss, compiled, average_log_prob
        self.chunk_size = chunk_size

    def forward(self, lin_weight, _input, target, bias=None):
        return ops.fused_linear_cpo(_input, lin_weight, target, bias, beta=self.beta, alpha=self.alpha,
                                    label_smoothing=self.label_smoothing, compute_nll_loss=self.compute_nll_loss,
                                    average_log_prob=self.average_log_prob, ignore_index=self.ignore_index)


class LigerFusedLinearSimPOLoss(torch.nn.Module):
    def __init__(self, ignore_index: int = -100, beta: float = 0.1, alpha: float = 1.0, label_smoothing: float = 0.0,
                 compute_nll_loss: bool = True, compiled: bool = True, gamma: float = 0.5, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.alpha, self.label_smoothing = ignore_index, beta, alpha, label_smoothing
        self.compute_nll_loss, self.compiled, self.gamma = compute_nll_loss, compiled, gamma
        self.chunk_size = chunk_size

    def forward(self, lin_weight, _input, target, bias=None):
        return ops.fused_linear_simpo(_input, lin_weight, target, bias, beta=self.beta, alpha=self.alpha,
                                      gamma=self.gamma, label_smoothing=self.label_smoothing,
                                      compute_nll_loss=self.compute_nll_loss, ignore_index=self.ignore_index)


class LigerFusedLinearKTOLoss(torch.nn.Module):
    def __init__(self, ignore_index: int = -100, beta: float = 0.1, compiled: bool = True, use_ref_model: bool = False,
                 average_log_prob: bool = False, chunk_size: int = 1):
        super().__init__()
        self.ignore_index, self.beta, self.compiled, self.use_ref_model = ignore_index, beta, compiled, use_ref_model
        self.average_log_prob, self.chunk_size = average_log_prob, chunk_size

    def forward(self, _input, lin_weight, target, bias=None, preference_labels=None, ref_input=None, ref_weight=None,
                ref_bias=None, kl=None):
        if preference_labels is None:
            raise ValueError("preference_labels must be provided for unpaired preference loss")
        use_ref = self.use_ref_model and ref_input is not None
        return ops.fused_linear_kto(_input, lin_weight, target, preference_labels, bias, beta=self.beta,
                                    ignore_index=self.ignore_index, average_log_prob=self.average_log_prob, kl=kl,
                                    ref_hidden=ref_input if use_ref else None,
                                    ref_weight=ref_weight if use_ref else None, ref_bias=ref_bias if use_ref else None)


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length=None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta=None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        super().__init__()
        if sapo_temperature_pos <= 0:
            raise ValueError(f"sapo_temperature_pos must be positive, got {sapo_temperature_pos}")
        if sapo_temperature_neg <= 0:
            raise ValueError(f"sapo_temperature_neg must be positive, got {sapo_temperature_neg}")
        if delta is not None and delta <= 0:
            raise ValueError(f"delta must be positive, got {delta}")
        if loss_type not in ops.GRPO_LOSS_TYPES:
            raise ValueError(f"LigerFusedLinearGRPOLoss on Tigon: loss_type must be one of {list(ops.GRPO_LOSS_TYPES)}"
                             f" (cispo, sapo, luspo and vespo are not implemented), got {loss_type!r}")
        if use_bias_correction_kl:
            raise ValueError("LigerFusedLinearGRPOLoss on Tigon: use_bias_correction_kl=True is not implemented")
        self.beta, self.compiled, self.use_ref_model, self.chunk_size = beta, compiled, use_ref_model, chunk_size
        self.epsilon_low, self.epsilon_high, self.loss_type = epsilon_low, epsilon_high, loss_type
        self.max_completion_length, self.importance_sampling_level = max_completion_length, importance_sampling_level
        self.sapo_temperature_pos, self.sapo_temperature_neg = sapo_temperature_pos, sapo_temperature_neg
        self.temperature, self.delta, self.use_bias_correction_kl = temperature, delta, use_bias_correction_kl
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        if vllm_is_ratio is not None:
            raise ValueError("LigerFusedLinearGRPOLoss on Tigon: vllm_is_ratio is not implemented")
        use_ref = self.use_ref_model and ref_per_token_logps is None and ref_input is not None
        return ops.fused_linear_grpo(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias,
            ref_per_token_logps=ref_per_token_logps if self.use_ref_model else None,
            old_per_token_logps=old_per_token_logps, ref_hidden=ref_input if use_ref else None,
            ref_weight=ref_weight if use_ref else None, ref_bias=ref_bias if use_ref else None, beta=self.beta,
            epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, loss_type=self.loss_type,
            max_completion_length=self.max_completion_length,
            importance_sampling_level=self.importance_sampling_level, temperature=self.temperature, delta=self.delta,
            num_items_in_batch=num_items_in_batch)


class LigerFusedLinearJSDLoss(torch.nn.Module):
    def __init__(self, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
                 ignore_index: int = -100, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
                 return_soft_hard_loss: bool = False):
        super().__init__()
        assert temperature != 0, "Temperature cannot be 0."
        self.weight_hard_loss, self.weight_soft_loss = weight_hard_loss, weight_soft_loss
        self.ignore_index = ignore_index
        self.temperature, self.compiled, self.beta, self.chunk_size = temperature, compiled, beta, chunk_size
        self.return_soft_hard_loss = return_soft_hard_loss

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                teacher_bias=None):
        loss, soft, hard = ops.fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
            weight_hard_loss=self.weight_hard_loss, weight_soft_loss=self.weight_soft_loss, beta=self.beta,
            ignore_index=self.ignore_index, temperature=self.temperature)
        return (loss, soft, hard) if self.return_soft_hard_loss else loss
