"""quant_linear: x @ W^T for a 4- or 8-bit weight (`QuantizedWeight`), with bias, GLU and residual epilogues.

Every output is checked against the exact product of x with `dequantize(qw)` (fp64), within the error model of the
kernels (`_tol`), per element:
- the fp32 sums over K: u32 * (sum_ulps(K) + 4) * sum_k |x_k| m_k, where m_k = (|q_k| + |z|) |s| for int4 (the GEMV
  sums raw codes and subtracts z * sum(x) once a chunk) and |w_k| otherwise;
- the tensor-core kernel (more rows than `gemv_max_rows`) rounds each dequantized tile to x's dtype:
  2 u(dtype) * sum_k |x_k w_k| more; the prefill path (`dequant_min_rows`) rounds W to x's dtype the same way, and
  for fp8 with one scale a row its GEMM output before the scale, within the same term;
- each rounding to the dtype (the output; with a GLU the two halves and the product; with a residual the product
  and the sum): 2 u(dtype) of the value (a whole ulp: Triton's interpreter truncates), carried through the GLU by
  its slope (|silu'|, |gelu_tanh'| < 1.13) plus GLU_ULPS u32 |gate up| for its fp32 math.
`test_fp32_model_rejects_a_wrong_output` is the model's negative control. The conftest's NaN-poisoned allocations
make any output element left unwritten fail the finiteness check.
"""

import dataclasses
import importlib
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests._grid import U32, UNIT_ROUNDOFF, assert_tol, sum_ulps
from tigon import ops
from tigon.ops import _library
from tigon.ops.quant_linear import QuantLinearConfig, quant_linear, quant_linear_reference
from tigon.ops.quantized_weight import KINDS, TABLES, QuantizedWeight, dequantize, pack_int4, unpack_int4

ql = importlib.import_module("tigon.ops.quant_linear")  # the module: tigon.ops.quant_linear is the function

GLU_ULPS = 8.0
GLU_SLOPE = 1.13  # max |d act / d gate| of silu (1.0998) and gelu_tanh (1.1289)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (kind, group_size, zeros, perm, N, K): every kind, groups 32 / 64 / 128, odd N; fp8 blocks partial in N and K
CASES = {
    "int4-g32": ("int4", 32, False, False, 40, 256),
    "int4-zeros-g64": ("int4", 64, True, False, 38, 256),
    "int4-perm-g128": ("int4", 128, True, True, 40, 256),
    "int4-zeros-g12": ("int4", 12, True, False, 20, 96),  # 4-column chunks: the codes read as bytes, not words
    "nf4-g32": ("nf4", 32, False, False, 24, 192),
    "nf4-g128": ("nf4", 128, False, True, 40, 256),
    "fp4-g64": ("fp4", 64, False, False, 23, 320),  # nf4's table path with bitsandbytes' FP4 table
    "fp4-g32-perm": ("fp4", 32, False, True, 30, 160),
    "fp8-channel": ("fp8", 0, False, False, 37, 200),
    "fp8-block128": ("fp8", 128, False, False, 40, 200),
    "fp8-block32": ("fp8", 32, False, False, 40, 96),
    "fp8-block48": ("fp8", 48, False, False, 50, 120),  # 16-column chunks: scaled before the dot
}


