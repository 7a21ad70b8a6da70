"""QuantLinear: an nn.Linear whose weight is a QuantizedWeight, and round-to-nearest quantization into that layout.

The module holds the layout's tensors as buffers (`data`, `scales`, `zeros`, `perm`, `bias`), so `state_dict`,
`load_state_dict` and device moves work as for any module. A dtype change (`model.to(torch.bfloat16)`, `.half()`)
changes the activation dtype the module reports (`dtype`) and casts the bias, but never the packed data or the
scales: an fp8 weight or an fp16 scale cast to bf16 would no longer be the checkpoint's values. fp8 data is kept as
a uint8 view of the same bytes for the same reason (float8 counts as floating point to `nn.Module.to`).

`quantize_rtn` is the round-to-nearest quantizer behind `QuantLinear.from_linear` and `tigon.quant.quantize`:
- int4, symmetric: one scale a group, s = max(max(w) / 7, -min(w) / 8), code = round(w / s) + 8 (zero 8).
- int4, asymmetric: s = (max(w, 0) - min(w, 0)) / 14 and an integer zero z = ceil(-min / s), so the whole group
  range lies inside the 16 codes with an integer zero (exact in any scale dtype); code = round(w / s) + z.
- nf4: s = max|w| of the group, code = the nearest entry of the NF4 table to w / s.
- fp8 (e4m3): s = max|w| / 448 per output channel (group_size 0) or per square block of group_size.
Scales are rounded up to their storage dtype, so no element is clamped: every element is within half a step of its
code (int4: s / 2; nf4: s times half the widest gap of the table; fp8: half an e4m3 ulp of w / s, times s).
"""

import math

import torch
from torch import nn

from tigon.ops.quant_linear import quant_linear
from tigon.ops.quantized_weight import NF4, QuantizedWeight, pack_int4

