"""Pure-PyTorch reference of every op: the spec, the CPU fallback and the "eager" baseline.

Math is fp32 (or the input's precision when it is fp64), with one cast to the output dtype at the end,
except where the op's definition rounds in between (RMSNorm "llama" mode rounds the normalized value to
the input dtype before the weight, as transformers' LlamaRMSNorm does). Imports torch only.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F

CASTING_MODES = ("llama", "gemma", "none")


def _f(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def rms_norm_out_dtype(x_dtype, w_dtype, casting_mode):
    if casting_mode == "llama" and w_dtype is not None:
        return torch.promote_types(x_dtype, w_dtype)
    return x_dtype


def rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    xf = _f(x)
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = _f(weight) + offset if weight is not None else None
    out_dtype = rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype, casting_mode)
    if casting_mode == "llama":
        n = n.to(x.dtype).to(n.dtype)
    y = n if w is None else n * w
    return y.to(out_dtype)


def add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    """Returns (rms_norm(x + residual), x + residual); the sum is rounded to x.dtype, as in HF decoders."""
    s = (_f(x) + _f(residual)).to(x.dtype)
    return rms_norm(s, weight, eps, offset=offset, casting_mode=casting_mode), s


def layer_norm(x, weight, bias, eps=1e-5):
    xf = _f(x)
    w = None if weight is None else _f(weight)
    b = None if bias is None else _f(bias)
    return F.layer_norm(xf, (x.shape[-1],), w, b, eps).to(x.dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_one(x, cos, sin):
    rd = cos.shape[-1]
    xf = _f(x)
    x_rot, x_pass = xf[..., :rd], xf[..., rd:]
    out = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((out, x_pass), dim=-1).to(x.dtype)


def apply_rope(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb in fp32; cos/sin may cover only the first rotary_dim of D."""
    cos = _f(cos).unsqueeze(unsqueeze_dim)
    sin = _f(sin).unsqueeze(unsqueeze_dim)
    return _rope_one(q, cos, sin), _rope_one(k, cos, sin)


def swiglu(gate, up):
    return (F.silu(_f(gate)) * _f(up)).to(gate.dtype)


def geglu(gate, up):
    return (F.gelu(_f(gate), approximate="tanh") * _f(up)).to(gate.dtype)


def _glu_mlp(glu, x, gate_weight, up_weight, down_weight):
    gate_up = x @ gate_weight.t()
    gate, up = (gate_up, x @ up_weight.t()) if up_weight is not None else gate_up.chunk(2, dim=-1)
    return glu(gate, up) @ down_weight.t()


def swiglu_mlp(x, gate_weight, up_weight, down_weight):
    """(silu(x W_g^T) * (x W_u^T)) W_d^T; up_weight None: gate_weight is packed [2I, H] = [gate; up]."""
    return _glu_mlp(swiglu, x, gate_weight, up_weight, down_weight)


def geglu_mlp(x, gate_weight, up_weight, down_weight):
    return _glu_mlp(geglu, x, gate_weight, up_weight, down_weight)


def cross_entropy(
    logits,
    target,
    *,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss_scale=0.0,
    softcap: Optional[float] = None,
    num_items_in_batch=None,
):
    """F.cross_entropy on fp32 logits, plus z-loss (z * lse^2 per token) and optional tanh softcap.

    reduction "mean" divides by the number of non-ignored tokens (NaN when there are none, like
    F.cross_entropy); with `num_items_in_batch` the loss is sum / num_items_in_batch instead.
    """
    V = logits.shape[-1]
    x = _f(logits).reshape(-1, V)
    t = target.reshape(-1)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    valid = t != ignore_index
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    # Ignored rows take no part, as in the kernel (which never reads them): NaN or inf padding there gives a
    # zero gradient, where F.cross_entropy's would be NaN (0 * NaN in the softmax backward).
    x = torch.where(valid[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    # lse shifted by the row max, as F.cross_entropy and the kernel compute it: a +inf logit gives NaN (inf -
    # inf) there, where torch.logsumexp would special-case it to inf. The max is a constant for autograd.
    m = x.detach().amax(dim=-1, keepdim=True)
    lse = (m + (x - m).exp().sum(dim=-1, keepdim=True).log()).squeeze(-1)
    loss = lse - x.gather(1, t_safe[:, None]).squeeze(1)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - x.mean(dim=-1))
    if z_loss_scale:
        loss = loss + z_loss_scale * lse.pow(2)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if num_items_in_batch is not None:
        return loss.sum() / num_items_in_batch
    if reduction == "mean":
        return loss.sum() / valid.sum()
    if reduction == "sum":
        return loss.sum()
    return loss.reshape(target.shape)


def linear_cross_entropy(hidden, weight, target, bias=None, **ce_kwargs):
    """cross_entropy(hidden @ weight.T + bias, target): builds the full logits (that is the point of the spec)."""
    h = _f(hidden).reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # -1 is ambiguous when H = 0
    logits = h @ _f(weight).t()
    if bias is not None:
        logits = logits + _f(bias)
    loss = cross_entropy(logits, target.reshape(-1), **ce_kwargs)
    return loss.reshape(target.shape) if loss.dim() else loss


# The formulas as Hugging Face models write them, run in the input dtype: the "torch in dtype" side of
# the tests' error bound and the "eager" provider of the benchmarks.


def eager_rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    if casting_mode == "llama":  # LlamaRMSNorm
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        w = weight if not offset else offset + weight
        return w * h.to(x.dtype)
    if casting_mode == "gemma":  # GemmaRMSNorm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (offset + weight.float())).type_as(x)
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (offset + weight)


def eager_add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting_mode="llama"):
    s = x + residual
    return eager_rms_norm(s, weight, eps, offset=offset, casting_mode=casting_mode), s


def eager_layer_norm(x, weight, bias, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def eager_apply_rope(q, k, cos, sin, unsqueeze_dim=1):  # transformers' apply_rotary_pos_emb
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_swiglu(gate, up):
    return F.silu(gate) * up


def eager_geglu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def eager_cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """What HF's loss does: upcast the logits to fp32, then F.cross_entropy."""
    V = logits.shape[-1]
    return F.cross_entropy(
        logits.float().reshape(-1, V), target.reshape(-1), ignore_index=ignore_index,
        reduction=reduction, label_smoothing=label_smoothing,
    )