def _weight(kind, G, zeros, perm, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":
        data = (torch.randn(N, K, generator=g) * 3).to(torch.float8_e4m3fn)
        shape = (N,) if G == 0 else (-(-N // G), -(-K // G))
        return QuantizedWeight("fp8", data, (torch.rand(shape, generator=g) * 0.2 + 0.05).to(dtype), None, G, (N, K),
                               dtype)
    codes = torch.randint(0, 16, (N, K), generator=g)
    scales = ((torch.rand(N, K // G, generator=g) + 0.5) * 0.05).to(dtype)
    z = (torch.rand(N, K // G, generator=g) * 15).to(dtype) if zeros else None  # float zero points, as the spec
    p = torch.randperm(K, generator=g) if perm else None
    return QuantizedWeight(kind, pack_int4(codes), scales, z, G, (N, K), dtype, p)


def _on(qw, device):
    move = {f: getattr(qw, f).to(device) for f in ("data", "scales", "zeros", "perm") if getattr(qw, f) is not None}
    return dataclasses.replace(qw, **move)


def _magnitudes(qw):
    """(W, m): the exact weight and the per-element magnitude the kernels' fp32 sums are bounded by (fp64)."""
    w = dequantize(qw).double()
    if qw.kind != "int4":
        return w, w.abs()
    G = qw.group_size
    s = qw.scales.double().repeat_interleave(G, 1).abs()
    z = 8.0 if qw.zeros is None else qw.zeros.double().repeat_interleave(G, 1).abs()
    return w, (unpack_int4(qw.data).double() + z + 32) * s  # the GEMV sums 1 + q / 16 and x apart: 16 + q, 16 + z


def _act64(g, activation):
    return F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")


def _exact_and_tol(x, qw, *, bias=None, residual=None, activation=None, dot=False):
    dt = x.dtype
    r = 2 * UNIT_ROUNDOFF[dt]  # one rounding to the dtype (a whole ulp)
    xs = x.double()
    if qw.perm is not None:
        xs = xs[..., qw.perm]
    w, m = _magnitudes(qw)
    acc = xs @ w.T + (bias.double() if bias is not None else 0.0)
    tol = U32 * (sum_ulps(qw.shape[1]) + 4) * (xs.abs() @ m.T)
    if dot and dt != FP32:
        tol = tol + r * (xs.abs() @ w.abs().T)
    tol = tol + r * acc.abs()
    y = acc
    if activation is not None:
        (g, u), (tg, tu) = acc.chunk(2, dim=-1), tol.chunk(2, dim=-1)
        y = _act64(g, activation) * u
        tol = (GLU_SLOPE * u.abs() * tg + _act64(g, activation).abs() * tu + GLU_SLOPE * tg * tu
               + GLU_ULPS * U32 * g.abs() * u.abs() + r * y.abs())
    if residual is not None:
        y = y + residual.double()
        tol = tol + r * y.abs()
    return y, tol


def _check(name, got, x, qw, **kw):
    rows = x.numel() // x.shape[-1]
    cfg = kw.pop("config", None)
    gemv_rows = 1 if cfg is None or cfg.gemv_max_rows < 0 else cfg.gemv_max_rows
    y, tol = _exact_and_tol(x, qw, dot=rows > gemv_rows, **kw)
    assert got.dtype == x.dtype
    assert_tol(name, got, y, tol)


def _x(*shape, dtype, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Every kind on both kernels


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("M", [1, 3, 19])
def test_every_kind_both_kernels(device, case, M):
    kind, G, zeros, perm, N, K = CASES[case]
    dtype = (FP32, BF16, FP16)[(list(CASES).index(case) + M) % 3]  # every case sees two or three dtypes
    qw = _on(_weight(kind, G, zeros, perm, N, K, dtype), device)
    x = _x(M, K, dtype=dtype).to(device)
    before = ops.dispatch_counts[("quant_linear", "triton")]
    got = quant_linear(x, qw)
    assert ops.dispatch_counts[("quant_linear", "triton")] == before + 1  # the kernels ran, not the reference
    _check(case, got, x, qw)


# ----------------------------------------------------------------------------------------------------------
# Epilogues, layouts, launches


@pytest.mark.parametrize("case, dtype, M, activation, bias, residual", [
    ("int4-zeros-g64", BF16, 1, "silu", True, True),
    ("int4-g32", FP16, 5, "gelu_tanh", False, True),
    ("nf4-g32", FP32, 20, "silu", True, False),
    ("fp4-g64", BF16, 1, "gelu_tanh", True, True),
    ("fp4-g32-perm", FP16, 6, "silu", False, True),
    ("fp8-channel", BF16, 1, "gelu_tanh", True, True),  # per-channel scales of the up half, in the epilogue
    ("fp8-block32", FP32, 4, "silu", False, False),
    ("int4-perm-g128", FP16, 18, None, True, True),
    ("fp8-block128", FP32, 1, None, True, True),
])
def test_epilogues(device, case, dtype, M, activation, bias, residual):
    kind, G, zeros, perm, N, K = CASES[case]
    N += N % 2
    qw = _on(_weight(kind, G, zeros, perm, N, K, dtype, seed=M), device)
    x = _x(2, M, K, dtype=dtype).to(device)  # leading dims: [2, M] rows
    n_out = N // 2 if activation else N
    b = _x(N, dtype=dtype, seed=3).to(device) if bias else None
    r = _x(2, M, n_out, dtype=dtype, seed=4).to(device) * 4 if residual else None
    got = quant_linear(x, qw, bias=b, residual=r, activation=activation)
    assert got.shape == (2, M, n_out)
    _check(case, got, x, qw, bias=b, residual=r, activation=activation)


def test_large_gate_values_reach_both_activation_tails(device):
    qw = _on(_weight("int4", 32, False, False, 16, 64, FP32), device)
    x = _x(3, 64, dtype=FP32).to(device) * 60  # gates of +-hundreds: exp overflows to inf on one side
    for act in ("silu", "gelu_tanh"):
        _check(act, quant_linear(x, qw, activation=act), x, qw, activation=act)


def test_non_contiguous_x_and_residual(device):
    kind, G, zeros, perm, N, K = CASES["int4-zeros-g64"]
    qw = _on(_weight(kind, G, zeros, perm, N, K, BF16), device)
    base = _x(K, 6, dtype=BF16).to(device)
    r = _x(N, 3, dtype=BF16, seed=5).to(device)
    for x, res in ((base.t()[::2], r.t()), (base.t()[:1], r.t()[:1]), (base.t().reshape(2, 3, K)[:, ::2], None)):
        res = res.reshape(*x.shape[:-1], N) if res is not None else None
        _check("non-contiguous", quant_linear(x, qw, residual=res), x, qw, residual=res)


@pytest.mark.parametrize("shape, M, config", [
    (("int4", 32, False, False, 20, 192), 1, QuantLinearConfig(block_n=16, block_k=64, split_k=3)),  # 2 x 3 tiles
    (("int4", 64, True, False, 12, 128), 1, QuantLinearConfig(block_n=8, block_k=32, split_k=1)),  # 2 steps a group
    (("nf4", 32, False, False, 24, 128), 2, QuantLinearConfig(block_n=32, block_k=64, split_k=2, gemv_max_rows=4)),
    (("fp4", 32, False, True, 22, 192), 1, QuantLinearConfig(block_n=16, block_k=64, split_k=3)),
    (("fp8", 128, False, False, 20, 200), 1, QuantLinearConfig(block_n=32, block_k=128, gemv_max_rows=0)),
    (("int4", 32, True, True, 20, 128), 17, QuantLinearConfig(block_m=16, block_n=32, block_k=64, split_k=2)),
    (("fp8", 48, False, False, 50, 120), 3, QuantLinearConfig(block_n=64, block_k=16, split_k=4)),  # ragged K
    (("int4", 32, True, True, 20, 192), 1, QuantLinearConfig(block_k=64, split_k=2, prefetch=1)),
    (("nf4", 64, False, False, 24, 192), 1, QuantLinearConfig(block_k=64, split_k=1, prefetch=1)),
    (("fp4", 64, False, False, 24, 192), 1, QuantLinearConfig(block_k=64, split_k=1, prefetch=1)),
    (("fp8", 32, False, False, 20, 100), 1, QuantLinearConfig(block_k=64, prefetch=1)),  # ragged K
    # the tensor-core kernel with the next step's scales loaded ahead: two steps a group, groups a step, ragged K
    (("int4", 64, True, True, 20, 256), 5, QuantLinearConfig(block_n=16, block_k=32, split_k=2, prefetch=1)),
    (("nf4", 32, False, False, 24, 192), 9, QuantLinearConfig(block_n=32, block_k=64, prefetch=1)),
    (("fp4", 32, False, True, 22, 160), 9, QuantLinearConfig(block_n=16, block_k=64, split_k=2, prefetch=1)),
    (("fp8", 16, False, False, 48, 100), 3, QuantLinearConfig(block_n=32, block_k=16, split_k=3, prefetch=1)),
    (("fp8", 0, False, False, 20, 100), 2, QuantLinearConfig(block_n=16, block_k=32, prefetch=1)),
], ids=["gemv-split3", "gemv-narrow-k", "gemv-2-rows", "gemv-split3-fp4", "dot-1-row", "split-prefill",
        "dot-split4", "prefetch-int4", "prefetch-nf4", "prefetch-fp4", "prefetch-fp8", "dot-scales-ahead-int4",
        "dot-scales-ahead-nf4", "dot-scales-ahead-fp4", "dot-scales-ahead-fp8", "dot-scales-ahead-fp8-channel"])
def test_launch_configs(device, shape, M, config):
    qw = _on(_weight(*shape, FP16), device)
    x = _x(M, shape[-1], dtype=FP16).to(device)
    _check("glu", quant_linear(x, qw, activation="silu", config=config), x, qw, activation="silu", config=config)
    _check("plain", quant_linear(x, qw, config=config), x, qw, config=config)
    _assert_counters_clean(device)


def test_split_k_is_deterministic(device):
    qw = _on(_weight("int4", 32, True, False, 20, 256, BF16), device)
    x = _x(1, 256, dtype=BF16).to(device)
    cfg = QuantLinearConfig(block_n=32, block_k=64, split_k=4)
    first = quant_linear(x, qw, config=cfg)
    assert all(torch.equal(first, quant_linear(x, qw, config=cfg)) for _ in range(2))  # split sums in split order


@pytest.mark.parametrize("case, M", [("fp8-block48", 1), ("fp8-channel", 3), ("fp8-block128", 17)])
def test_fp8_from_its_bytes(device, monkeypatch, case, M):
    # Before sm_89 Triton has no e4m3 conversion: the kernels decode the bytes, every value of the format included
    monkeypatch.setattr(ql, "_fp8_native", lambda device: False)
    kind, G, zeros, perm, N, K = CASES[case]
    qw = _on(_weight(kind, G, zeros, perm, N, K, FP32), device)
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    every = torch.where(every.isnan(), 0.0, every).to(torch.float8_e4m3fn)  # 0x7f, 0xff: NaN, no weight's value
    qw = dataclasses.replace(qw, data=every.repeat(N * K // 256 + 1)[: N * K].view(N, K).to(device))
    x = _x(M, K, dtype=FP32).to(device)
    _check(case, quant_linear(x, qw), x, qw)


def _assert_counters_clean(device):
    counters = ql._ws.workspace(device).pinned("quant_linear.counters", 1, torch.int32, zeros=True)
    assert not counters.any()  # the last split of every tile set its counter back to 0


def test_plan_picks_the_kernel_and_split(monkeypatch):
    monkeypatch.setattr(ql._launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(ql, "_plan", ql._plan.__wrapped__)  # not the cache: the SM count above
    cuda = torch.device("cuda", 0)
    cfg = QuantLinearConfig()
    o_proj = ql._plan(1, 4096, 4096, "int4", 128, False, cuda, cfg)  # 64 column blocks of 64
    assert o_proj.gemv and o_proj.split == 8 and o_proj.gw * o_proj.gpt == 256 and o_proj.gw == 128
    gate_up = ql._plan(1, 14336, 4096, "int4", 128, True, cuda, cfg)
    assert gate_up.split == 2  # 224 column blocks of gate and up: 2.4 of 4 programs an SM wanted
    qkv = ql._plan(1, 6144, 4096, "int4", 128, False, cuda, cfg)
    assert qkv.split == 8 and qkv.k_split == 512  # 11 wanted, at most 8: two K steps a split
    down = ql._plan(1, 4096, 14336, "int4", 128, False, cuda, cfg)
    assert down.split == 14 and down.k_split * 14 == 14336  # 16.5 wanted: 14 divides the 56 K steps
    batch8 = ql._plan(8, 4096, 4096, "fp8", 128, False, cuda, cfg)
    assert not batch8.gemv and (batch8.block_m, batch8.block_n) == (16, 128) and batch8.split == 16
    assert batch8.gpt == 1 and batch8.gw == 64
    mm = QuantLinearConfig(dequant_min_rows=0)  # the dot kernel's prefill GEMM
    prefill = ql._plan(512, 4096, 4096, "nf4", 32, False, cuda, mm)
    assert (prefill.block_m, prefill.block_n, prefill.split, prefill.gw, prefill.gpt) == (128, 128, 1, 32, 2)
    assert not prefill.dequant and ql._plan(512, 14336, 4096, "fp8", 128, True, cuda, mm).block_n == 64
    odd = ql._plan(8, 64, 14336, "int4", 14336, False, cuda, cfg)  # one group over K (GPTQ group -1)
    assert odd.gw * odd.gpt == 64 and odd.gpt == 1


def test_each_kind_runs_its_code_path_with_its_table(monkeypatch):
    assert set(ql.KIND_CODES) == set(ql.KERNEL_KIND) == set(KINDS) and len(set(ql.KIND_CODES.values())) == len(KINDS)
    assert ql.KERNEL_KIND == {"int4": 0, "nf4": 1, "fp8": 2, "fp4": 1}  # fp4: the table path, never int4's affine one
    scales, b = torch.ones(4, 2), torch.arange(256)
    for kind, values in TABLES.items():
        path, table, zeros = ql._kernel_args(ql.KIND_CODES[kind], scales, scales)
        v = torch.tensor(values)
        assert path == 1 and zeros is None and torch.equal(table, torch.stack((v[b & 15], v[b >> 4]), dim=1))
    assert not torch.equal(ql._pairs("fp4", torch.device("cpu")), ql._pairs("nf4", torch.device("cpu")))
    path, table, zeros = ql._kernel_args(ql.KIND_CODES["int4"], scales, scales)
    assert path == 0 and table is scales and zeros is scales
    # fp4 plans as nf4: the same bytes and instructions (nf4's 32-column GEMV blocks on a GPU, nf4's picks)
    monkeypatch.setattr(ql._launch, "sm_count", lambda index: 132)
    cuda, plan = torch.device("cuda", 0), ql._plan.__wrapped__
    for M in (1, 8, 512):
        assert plan(M, 4096, 4096, "fp4", 64, False, cuda, QuantLinearConfig()) == \
            plan(M, 4096, 4096, "nf4", 64, False, cuda, QuantLinearConfig())
    assert plan(1, 4096, 4096, "fp4", 64, False, cuda, QuantLinearConfig()).block_n == 32


# ----------------------------------------------------------------------------------------------------------
# Prefill: W dequantized once, then one GEMM

DEQUANT = QuantLinearConfig(dequant_min_rows=1)


def _spy_dequant_mm(monkeypatch):
    calls = []
    real = ql._dequant_mm
    monkeypatch.setattr(ql, "_dequant_mm", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_dequant_path_every_kind(device, monkeypatch, case):
    kind, G, zeros, perm, N, K = CASES[case]
    dtype = (BF16, FP16)[list(CASES).index(case) % 2]
    qw = _on(_weight(kind, G, zeros, perm, N, K, dtype), device)
    x = _x(37, K, dtype=dtype).to(device)
    calls = _spy_dequant_mm(monkeypatch)
    _check(case, quant_linear(x, qw, config=DEQUANT), x, qw, config=DEQUANT)
    assert calls == [1]


@pytest.mark.parametrize("case, dtype, activation, bias, residual", [
    ("int4-zeros-g64", BF16, "silu", True, True),
    ("int4-perm-g128", FP16, "gelu_tanh", False, True),
    ("nf4-g32", BF16, None, True, True),
    ("fp4-g32-perm", FP16, "silu", True, True),
    ("fp8-channel", BF16, "silu", True, True),  # the scale of each half, then the bias, on the GEMM's output
    ("fp8-channel", FP16, None, True, False),
    ("fp8-channel", FP16, "gelu_tanh", False, True),  # the scale alone, in place on the GEMM's output
    ("fp8-block48", FP16, "gelu_tanh", True, False),
])
def test_dequant_path_epilogues(device, monkeypatch, case, dtype, activation, bias, residual):
    kind, G, zeros, perm, N, K = CASES[case]
    N += N % 2
    qw = _on(_weight(kind, G, zeros, perm, N, K, dtype, seed=2), device)
    x = _x(37, K, dtype=dtype).to(device)
    n_out = N // 2 if activation else N
    b = _x(N, dtype=dtype, seed=3).to(device) if bias else None
    r = _x(37, n_out, dtype=dtype, seed=4).to(device) * 4 if residual else None
    calls = _spy_dequant_mm(monkeypatch)
    got = quant_linear(x, qw, bias=b, residual=r, activation=activation, config=DEQUANT)
    assert calls == [1] and got.shape == (37, n_out)
    _check(case, got, x, qw, bias=b, residual=r, activation=activation, config=DEQUANT)


def test_dequant_path_keeps_fp32_on_the_dot_kernel(device, monkeypatch):
    # cuBLAS may run fp32 GEMMs in TF32 (a process-wide switch): fp32 x stays on the IEEE dot kernel
    qw = _on(_weight(*CASES["int4-g32"], FP32), device)
    x = _x(37, 256, dtype=FP32).to(device)
    calls = _spy_dequant_mm(monkeypatch)
    _check("fp32", quant_linear(x, qw, config=DEQUANT), x, qw, config=DEQUANT)
    assert calls == []


def _one_rounding(w32, dtype):
    """The values w32 (fp32) may round to in dtype: to nearest, or (bf16 in Triton's interpreter) truncated."""
    near = w32.to(dtype)
    if dtype != BF16:
        return near, near
    return near, (w32.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: the low bits cleared


# (kind, group_size, zeros, N, K, block_n, block_k): odd N, K not a multiple of the tile (odd for fp8), int4 as
# words (32-column chunks) and as bytes (a group of 12: 4-column chunks), fp8 chunks narrower than the tile
DEQUANT_SHAPES = [
    ("int4", 32, False, 37, 96, 16, 64),
    ("int4", 32, True, 21, 160, 16, 64),
    ("int4", 12, True, 19, 72, 8, 32),
    ("nf4", 32, False, 23, 160, 16, 64),
    ("fp4", 64, False, 27, 192, 16, 128),
    ("fp8", 0, False, 37, 101, 16, 32),
    ("fp8", 32, False, 45, 77, 16, 64),
    ("fp8", 48, False, 50, 120, 32, 64),
]


@pytest.mark.parametrize("bytes_fp8", [False, True], ids=["native", "fp8-bytes"])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_dequant_kernel_writes_every_element(device, monkeypatch, dtype, bytes_fp8):
    # the conftest's NaN-poisoned torch.empty: an element left unwritten is not equal to anything
    monkeypatch.setattr(ql, "_fp8_native", lambda device: not bytes_fp8)
    for kind, G, zeros, N, K, block_n, block_k in DEQUANT_SHAPES:
        if bytes_fp8 and kind != "fp8":
            continue
        qw = _on(_weight(kind, G, zeros, kind == "int4", N, K, dtype), device)
        cfg = QuantLinearConfig(block_n=block_n, block_k=block_k, dequant_min_rows=1)
        plan = ql._plan(37, N, K, kind, G, False, device, cfg)
        assert plan.dequant and (plan.block_n, plan.gpt * plan.gw) == (block_n, block_k)
        got = ql._dequant(qw.data, qw.scales, qw.zeros, ql.KIND_CODES[kind], G, (N, K), dtype, plan).cpu()
        qw = _on(qw, "cpu")
        if kind == "int4" and zeros:  # the kernels' fp32 (q - z) s: (1 + q / 16) (16 s) - (16 + z) s
            s = qw.scales.float().repeat_interleave(G, 1)
            z = qw.zeros.float().repeat_interleave(G, 1)
            w32 = (1 + unpack_int4(qw.data).float() / 16) * (16 * s) - (16 + z) * s
            assert (w32 - dequantize(qw)).abs().max() <= 4 * U32 * (dequantize(qw).abs() + z * s.abs()).max()
        elif kind == "fp8" and G == 0:  # exact, unscaled: the scale multiplies the GEMM's output
            w32 = qw.data.float()
        else:  # the same fp32 products as `dequantize` (int4 symmetric: exact in fp32 for 16-bit scales)
            w32 = dequantize(qw)
        near, trunc = _one_rounding(w32, dtype)
        name = f"{kind}-g{G} {N}x{K}"
        assert got.shape == (N, K) and got.dtype == dtype, name
        assert ((got == near) | (got == trunc)).all(), f"{name}: {(got != near).sum().item()} elements differ"


def test_plan_takes_the_dequant_path_from_its_threshold():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    plan = ql._plan.__wrapped__
    default = QuantLinearConfig()
    assert plan(256, 4096, 4096, "int4", 128, False, cuda, default).dequant
    assert not plan(255, 4096, 4096, "int4", 128, False, cuda, default).dequant
    assert not plan(4096, 4096, 4096, "int4", 128, False, cpu, default).dequant  # never by default off a GPU
    assert not plan(4096, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(dequant_min_rows=0)).dequant
    assert plan(3, 64, 256, "nf4", 64, True, cpu, QuantLinearConfig(dequant_min_rows=3)).dequant
    assert plan(1, 64, 256, "nf4", 64, True, cpu, DEQUANT).gemv  # the GEMV's rows stay the GEMV's
    gate_up = plan(512, 14336, 4096, "int4", 128, True, cuda, default)
    assert (gate_up.block_n, gate_up.gw, gate_up.gpt) == (32, 128, 2)
    fp8 = plan(512, 4096, 4096, "fp8", 128, False, cuda, QuantLinearConfig(block_n=64, block_k=512))
    assert fp8.dequant and (fp8.block_n, fp8.gw, fp8.gpt) == (64, 128, 4)  # one tile spans 4 blocks


def test_fp32_model_rejects_a_wrong_output(device):
    kind, G, zeros, perm, N, K = CASES["int4-zeros-g64"]
    qw = _on(_weight(kind, G, zeros, perm, N, K, FP32), device)
    for M in (1, 5):
        x = _x(M, K, dtype=FP32).to(device)
        got = quant_linear(x, qw)
        _check("right", got, x, qw)
        with pytest.raises(AssertionError):
            _check("1e-3 off", got * (1 + 1e-3), x, qw)
        with pytest.raises(AssertionError):  # the zero points dropped (read as symmetric)
            _check("zero point", got, x, dataclasses.replace(qw, zeros=None))


def test_empty_rows(device):
    qw = _on(_weight("int4", 32, False, False, 8, 64, BF16), device)
    assert quant_linear(_x(0, 64, dtype=BF16).to(device), qw).shape == (0, 8)
    assert quant_linear(_x(2, 0, 64, dtype=BF16).to(device), qw, activation="silu").shape == (2, 0, 4)


def test_no_backward_is_a_clear_error(device):
    qw = _on(_weight("nf4", 32, False, False, 8, 64, FP32), device)
    x = _x(2, 64, dtype=FP32).to(device).requires_grad_()
    with pytest.raises(RuntimeError, match="tigon.ops.quant_linear: inference only"):
        quant_linear(x, qw)
    with torch.no_grad():
        _check("no_grad", quant_linear(x, qw), x.detach(), qw)


# ----------------------------------------------------------------------------------------------------------
# Dispatch, compile


def test_reference_path_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(_library, "interpreter_on", lambda: False)
    qw = _weight(*CASES["int4-perm-g128"], BF16)
    x, r = _x(3, 256, dtype=BF16), _x(3, 20, dtype=BF16, seed=2)
    before = ops.dispatch_counts[("quant_linear", "reference")]
    got = quant_linear(x, qw, residual=r, activation="gelu_tanh")
    assert ops.dispatch_counts[("quant_linear", "reference")] == before + 1
    assert torch.equal(got, quant_linear_reference(x, qw, residual=r, activation="gelu_tanh"))
    _check("reference", got, x, qw, residual=r, activation="gelu_tanh", config=QuantLinearConfig(gemv_max_rows=0))
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: quant_linear(x, qw), fullgraph=True, backend="aot_eager")
    plain = quant_linear(x, qw)
    torch.testing.assert_close(compiled(x), plain, rtol=0, atol=2 * UNIT_ROUNDOFF[BF16] * plain.abs().max().item())


def test_compile_fullgraph_uses_the_custom_op(device):
    qw = _on(_weight(*CASES["fp8-block32"], FP32), device)
    cfg = QuantLinearConfig(block_n=16, block_k=32, split_k=2)

    def fn(x, r):
        return quant_linear(x * 2, qw, residual=r, config=cfg) + 1

    x, r = _x(3, 96, dtype=FP32).to(device), _x(3, 40, dtype=FP32, seed=2).to(device)
    torch._dynamo.reset()
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    before = ops.dispatch_counts[("quant_linear", "triton")]
    got = torch.compile(fn, fullgraph=True, backend=backend)(x, r)
    assert ops.dispatch_counts[("quant_linear", "triton")] == before  # traced: no eager dispatch
    torch.testing.assert_close(got, fn(x, r), rtol=0, atol=0)


def test_opcheck(device):
    qw = _on(_weight(*CASES["int4-zeros-g64"], BF16), device)
    x, b = _x(2, 256, dtype=BF16).to(device), _x(38, dtype=BF16).to(device)
    args = (x, qw.data, qw.scales, qw.zeros, qw.perm, b, None, 0, 64, 38, 1, None)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.tigon.quant_linear, args, test_utils=utils)


# ----------------------------------------------------------------------------------------------------------
# Bad input


def _qw():
    return _weight("int4", 32, False, False, 8, 64, BF16)


BAD = [
    (dict(qw="int4"), TypeError, "tigon.ops.quant_linear: qw must be a tigon.ops.QuantizedWeight"),
    (dict(x=_x(2, 64, dtype=FP16)), TypeError, "quant_linear: x has dtype torch.float16 but qw.dtype"),
    (dict(x=_x(2, 65, dtype=BF16)), ValueError, r"quant_linear: x must have shape \[..., K=64\]"),
    (dict(x=torch.zeros(2, 64, dtype=torch.int32)), TypeError, "quant_linear: x must be float32"),
    (dict(activation="relu"), ValueError, "quant_linear: activation must be one of"),
    (dict(activation="silu", qw=_weight("fp8", 0, False, False, 7, 64, BF16)), ValueError,
     "quant_linear: activation='silu' needs qw's N rows to be"),
    (dict(bias=_x(8, dtype=FP32)), TypeError, "quant_linear: bias has dtype torch.float32"),
    (dict(bias=_x(4, dtype=BF16)), ValueError, r"quant_linear: bias must have shape \(8,\)"),
    (dict(residual=_x(2, 8, dtype=FP16)), TypeError, "quant_linear: residual has dtype"),
    (dict(residual=_x(2, 8, dtype=BF16), activation="silu"), ValueError,
     r"quant_linear: residual must have shape \(2, 4\)"),
    (dict(config=dict(block_n=16)), TypeError, "quant_linear: config must be a tigon.ops.QuantLinearConfig"),
    (dict(x=_x(2, 30, dtype=BF16), qw=QuantizedWeight("int4", torch.zeros(8, 15, dtype=torch.uint8),
                                                      torch.ones(8, 10), None, 3, (8, 30), BF16)),
     ValueError, "quant_linear: qw.group_size must be even for int4"),
    (dict(qw=dataclasses.replace(_qw(), perm=torch.arange(64) + 1)), ValueError,
     r"quant_linear: qw.perm must hold column indices in \[0, 64\)"),
    (dict(qw=dataclasses.replace(_qw(), perm=torch.arange(64.0))), TypeError,
     "quant_linear: qw.perm must be an integer tensor"),
]


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("over, exc, match", BAD, ids=[m.split(": ")[1][:30] for _, _, m in BAD])
def test_bad_input(monkeypatch, path, over, exc, match):
    # validation runs before the dispatch: both paths refuse the same input with the same message
    monkeypatch.setattr(_library, "interpreter_on", lambda: path == "kernel")
    kw = dict(x=_x(2, 64, dtype=BF16), qw=_qw())
    kw.update(over)
    x, qw = kw.pop("x"), kw.pop("qw")
    with pytest.raises(exc, match=match):
        quant_linear(x, qw, **kw)


@pytest.mark.parametrize("field, value", [("block_n", 24), ("block_m", 8), ("block_k", 8), ("split_k", -1),
                                          ("num_warps", True), ("prefetch", 2), ("dequant_min_rows", -2),
                                          ("dequant_min_rows", 1.0)])
def test_config_is_validated(field, value):
    with pytest.raises(ValueError, match=f"QuantLinearConfig: {field} must be"):
        QuantLinearConfig(**{field: value})


def test_config_round_trips_through_the_ops_ints():
    cfg = QuantLinearConfig(block_n=32, gemv_max_rows=4, prefetch=1, dequant_min_rows=128, code_mma=1)
    assert QuantLinearConfig(*cfg.ints()) == cfg and cfg.ints()[-2:] == [128, 1]
    assert QuantLinearConfig().dequant_min_rows == QuantLinearConfig().code_mma == -1


# ----------------------------------------------------------------------------------------------------------
# The benchmark script


def test_benchmark_smoke(tmp_path):
    bench = importlib.import_module("benchmarks.generation.bench_quant_linear")
    out = tmp_path / "quant.json"
    bench.main(["--smoke", "--kinds", "int4", "nf4", "fp8", "--rows", "1", "--out", str(out), "--read-floor"])
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} >= {"int4", "nf4", "fp8"} and all(math.isfinite(r["ms"]) for r in rows)
    if torch.cuda.is_available():  # the smoke's tensors are on the CPU, and the floor is a Triton kernel: not run
        assert not any("read_floor" in r for r in rows)  # (test_read_floor_kernel_reads_every_word runs it there)
        return
    # the floor reads the codes alone: 48 x 256 at 4 bits, or at 8 in fp8
    assert {r["kind"]: r["read_floor"]["bytes"] for r in rows} == {"int4": 6144, "nf4": 6144, "fp8": 12288}
    assert all(math.isfinite(r["read_floor"]["ms"]) for r in rows)


@pytest.mark.parametrize("n,block,steps", [(5000, 1024, 2), (37, 1024, 1), (4096, 1024, 4)])
def test_read_floor_kernel_reads_every_word(n, block, steps, device):
    """The read-floor probe XORs each program's words: all n of them, none twice, none past n."""
    import functools
    import operator

    floor = importlib.import_module("benchmarks.generation.read_floor")
    w = torch.randint(-2**31, 2**31 - 1, (n + 3,), dtype=torch.int32, device=device)[:n]  # words past n: unread
    got = floor.read_xors(w, block, steps, 4).cpu()
    w = w.cpu()
    assert got.tolist() == [functools.reduce(operator.xor, c.tolist()) for c in w.split(block * steps)]


def test_read_floor_names_a_cpu_tensor_it_cannot_launch_on(monkeypatch):
    floor = importlib.import_module("benchmarks.generation.read_floor")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at the call: a CPU tensor with no interpreter to run it
    with pytest.raises(ValueError, match="read_xors: w must be a CUDA tensor"):
        floor.read_xors(torch.zeros(8, dtype=torch.int32), 1024, 1, 4)