_RTN_KINDS = ("int4", "nf4", "fp8")  # the kinds quantize_rtn writes (fp4 weights come from bitsandbytes checkpoints)
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def _round_up(s: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """fp32 scales `s` stored in `dtype`, each rounded up (never below s), so w / stored_s stays in range."""
    if dtype == torch.float32:
        return s
    r = s.to(dtype)
    r = torch.where(r.float() < s, torch.nextafter(r, torch.full_like(r, math.inf)), r)
    if not torch.isfinite(r).all():
        raise ValueError(f"{where}: a group's scale overflows {dtype}; pass dtype=torch.float32")
    return r


def _check_rtn(where, weight, kind, group_size, symmetric, dtype):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise TypeError(f"{where}: weight must be a floating-point [N, K] tensor, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)} {list(getattr(weight, 'shape', []))}")
    if kind not in _RTN_KINDS:
        raise ValueError(f"{where}: kind must be one of {_RTN_KINDS}, got {kind!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"{where}: group_size must be an int, got {type(group_size).__name__}")
    if not isinstance(symmetric, bool):
        raise TypeError(f"{where}: symmetric must be a bool, got {type(symmetric).__name__}")
    if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{where}: dtype must be torch.float32, float16 or bfloat16, got {dtype}")
    k = weight.shape[1]
    if kind == "fp8":
        if group_size < 0:
            raise ValueError(f"{where}: group_size must be 0 (per channel) or a block size > 0 for fp8, "
                             f"got {group_size}")
        if not symmetric:
            raise ValueError(f"{where}: fp8 is symmetric only; pass symmetric=True")
    elif group_size <= 0 or group_size % 2 or k % group_size:
        raise ValueError(f"{where}: group_size must be even, > 0 and divide in_features ({k}) for {kind} (a byte's "
                         f"two codes share a group); got group_size={group_size}")
    elif kind == "nf4" and not symmetric:
        raise ValueError(f"{where}: nf4 is symmetric only (an absmax scale a group); pass symmetric=True")


def quantize_rtn(weight: torch.Tensor, kind: str, group_size: int = 128, *, symmetric: bool = True,
                 dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a [N, K] weight into the QuantizedWeight layout (the module docstring gives
    the rule per kind). `dtype`: the activations' dtype and, for int4/nf4, the scales' (default: the weight's,
    fp32 for other dtypes); fp8 scales are always fp32. fp8 `group_size`: 0 per channel, B for B x B blocks."""
    where = "tigon.quant.quantize_rtn"
    _check_rtn(where, weight, kind, group_size, symmetric, dtype)
    if dtype is None:
        dtype = weight.dtype if weight.dtype in (torch.float16, torch.bfloat16) else torch.float32
    n, k = weight.shape
    w = weight.detach().float()
    if kind == "fp8":
        return _fp8_rtn(w, group_size, dtype)
    wg = w.reshape(n, k // group_size, group_size)
    zeros = None
    if kind == "nf4":
        s = _round_up(torch.where(wg.abs().amax(-1) > 0, wg.abs().amax(-1), 1.0), dtype, where)
        table = torch.tensor(NF4, device=w.device)
        codes = torch.bucketize((wg / s.float()[..., None]).clamp(-1, 1), (table[1:] + table[:-1]) / 2)
    else:
        hi, lo = wg.amax(-1).clamp(min=0), wg.amin(-1).clamp(max=0)
        if symmetric:
            s = _round_up(torch.where(hi - lo > 0, torch.maximum(hi / 7, -lo / 8), 1.0), dtype, where)
            z = torch.full_like(s.float(), 8.0)
        else:
            s = _round_up(torch.where(hi - lo > 0, (hi - lo) / 14, 1.0), dtype, where)
            z = torch.ceil(-lo / s.float())
            zeros = z.to(dtype)
        codes = (torch.round(wg / s.float()[..., None]) + z[..., None]).clamp(0, 15)
    return QuantizedWeight(kind, pack_int4(codes.reshape(n, k)), s, zeros, group_size, (n, k), dtype)


def _fp8_rtn(w: torch.Tensor, block: int, dtype: torch.dtype) -> QuantizedWeight:
    n, k = w.shape
    if block == 0:
        amax = w.abs().amax(1)
        s = torch.where(amax > 0, amax / _FP8_MAX, 1.0)
        full = s[:, None]
    else:
        nb, kb = -(-n // block), -(-k // block)
        padded = torch.zeros(nb * block, kb * block, device=w.device)
        padded[:n, :k] = w.abs()
        amax = padded.reshape(nb, block, kb, block).amax((1, 3))
        s = torch.where(amax > 0, amax / _FP8_MAX, 1.0)
        full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    data = (w / full).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", data, s, None, block, (n, k), dtype)


class QuantLinear(nn.Module):
    """y = x @ W.T + bias with W stored as a QuantizedWeight (int4, nf4, fp4 or fp8); forward is
    `tigon.ops.quant_linear.quant_linear`. The output takes x's dtype, as nn.Linear's does; `dtype` is the
    activation dtype the weight was made for (what `quantized_weight` reports to callers without an input).

    `original`: the module this one replaced when `tigon.quant.adopt` built it (kept outside the module tree, so it
    is not in `state_dict` or `parameters()`, and `tigon.quant.release` puts it back as it was), else None.
    `layer_name`: the module's name in the model that `adopt` / `tigon.quantize` swapped it into (for errors).

    Training: quant_linear has no backward. Where a gradient may be wanted (grad mode on, and the module in
    training mode or x requiring grad) an adopted QuantLinear runs `original`'s forward, so a patched model
    trains exactly as the checkpoint's modules do (QLoRA over bitsandbytes); one without `original` raises a
    RuntimeError naming the layer when x requires grad."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"tigon.quant.QuantLinear: qw must be a QuantizedWeight, got {type(qw).__name__}")
        n, k = qw.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
            raise ValueError(f"tigon.quant.QuantLinear: bias must be None or a tensor of shape ({n},), got "
                             f"{list(getattr(bias, 'shape', [])) or type(bias).__name__}")
        self.kind, self.group_size, self.dtype = qw.kind, qw.group_size, qw.dtype
        self.out_features, self.in_features = n, k
        data = qw.data.view(torch.uint8) if qw.kind == "fp8" else qw.data
        self.register_buffer("data", data)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)
        self.register_buffer("perm", qw.perm)
        self.register_buffer("bias", None if bias is None else bias.detach().to(qw.dtype))
        object.__setattr__(self, "original", None)
        self.layer_name = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str = "int4", group_size: int = 128, *, symmetric: bool = True,
                    dtype: torch.dtype | None = None) -> "QuantLinear":
        """A QuantLinear holding `linear`'s weight quantized round-to-nearest (`quantize_rtn`) and its bias."""
        if not isinstance(linear, nn.Linear) or not isinstance(linear.weight, torch.Tensor) or \
                not linear.weight.is_floating_point():
            raise TypeError(f"tigon.quant.QuantLinear.from_linear: linear must be an nn.Linear with a floating-point "
                            f"weight, got {type(linear).__name__}")
        qw = quantize_rtn(linear.weight, kind, group_size, symmetric=symmetric,
                          dtype=dtype if dtype is not None else linear.weight.dtype)
        return cls(qw, None if linear.bias is None else linear.bias.detach().clone())

    @property
    def quantized_weight(self) -> QuantizedWeight:
        """The layout's view of the buffers (no copy), for the kernels and `dequantize`."""
        data = self.data.view(torch.float8_e4m3fn) if self.kind == "fp8" else self.data
        return QuantizedWeight(self.kind, data, self.scales, self.zeros, self.group_size,
                               (self.out_features, self.in_features), self.dtype, self.perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """quant_linear of x; where a gradient may be wanted, `original`'s forward (class docstring)."""
        if torch.is_grad_enabled() and (self.training or x.requires_grad):
            if self.original is not None:
                return self.original(x)
            if x.requires_grad:
                raise RuntimeError(
                    f"tigon.quant.QuantLinear {self.layer_name or ''}({self.extra_repr()}): x requires grad, but "
                    "a quantized weight has no backward and this layer holds no original module to train "
                    "through; run it under torch.no_grad(), or keep the layer in full precision "
                    "(tigon.quantize(..., skip=(name,)))")
        data = self.data.view(torch.float8_e4m3fn) if self.kind == "fp8" else self.data
        qw = QuantizedWeight(self.kind, data, self.scales, self.zeros, self.group_size,
                             (self.out_features, self.in_features), x.dtype, self.perm)
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return quant_linear(x, qw, bias=bias)

    def _apply(self, fn, recurse=True):
        # Moves follow `fn`; a dtype change retypes the activations and the bias only (module docstring).
        target = fn(torch.zeros(0, dtype=self.dtype, device=self.data.device))
        for name, t in self._buffers.items():
            if t is not None:
                self._buffers[name] = fn(t) if name == "bias" else t.to(target.device)
        if target.is_floating_point():
            self.dtype = target.dtype
        return self

    def extra_repr(self) -> str:
        sym = "" if self.kind != "int4" else f", symmetric={self.zeros is None}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"group_size={self.group_size}{sym}, act_order={self.perm is not None}, bias={self.bias is not None}")
