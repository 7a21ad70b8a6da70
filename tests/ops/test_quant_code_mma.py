"""The int4 code-MMA kernel (`QuantLinearConfig(code_mma=1)`, ops/quant_code_mma.py) against the exact product.

Its A operand is q - 8, exact in x's 16-bit dtype, so no tile rounding enters: the error model is the FMA GEMV's
(the fp32 sums and the output roundings of tests/ops/test_quant_linear.py, `dot=False`) at every row count, which
is stricter than the dequantizing tensor-core kernel's. On the CPU the kernel runs in the interpreter in fp32 with
the same K order, tiles, groups a step, splits and finish as on a GPU; every test checks that it launched (or, for
the launches it cannot take, that it did not and the others gave the same answer).
"""

import importlib

import pytest
import torch

from tests._grid import assert_tol
from tests.ops.test_quant_linear import BF16, FP16, FP32, _assert_counters_clean, _exact_and_tol, _on, _weight, _x
from tigon.ops.quant_linear import QuantLinearConfig, quant_linear

ql = importlib.import_module("tigon.ops.quant_linear")
MMA = QuantLinearConfig(code_mma=1)


@pytest.fixture
def launches(monkeypatch):
    """The code-MMA kernel's launches of the test, as [(grid, kwargs)]."""
    got, kernel = [], ql._mma._quant_code_mma_kernel

    class Recorder:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                got.append((grid, kwargs))
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(ql._mma, "_quant_code_mma_kernel", Recorder())
    return got


def _check(name, got, x, qw, **kw):
    y, tol = _exact_and_tol(x, qw, dot=False, **kw)
    assert got.dtype == x.dtype
    assert_tol(name, got, y, tol)


