"""Liger-Kernel 0.8.5's module classes (liger_kernel.transformers) on Tigon's modules and ops: the same
constructor and forward signatures, parameter names and initialisation, so code that builds
`LigerRMSNorm(hidden, eps)` or calls `LigerFusedLinearCrossEntropyLoss()(lm_head.weight, h, y)` runs Tigon's
kernels. Each is a subclass of the Tigon module it maps onto (isinstance checks and from_hf keep working).

Liger options that only choose among Liger's own kernels (in_place, row_mode, impl, mode, backend) are accepted
and kept as attributes; Tigon's kernels make those choices themselves. The tiled MLPs' num_shards does tile: the
MLP runs shard by shard over the tokens (tigon.memory.tiled_apply). The loss options
Tigon's kernels do not compute themselves (class weights, a separate z-loss, token scaling, token accuracy,
predicted tokens) are computed around them with Liger's values (liger_ce_options.py).
"""

import math
from typing import Optional

import torch
from torch import nn

from .. import ops
from ..memory.tiling import shard_tile_tokens, tiled_apply
from ..modules import CrossEntropyLoss, GeGLUMLP, LayerNorm, LinearCrossEntropyLoss, RMSNorm, SwiGLUMLP
from .liger_ce_options import CrossEntropyOutput, liger_cross_entropy_with_options


def _init_fn(cls, init_fn):
    if init_fn not in ("ones", "zeros"):
        raise ValueError(f"{cls}: init_fn must be 'ones' or 'zeros', got {init_fn!r}")
    return torch.ones if init_fn == "ones" else torch.zeros


class LigerRMSNorm(RMSNorm):
    """liger_kernel.transformers.LigerRMSNorm on tigon.ops.rms_norm: forward(hidden_states). casting_mode
    'llama', 'gemma' or 'none' as in Liger; elementwise_affine=False normalizes without a weight."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=True,
                 row_mode=None, elementwise_affine=True):
        init = _init_fn("LigerRMSNorm", init_fn)
        super().__init__(hidden_size, eps, offset=offset, casting_mode=casting_mode)
        self.elementwise_affine, self.in_place, self.row_mode = elementwise_affine, in_place, row_mode
        self._size = hidden_size
        if elementwise_affine:
            self.weight = nn.Parameter(init(hidden_size))
        else:
            del self.weight
            self.register_parameter("weight", None)

    @property
    def hidden_size(self):
        return self._size

    def forward(self, hidden_states):
        return ops.rms_norm(hidden_states, self.weight, self.eps, offset=self.offset, casting_mode=self.casting_mode)

    def extra_repr(self):
        shape = None if self.weight is None else tuple(self.weight.shape)
        return f"weight_shape={shape}, eps={self.eps}, offset={self.offset}, casting_mode={self.casting_mode!r}"


class LigerFusedAddRMSNorm(RMSNorm):
    """liger_kernel.transformers.LigerFusedAddRMSNorm on tigon.ops.add_rms_norm: forward(hidden_states,
    residual) -> (rms_norm(hidden_states + residual), hidden_states + residual)."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones", in_place=False):
        init = _init_fn("LigerFusedAddRMSNorm", init_fn)
        super().__init__(hidden_size, eps, offset=offset, casting_mode=casting_mode)
        self.weight = nn.Parameter(init(hidden_size))
        self.in_place = in_place

    def forward(self, hidden_states, residual):
        return ops.add_rms_norm(hidden_states, residual, self.weight, self.eps, offset=self.offset,
                                casting_mode=self.casting_mode)


class LigerLayerNorm(LayerNorm):
    """liger_kernel.transformers.LigerLayerNorm on tigon.ops.layer_norm: a weight (init_fn) and a bias, zeros,
    or standard-normal with bias=True, as Liger initialises them; forward(hidden_states)."""

    def __init__(self, hidden_size, eps=1e-6, bias=False, init_fn="ones", impl=None, mode=None, backend=None):
        init = _init_fn("LigerLayerNorm", init_fn)
        super().__init__(hidden_size, eps)
        self.hidden_size = hidden_size
        self.impl, self.mode = impl if impl is not None else backend, mode
        self.weight = nn.Parameter(init(hidden_size))
        self.bias = nn.Parameter(torch.randn(hidden_size) if bias else torch.zeros(hidden_size))

    @property
    def backend(self):
        return self.impl

    @property
    def variance_epsilon(self):  # Liger's name for eps
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value):
        self.eps = value

    def forward(self, hidden_states):
        return ops.layer_norm(hidden_states, self.weight, self.bias, self.eps)


def _check_act(cls, config, acts=("silu", "swish")):
    act = getattr(config, "hidden_act", None)
    if act not in acts:
        raise ValueError(f"{cls}: config.hidden_act must be one of {acts}, got {act!r}")


