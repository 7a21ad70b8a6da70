"""QuantizedWeight: one [N, K] linear weight stored in 4 or 8 bits, in the one layout Tigon's quantized kernels read.

Every checkpoint format (GPTQ, AWQ, compressed-tensors, bitsandbytes NF4 / FP4, FP8 releases, torchao) is repacked once
into this layout (`tigon.quant`); the kernels (`tigon.ops.quant_linear`) and the reference below read nothing else.

Layouts (row n of the weight is output feature n; K is the reduction dimension):
- "int4": `data` uint8 [N, K // 2], element k of row n in byte k // 2, the low nibble for even k. Value
  w[n, k] = (q - z) * s with s = scales[n, g], z = zeros[n, g] (float), or z = 8 when `zeros` is None (symmetric),
  g = k // group_size.
- "nf4": the same packing; w[n, k] = NF4[q] * scales[n, g] (NF4 is bitsandbytes' 16-value table below).
- "fp4": the same packing; w[n, k] = FP4[q] * scales[n, g] (FP4 is bitsandbytes' 4-bit float table below).
- "fp8": `data` float8_e4m3fn [N, K]; w[n, k] = data[n, k] * s, with s = scales[n] (per channel, group_size 0)
  or scales[n // B, k // B] (square blocks of B = group_size, the last block of a dimension may be partial).
- `perm` (int4/nf4/fp4, optional): int64 [K]; stored column j holds original column perm[j], so
  y[m, n] = sum_j x[m, perm[j]] * w_stored[n, j] (GPTQ act-order, whose groups follow g_idx, stored sorted).
- `dtype`: the activations' dtype, which the output takes.
"""

from dataclasses import dataclass

import torch

KINDS = ("int4", "nf4", "fp8", "fp4")
# bitsandbytes' NormalFloat4 code book: quantiles of N(0, 1) scaled to [-1, 1], index = the 4-bit code.
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
# bitsandbytes' FP4 code book (get_4bit_type("fp4")): 1 sign bit (the high one), 2 exponent and 1 mantissa bits, the
# magnitudes 0, 0.0625, 8, 12, 4, 6, 2, 3 by code over 12 (their largest), in fp32; index = the 4-bit code. Code 8
# ("-0") is +0, as in bitsandbytes' table.
FP4 = (0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
       0.0, -0.0052083334885537624, -0.6666666865348816, -1.0, -0.3333333432674408, -0.5, -0.1666666716337204, -0.25)
# The kinds whose codes index a table (w = TABLES[kind][q] * s): one code path of the kernels, a table each.
TABLES = {"nf4": NF4, "fp4": FP4}


@dataclass(frozen=True)
class QuantizedWeight:
    kind: str
    data: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    shape: tuple[int, int]
    dtype: torch.dtype
    perm: torch.Tensor | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"QuantizedWeight: kind must be one of {KINDS}, got {self.kind!r}")
        n, k = self.shape
        if self.kind == "fp8":
            if self.data.dtype != torch.float8_e4m3fn or tuple(self.data.shape) != (n, k):
                raise ValueError(f"QuantizedWeight: fp8 data must be float8_e4m3fn [{n}, {k}], got "
                                 f"{self.data.dtype} {list(self.data.shape)}")
            want = (n,) if self.group_size == 0 else (-(-n // self.group_size), -(-k // self.group_size))
            if tuple(self.scales.shape) != want:
                raise ValueError(f"QuantizedWeight: fp8 scales must be {list(want)} for group_size "
                                 f"{self.group_size}, got {list(self.scales.shape)}")
            return
        if k % 2 or self.group_size <= 0 or k % self.group_size:
            raise ValueError(f"QuantizedWeight: K={k} must be even and a multiple of group_size "
                             f"({self.group_size})")
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (n, k // 2):
            raise ValueError(f"QuantizedWeight: {self.kind} data must be uint8 [{n}, {k // 2}], got "
                             f"{self.data.dtype} {list(self.data.shape)}")
        groups = (n, k // self.group_size)
        if tuple(self.scales.shape) != groups:
            raise ValueError(f"QuantizedWeight: scales must be {list(groups)}, got {list(self.scales.shape)}")
        if self.zeros is not None and (self.kind != "int4" or tuple(self.zeros.shape) != groups):
            raise ValueError(f"QuantizedWeight: zeros must be None or {list(groups)} for int4 (none for nf4 and fp4)")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"QuantizedWeight: perm must be [{k}], got {list(self.perm.shape)}")

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for the whole weight (data, scales, zeros, perm)."""
        parts = (self.data, self.scales, self.zeros, self.perm)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] int codes 0..15 (int16), low nibble first."""
    d = data.to(torch.int16)
    return torch.stack((d & 0xF, d >> 4), dim=-1).reshape(data.shape[0], -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K // 2] uint8, low nibble first (the inverse of unpack_int4)."""
    c = codes.to(torch.int16).reshape(codes.shape[0], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The stored [N, K] weight in fp32 (columns in stored order: apply `perm` to x, not here)."""
    n, k = qw.shape
    if qw.kind == "fp8":
        w = qw.data.float()
        if qw.group_size == 0:
            return w * qw.scales.float()[:, None]
        b = qw.group_size
        s = qw.scales.float().repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
        return w * s
    codes = unpack_int4(qw.data)
    s = qw.scales.float().repeat_interleave(qw.group_size, 1)
    if qw.kind in TABLES:
        return torch.tensor(TABLES[qw.kind], device=codes.device)[codes.long()] * s
    z = 8.0 if qw.zeros is None else qw.zeros.float().repeat_interleave(qw.group_size, 1)
    return (codes.float() - z) * s


def linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(qw).T in fp32 (fp64 for fp64 x), cast to qw.dtype: the spec of the kernels."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xs = x.to(acc)
    if qw.perm is not None:
        xs = xs[..., qw.perm]
    y = xs @ dequantize(qw).to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(qw.dtype)