# (group size, zero points, perm, N, K): groups of one step, two and four dots a step, two steps a group; N past
# whole 64-row tiles; K of 2 to 4 steps (the interpreter's launch splits K in 2 where the steps allow)
SHAPES = [(128, False, False, 70, 384), (32, True, False, 40, 256), (64, False, True, 64, 256),
          (256, True, True, 36, 512), (128, True, False, 130, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"g{s[0]}{'-zeros' if s[1] else ''}{'-perm' if s[2] else ''}-"
                         f"{s[3]}x{s[4]}")
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("k_width", [2, 4])
def test_matches_the_fma_error_model(device, launches, monkeypatch, shape, M, k_width):
    # both K orders: sm_90's (kWidth 2) and sm_80 to sm_89's (4), whichever the device takes
    monkeypatch.setattr(ql._mma, "k_width", lambda *args: k_width)
    G, zeros, perm, N, K = shape
    dtype = (BF16, FP16)[(SHAPES.index(shape) + M) % 2]
    qw = _on(_weight("int4", G, zeros, perm, N, K, dtype, seed=M), device)
    x = _x(M, K, dtype=dtype).to(device)
    _check("plain", quant_linear(x, qw, config=MMA), x, qw)
    assert len(launches) == 1 and launches[0][1]["KWIDTH"] == k_width
    if launches[0][1]["SPLIT_K"] > 1:  # (one split allocates no counters)
        _assert_counters_clean(device)


def test_k_width_follows_the_mma_triton_takes():
    # wgmma (kWidth 2) on sm_90 and up for warpgroup tiles; mma.sync (4) below them, before sm_90 and off a GPU
    k_width = ql._mma.k_width
    assert [k_width((9, 0), 128, 4), k_width((9, 0), 64, 8), k_width((10, 0), 128, 4)] == [2, 2, 2]
    assert [k_width((9, 0), 32, 2), k_width((9, 0), 64, 2), k_width((9, 0), 32, 4), k_width((8, 9), 128, 4),
            k_width((8, 0), 64, 4), k_width(None, 128, 4)] == [4] * 6


@pytest.mark.parametrize("block_n, num_warps, want", [(128, 4, 2), (64, 2, 4), (32, 1, 4)])
def test_launch_takes_the_k_width_of_its_tile(device, launches, monkeypatch, block_n, num_warps, want):
    # as on an sm_90 GPU: the launch's tile picks the K order, and every order gives the product
    monkeypatch.setattr(ql._launch, "capability", lambda device: (9, 0))
    qw = _on(_weight("int4", 128, False, False, 70, 256, BF16, seed=block_n), device)
    x = _x(2, 256, dtype=BF16).to(device)
    cfg = QuantLinearConfig(code_mma=1, block_n=block_n, num_warps=num_warps)
    _check("tile", quant_linear(x, qw, config=cfg), x, qw)
    (_, kwargs), = launches
    assert (kwargs["KWIDTH"], kwargs["BLOCK_N"], kwargs["num_warps"]) == (want, block_n, num_warps)


@pytest.mark.parametrize("G, M, activation, bias, residual, split", [
    (128, 1, "silu", True, True, 2), (32, 3, "gelu_tanh", False, True, 1), (64, 16, "silu", True, False, 4),
    (128, 7, None, True, True, 3)])
def test_epilogues_and_splits(device, launches, G, M, activation, bias, residual, split):
    N, K = 68, 768  # 6 steps: 2, 3 or 4 splits of 3, 2 and 2 steps (the last one step short)
    qw = _on(_weight("int4", G, True, False, N, K, BF16, seed=G + M), device)
    n_out = N // 2 if activation else N
    x = _x(2, M, K, dtype=BF16).to(device)  # leading dims
    b = _x(N, dtype=BF16, seed=3).to(device) if bias else None
    r = _x(2, M, n_out, dtype=BF16, seed=4).to(device) * 4 if residual else None
    cfg = QuantLinearConfig(code_mma=1, block_n=32, split_k=split)
    if 2 * M > 16:
        x, r = x[:1], r[:1] if r is not None else None
    got = quant_linear(x, qw, bias=b, residual=r, activation=activation, config=cfg)
    assert got.shape == (*x.shape[:-1], n_out)
    _check("epilogue", got, x, qw, bias=b, residual=r, activation=activation)
    (grid, kwargs), = launches
    splits = -(-6 // -(-6 // split))
    assert grid == (-(-n_out // 32), splits, 1) and kwargs["SPLIT_K"] == splits
    if splits > 1:
        _assert_counters_clean(device)


@pytest.mark.parametrize("G, block_k", [(128, 32), (128, 64), (256, 64), (64, 32), (32, 64)])
def test_dots_narrower_than_a_group(device, launches, G, block_k):
    # block_k columns a dot: a group's dots summed, then scaled once (block_k >= G: one dot a group)
    qw = _on(_weight("int4", G, True, True, 40, 512, BF16, seed=G), device)
    x = _x(3, 512, dtype=BF16).to(device)
    _check("narrow dots", quant_linear(x, qw, config=QuantLinearConfig(code_mma=1, block_k=block_k)), x, qw)
    assert launches[0][1]["BLOCK_K"] == block_k


def test_split_k_is_deterministic(device, launches):
    qw = _on(_weight("int4", 32, True, False, 40, 512, BF16), device)
    x = _x(3, 512, dtype=BF16).to(device)
    cfg = QuantLinearConfig(code_mma=1, split_k=4)
    first = quant_linear(x, qw, config=cfg)
    assert all(torch.equal(first, quant_linear(x, qw, config=cfg)) for _ in range(2))
    assert len(launches) == 3 and launches[0][0][1] == 4


def test_views(device, launches):
    qw = _on(_weight("int4", 64, False, False, 48, 256, FP16), device)
    base = _x(256, 6, dtype=FP16).to(device)
    x = base.t()[::2]  # 3 rows, a column stride of 6
    r = _x(48, 3, dtype=FP16, seed=5).to(device).t()
    _check("views", quant_linear(x, qw, residual=r, config=MMA), x, qw, residual=r)
    assert len(launches) == 1


@pytest.mark.parametrize("why", ["fp32 x", "nf4", "K not whole steps", "groups of 96", "codes off words"])
def test_launches_it_cannot_take_run_the_others(device, launches, why):
    kind, G, K, M, dtype = "int4", 64, 256, 2, BF16
    if why == "fp32 x":
        dtype = FP32
    elif why == "nf4":
        kind = "nf4"
    elif why == "K not whole steps":
        K = 320
    elif why == "groups of 96":
        G, K = 96, 384
    qw = _on(_weight(kind, G, False, False, 24, K, dtype), device)
    if why == "codes off words":  # a view one byte into a buffer: rows whose words are not 4-byte aligned
        data = torch.cat([torch.zeros(1, dtype=torch.uint8, device=device), qw.data.flatten()])[1:]
        qw = type(qw)(qw.kind, data.view(qw.data.shape), qw.scales, qw.zeros, qw.group_size, qw.shape, qw.dtype)
    x = _x(M, K, dtype=dtype).to(device)
    got = quant_linear(x, qw, config=MMA)
    assert not launches
    y, tol = _exact_and_tol(x, qw, dot=M > 1)
    assert_tol(why, got, y, tol)


def test_plan(monkeypatch):
    monkeypatch.setattr(ql._launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(ql, "_plan", ql._plan.__wrapped__)
    cuda = torch.device("cuda", 0)
    o_proj = ql._plan(1, 4096, 4096, "int4", 128, False, cuda, MMA, False, False, True)
    assert o_proj.mma and o_proj.block_n == 128 and o_proj.split == 16 and o_proj.k_split == 256  # 32 tiles
    gate_up = ql._plan(8, 14336, 4096, "int4", 128, True, cuda, MMA, False, False, True)
    assert gate_up.mma and gate_up.split == 2  # 112 tiles of two accumulators: 2.4 of 2 programs an SM
    assert ql._plan(1, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(code_mma=1, block_n=64,
                                                                               split_k=4), False, False, True) \
        .k_split == 1024
    assert not ql._plan(1, 4096, 4096, "int4", 128, False, cuda, MMA).mma  # x not 16-bit
    gemm = ql._plan(512, 4096, 4096, "int4", 128, False, cuda, MMA, False, False, True)
    assert (gemm.block_m, gemm.block_n, gemm.num_warps, gemm.split) == (128, 128, 8, 1)
    assert ql._plan(512, 14336, 4096, "int4", 128, True, cuda, MMA, False, False, True).block_m == 64  # a GLU
    assert o_proj.gw == 128 and ql._plan(1, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(
        code_mma=1, block_k=64), False, False, True).gw == 64  # a dot's columns
    assert not ql._plan(1, 4096, 4096, "fp8", 128, False, cuda, MMA, False, False, True).mma
    assert not ql._plan(1, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(), False, False, True).mma


@pytest.mark.parametrize("capability, hip", [((9, 0), None), ((8, 0), None), ((8, 9), None), ((10, 0), None),
                                             ((9, 4), "6.2")])
def test_the_rule_runs_it_at_decode_rows_on_hopper_only(monkeypatch, capability, hip):
    """No config and no pick: int4 at 2-16 rows of 16-bit x runs this kernel on a CUDA sm_90 GPU (measured faster
    there), the decode tensor-core kernel on other architectures (ROCm's gfx942 reports 9.4); one row stays the
    GEMV's, 17 rows the GEMM rule's; fp8, fp32 x and any config field set keep their kernels."""
    monkeypatch.setattr(ql._launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(ql._launch, "capability", lambda device: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(ql, "_plan", ql._plan.__wrapped__)
    cuda, default = torch.device("cuda", 0), QuantLinearConfig()
    hopper = capability[0] == 9 and hip is None
    for rows in (2, 8, 16):
        got = ql._plan(rows, 14336, 4096, "int4", 128, True, cuda, default, False, False, True)
        assert got.mma == hopper
        assert not hopper or (got.split, got.block_n, got.num_warps) == (2, 128, 4)  # the kernel's own plan
    assert all(not ql._plan(rows, 4096, 4096, "int4", 128, False, cuda, default, False, False, True).mma
               for rows in (1, 17))
    assert not ql._plan(8, 4096, 4096, "int4", 128, False, cuda, default, False, False, False).mma  # fp32 x
    assert not ql._plan(8, 4096, 4096, "fp8", 128, False, cuda, default, False, False, True).mma
    assert not ql._plan(8, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(split_k=4), False, False,
                        True).mma  # a config for the decode kernel keeps it
    assert not ql._plan(8, 4096, 4096, "int4", 128, False, torch.device("cpu"), default, False, False, True).mma


@pytest.mark.parametrize("value", [2, -2])
def test_config_rejects_other_values(value):
    with pytest.raises(ValueError, match="code_mma"):
        QuantLinearConfig(code_mma=value)


@pytest.mark.parametrize("M, block_m, split", [(40, 0, 0), (37, 32, 2), (130, 64, 0)])
def test_more_rows_as_a_gemm(device, launches, M, block_m, split):
    # past 16 rows the same kernel tiles x's rows too (block_m of them a program; 64 by default) and K is not split
    qw = _on(_weight("int4", 64, True, True, 36, 384, FP16, seed=M), device)
    x = _x(M, 384, dtype=FP16).to(device)
    r = _x(M, 18, dtype=FP16, seed=2).to(device)
    cfg = QuantLinearConfig(code_mma=1, block_m=block_m, split_k=split)
    _check("gemm", quant_linear(x, qw, activation="silu", residual=r, config=cfg), x, qw, activation="silu", residual=r)
    (grid, kwargs), = launches
    assert grid[2] == -(-M // (block_m or 64)) and kwargs["BLOCK_M"] == (block_m or 64)
    assert grid[1] == (split or 1)
    if grid[1] > 1:
        _assert_counters_clean(device)