class LigerSwiGLUMLP(SwiGLUMLP):
    """liger_kernel.transformers.LigerSwiGLUMLP(config, intermediate_size=None): LlamaMLP's gate_proj, up_proj,
    down_proj (no bias) on Tigon's SwiGLU MLP; config.hidden_act must be silu or swish."""

    def __init__(self, config, intermediate_size=None):
        _check_act(type(self).__name__, config)
        super().__init__(hidden_size=config.hidden_size, bias=False,
                         intermediate_size=intermediate_size if intermediate_size is not None
                         else config.intermediate_size)
        self.config = config


class LigerQwen3MoeSwiGLUMLP(LigerSwiGLUMLP):
    """liger_kernel.transformers.LigerQwen3MoeSwiGLUMLP(config, intermediate_size=None): Qwen3-MoE's MLP."""


class LigerPhi3SwiGLUMLP(SwiGLUMLP):
    """liger_kernel.transformers.LigerPhi3SwiGLUMLP(config): Phi-3's packed gate_up_proj [2I, H] and down_proj."""

    def __init__(self, config):
        _check_act("LigerPhi3SwiGLUMLP", config)
        super().__init__(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, bias=False,
                         fused_gate_up=True)
        self.config = config


class LigerGEGLUMLP(GeGLUMLP):
    """liger_kernel.transformers.LigerGEGLUMLP(config): GemmaMLP's layout on Tigon's GeGLU MLP. Like Liger it
    computes gelu with the tanh approximation whatever config.hidden_act says."""

    def __init__(self, config):
        super().__init__(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, bias=False)
        self.config = config


def _check_shards(module, num_shards) -> None:
    if num_shards is not None and (isinstance(num_shards, bool) or not isinstance(num_shards, int)):
        raise TypeError(f"{type(module).__name__}: num_shards must be None or an int, got "
                        f"{type(num_shards).__name__}")


def _sharded(module, forward, x):
    """forward(x) shard by shard over the tokens, as Liger's tiled MLPs cut them (module.num_shards)."""
    if x.dim() < 2:
        raise ValueError(f"{type(module).__name__}: x must have shape [..., T, hidden], got {tuple(x.shape)}")
    shards = math.ceil(x.shape[-2] / x.shape[-1]) if module.num_shards is None else module.num_shards
    return tiled_apply(forward, x, shard_tile_tokens(x.shape[-2], shards),
                       params=[p for p in module.parameters() if p.requires_grad])


class LigerTiledSwiGLUMLP(LigerSwiGLUMLP):
    """liger_kernel.transformers.LigerTiledSwiGLUMLP(config, num_shards=None): the SwiGLU MLP run shard by shard
    over the tokens (tigon.memory.tiled_apply), so only one shard's intermediates are alive; the backward
    recomputes each shard. num_shards None: ceil(T / hidden_size) shards, as in Liger; shards of
    ceil(T / num_shards) tokens, as torch.chunk cuts them. Tiles in eval too, as Liger's does."""

    def __init__(self, config, num_shards: Optional[int] = None):
        _check_shards(self, num_shards)
        super().__init__(config)
        self.num_shards = num_shards

    def forward(self, x):
        return _sharded(self, super().forward, x)


class LigerTiledGEGLUMLP(LigerGEGLUMLP):
    """liger_kernel.transformers.LigerTiledGEGLUMLP(config, num_shards=None): the GeGLU MLP shard by shard, as
    LigerTiledSwiGLUMLP."""

    def __init__(self, config, num_shards: Optional[int] = None):
        _check_shards(self, num_shards)
        super().__init__(config)
        self.num_shards = num_shards

    def forward(self, x):
        return _sharded(self, super().forward, x)


