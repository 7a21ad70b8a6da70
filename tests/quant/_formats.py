"""Synthetic quantized modules laid out per each format's documented packing, from known codes and scales.

Each builder returns (module, w): a stand-in for the quantizer package's module (the attributes and buffers its
loader gives it) and the exact fp32 weight [N, K] those tensors encode. The stand-ins' forward is x @ w.T + bias,
the module's own forward as its package defines it (dequantize, then multiply).
"""

import types

import torch
from torch import nn

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]


def pack(codes: torch.Tensor, dim: int, dtype=torch.int32) -> torch.Tensor:
    """Non-negative 4-bit codes -> words of `dtype` along `dim`, code i of a word at bits 4 * i (zero padded)."""
    bits = torch.iinfo(dtype).bits
    per = bits // 4
    c = codes.to(torch.int64).movedim(dim, -1)
    pad = -c.shape[-1] % per
    c = torch.nn.functional.pad(c, (0, pad)).reshape(*c.shape[:-1], -1, per)
    words = (c << (4 * torch.arange(per))).sum(-1)
    words = torch.where(words >= 2 ** (bits - 1), words - 2**bits, words).to(dtype)
    return words.movedim(-1, dim)


class _Stand(nn.Module):
    def forward(self, x):
        y = x @ self.known.to(x.dtype).T
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _finish(self, w, n, k, bias):
        object.__setattr__(self, "known", w)  # not a buffer: not in state_dict
        self.in_features, self.out_features = k, n
        self.register_buffer("bias", bias)


class TorchQuantLinear(_Stand):
    """GPTQModel's torch kernel: v2 zeros unless told otherwise."""

    QUANT_TYPE = "torch"

    def qzero_format(self):
        return self.fmt


def _groups(k, group_size, act_order, gen):
    if not act_order:
        return torch.arange(k) // group_size
    return torch.argsort(torch.randperm(k, generator=gen)) // group_size  # each group: group_size columns


def gptq(n, k, group_size, *, fmt=2, act_order=False, symmetric=False, pack_dtype=torch.int32, seed=0, cls=None,
         bias=True):
    gen = torch.Generator().manual_seed(seed)
    g_idx = _groups(k, group_size, act_order, gen)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.full((k // group_size, n), 8) if symmetric else torch.randint(1, 16, (k // group_size, n), generator=gen)
    s = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.005).half()
    w = ((q - z[g_idx]).float() * s.float()[g_idx]).T.contiguous()
    m = (cls or TorchQuantLinear)()
    m.bits, m.group_size, m.fmt = 4, group_size, fmt
    m.register_buffer("qweight", pack(q, 0, pack_dtype))
    m.register_buffer("qzeros", pack(z - 1 if fmt == 1 else z, 1, pack_dtype))
    m.register_buffer("scales", s)
    m.register_buffer("g_idx", g_idx.to(torch.int32))
    m._finish(w, n, k, torch.randn(n, generator=gen).half() if bias else None)
    return m, w


class WQLinear_GEMM(_Stand):  # noqa: N801 (AutoAWQ's class name, which the importer recognizes)
    pass


def awq(n, k, group_size, *, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group_size, n), generator=gen)
    s = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.005).half()
    g = torch.arange(k) // group_size
    w = ((q - z[g]).float() * s.float()[g]).T.contiguous()
    order = list(AWQ_ORDER)

    def interleave(c):
        return c.reshape(c.shape[0], -1, 8)[..., order].reshape(c.shape[0], -1)

    m = WQLinear_GEMM()
    m.w_bit, m.group_size = 4, group_size
    m.register_buffer("qweight", pack(interleave(q), 1))
    m.register_buffer("qzeros", pack(interleave(z), 1))
    m.register_buffer("scales", s)
    m._finish(w, n, k, None)
    return m, w


def compressed_int4(n, k, group_size, *, symmetric=True, packed_zp=True, act_order=False, seed=0):
    """compressed-tensors pack-quantized: signed codes + 8 packed along K, zero points signed or packed along N."""
    gen = torch.Generator().manual_seed(seed)
    g_idx = _groups(k, group_size, act_order, gen)
    q = torch.randint(-8, 8, (n, k), generator=gen)
    zp = torch.zeros(n, k // group_size, dtype=torch.int64) if symmetric else \
        torch.randint(-8, 8, (n, k // group_size), generator=gen)
    s = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.005).bfloat16()
    w = (q - zp[:, g_idx]).float() * s.float()[:, g_idx]
    m = _Stand()
    m.register_parameter("weight_packed", nn.Parameter(pack(q + 8, 1), requires_grad=False))
    m.register_parameter("weight_scale", nn.Parameter(s, requires_grad=False))
    m.register_buffer("weight_shape", torch.tensor([n, k]))
    if not symmetric:
        zp_t = pack(zp + 8, 0) if packed_zp else zp.to(torch.int8)
        m.register_parameter("weight_zero_point", nn.Parameter(zp_t, requires_grad=False))
    if act_order:
        m.register_parameter("weight_g_idx", nn.Parameter(g_idx.to(torch.int32), requires_grad=False))
    weights = types.SimpleNamespace(num_bits=4, type="int", symmetric=symmetric, group_size=group_size)
    m.quantization_scheme = types.SimpleNamespace(weights=weights)
    m._finish(w, n, k, None)
    return m, w


class FP8Linear(_Stand):
    """transformers' finegrained FP8Linear: weight_scale_inv multiplies, blocks of block_size."""


def fp8(n, k, *, block=(128, 128), scale_name="weight_scale_inv", scale_shape=None, scale_dtype=torch.float32,
        seed=0, cls=FP8Linear):
    gen = torch.Generator().manual_seed(seed)
    data = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scale_shape is None:
        scale_shape = (-(-n // block[0]), -(-k // block[1])) if block is not None else ()
    s = (torch.rand(scale_shape, generator=gen) * 0.01 + 0.001).to(scale_dtype)
    sf = s.float()
    if sf.dim() == 2 and block is not None and sf.shape != (n, 1):
        full = sf.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    else:
        full = sf.reshape(-1, 1) if sf.numel() > 1 else sf
    w = data.float() * full
    m = cls()
    m.block_size = block
    m.register_parameter("weight", nn.Parameter(data, requires_grad=False))
    m.register_parameter(scale_name, nn.Parameter(s, requires_grad=False))
    m._finish(w, n, k, None)
    return m, w