class LigerBlockSparseTop2MLP(nn.Module):
    """liger_kernel.transformers.LigerBlockSparseTop2MLP(config): an expert in Mixtral's older w1 (gate), w3 (up),
    w2 (down) layout: w2(silu(w1(x)) * w3(x)) with tigon.ops.swiglu."""

    def __init__(self, config):
        super().__init__()
        _check_act("LigerBlockSparseTop2MLP", config)
        self.ffn_dim, self.hidden_dim = config.intermediate_size, config.hidden_size
        self.w1 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)
        self.w2 = nn.Linear(self.ffn_dim, self.hidden_dim, bias=False)
        self.w3 = nn.Linear(self.hidden_dim, self.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(ops.swiglu(self.w1(x), self.w3(x), inplace_backward=True))


def _check_loss_args(cls, label_smoothing, reduction, softcap):
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{cls}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{cls}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{cls}: softcap must be None or > 0, got {softcap!r}")


class LigerCrossEntropyLoss(CrossEntropyLoss):
    """liger_kernel.transformers.LigerCrossEntropyLoss on tigon.ops.cross_entropy: forward(_input [N, V],
    target [N]) -> loss; lse_square_scale is Tigon's z_loss_scale. The return_* flags give a CrossEntropyOutput
    and class weights take Liger's formula (tigon.compat.liger_ce_options)."""

    def __init__(self, weight: Optional[torch.FloatTensor] = None, ignore_index: int = -100,
                 lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: Optional[float] = None, return_z_loss: bool = False, return_token_accuracy: bool = False,
                 return_predicted_tokens: bool = False):
        _check_loss_args("LigerCrossEntropyLoss", label_smoothing, reduction, softcap)
        super().__init__(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         z_loss_scale=lse_square_scale, softcap=softcap)
        self.weight, self.lse_square_scale, self.return_z_loss = weight, lse_square_scale, return_z_loss
        self.return_token_accuracy, self.return_predicted_tokens = return_token_accuracy, return_predicted_tokens

    def forward(self, _input: torch.Tensor, target: torch.Tensor):
        if self.weight is None and not (self.return_z_loss or self.return_token_accuracy or
                                        self.return_predicted_tokens):
            return super().forward(_input, target)
        return liger_cross_entropy_with_options(
            _input, None, None, target, class_weight=self.weight, ignore_index=self.ignore_index,
            lse_square_scale=self.lse_square_scale, label_smoothing=self.label_smoothing, reduction=self.reduction,
            softcap=self.softcap, return_z_loss=self.return_z_loss, return_token_accuracy=self.return_token_accuracy,
            return_predicted_tokens=self.return_predicted_tokens)


class LigerFusedLinearCrossEntropyLoss(LinearCrossEntropyLoss):
    """liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss on tigon.ops.linear_cross_entropy:
    forward(lin_weight [V, H], _input [N, H], target [N], bias=None) -> loss, without the [N, V] logits. Every
    Liger option works (tigon.compat.liger_ce_options): the return_* flags give a CrossEntropyOutput and cost one
    more no-grad logits pass; ce_weight forms the logits."""

    def __init__(self, ce_weight: Optional[torch.FloatTensor] = None, ignore_index: int = -100,
                 lse_square_scale: float = 0.0, label_smoothing: float = 0.0, reduction: str = "mean",
                 softcap: Optional[float] = None, return_z_loss: bool = False,
                 accum_dtype: Optional[torch.dtype] = None, use_token_scaling: bool = False,
                 return_token_accuracy: bool = False, return_predicted_tokens: bool = False):
        _check_loss_args("LigerFusedLinearCrossEntropyLoss", label_smoothing, reduction, softcap)
        super().__init__(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         z_loss_scale=lse_square_scale, softcap=softcap, accum_dtype=accum_dtype)
        self.ce_weight, self.lse_square_scale, self.return_z_loss = ce_weight, lse_square_scale, return_z_loss
        self.use_token_scaling = use_token_scaling
        self.return_token_accuracy, self.return_predicted_tokens = return_token_accuracy, return_predicted_tokens

    def forward(self, lin_weight, _input, target, bias=None):
        if self.ce_weight is None and not (self.return_z_loss or self.use_token_scaling or
                                           self.return_token_accuracy or self.return_predicted_tokens):
            return super().forward(_input, lin_weight, target, bias)
        return liger_cross_entropy_with_options(
            _input, lin_weight, bias, target, class_weight=self.ce_weight, ignore_index=self.ignore_index,
            lse_square_scale=self.lse_square_scale, label_smoothing=self.label_smoothing, reduction=self.reduction,
            softcap=self.softcap, return_z_loss=self.return_z_loss, use_token_scaling=self.use_token_scaling,
            return_token_accuracy=self.return_token_accuracy, return_predicted_tokens=self.return_predicted_tokens,
            accum_dtype=self.accum_dtype)


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """liger_kernel.transformers.liger_rotary_pos_emb on tigon.ops.apply_rope (rotate-half). rotary_dim: the
    leading dims of each head that rotate; cos/sin of width rotary_dim / 2 (GPT-OSS's) are used for both
    halves. position_ids is accepted and unused, as in transformers (cos and sin are already per position)."""
    if rotary_dim is not None and cos.shape[-1] * 2 == rotary_dim:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    elif rotary_dim is not None and cos.shape[-1] != rotary_dim:
        raise ValueError(f"liger_rotary_pos_emb: cos/sin width {cos.shape[-1]} is neither rotary_dim={rotary_dim} "
                         "nor half of it")
    return ops.apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


__all__ = ["CrossEntropyOutput", "LigerBlockSparseTop2MLP", "LigerCrossEntropyLoss", "LigerFusedAddRMSNorm",
           "LigerFusedLinearCrossEntropyLoss", "LigerGEGLUMLP", "LigerLayerNorm", "LigerPhi3SwiGLUMLP",
           "LigerQwen3MoeSwiGLUMLP", "LigerRMSNorm", "LigerSwiGLUMLP", "LigerTiledGEGLUMLP", "LigerTiledSwiGLUMLP",
           "liger_rotary_pos_emb"]
