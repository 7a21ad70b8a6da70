"""decode_linear: the few-row GEMV of a decode step with RMSNorm before and concat / GLU / residual after.

Every output is checked against
- bf16 / fp16: the spec in the input dtype (`reference.decode_linear`: the unfused modules in fp32, rounding
  where they round), within a couple of ulps of the output magnitude. Triton's interpreter casts fp32 -> bf16 by
  truncation (a GPU rounds to nearest), and up to four such casts compound (norm, projection, GLU, residual),
  so where the cast truncates bf16 is held to the same spec with truncating casts (`_spec`), as tight; and the
  fp64 math, with the op contract's bound (`assert_bound`; its baseline: the HF modules in the dtype);
- fp32: the fp64 math within the error model of tests/_grid.py (`_exact_and_fp32_tol`: the norm's output, the
  projections' sums over K, the GLU and the residual add), and the spec within twice that (both sides are
  within the model of the exact value, whatever order the kernel and the host's BLAS sum in).
The split-K workspace must be all zeros again after every call (the kernel cleans up after itself), and the
conftest's NaN-poisoned allocations make any output element left unwritten fail the finiteness check.
"""

import dataclasses
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tests._grid import (
    DTYPES,
    U32,
    UNIT_ROUNDOFF,
    KernelSpy,
    assert_bound,
    assert_tol,
    err,
    matmul_tol,
    randn,
    sum_ulps,
)
from tigon import ops
from tigon.ops import _library, _rolling_buffer, reference
from tigon.ops.config import DecodeLinearConfig
from tigon.ops.decode_linear import decode_linear

dl = importlib.import_module("tigon.ops.decode_linear")  # the module: tigon.ops.decode_linear is the op

# Kernel vs the spec in bf16 / fp16, in ulps of the largest output: another fp32 summation order (K blocks,
# split-K) can flip the rounding of the norm output, the projections and the GLU product by one ulp each.
SPEC_ULPS = {torch.float16: 3, torch.bfloat16: 3}
# fp32 norm output, relative to |h|: the squares (1 u) and their sum over K (sum_ulps(K) u), / K and + eps, halved
# by the square root; the GPU's approximate rsqrt (2 ulps); x * rstd and * weight: sum_ulps(K) / 2 + 5.5 ulps.
NORM_ULPS = 8.0
# fp32 act(gate) * up beyond its operands' errors, in u * |gate| |up|: exp (2 ulps on a GPU), its argument, the
# divide and the product; tanh-gelu's 2 - 2 / (exp(2z) + 1) cancels to an absolute few u (as test_glu_mlp).
GLU_ULPS = 8.0
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) -> the split the launcher ends up with at K = 130:
# k_split = cdiv(cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K, split = cdiv(K, k_split).
SPLIT_CONFIGS = {
    (16, 32, 4, 1, 1): 1,
    (32, 32, 4, 1, 2): 2,  # k_split 96: splits of 96 + 34
    (16, 32, 4, 1, 3): 3,  # k_split 64: 64 + 64 + 2 (a 2-wide masked tail)
    (32, 16, 4, 1, 3): 3,  # k_split 48: 48 + 48 + 34
}


@pytest.fixture
def grids(monkeypatch):
    """The grid of every kernel launch: (column blocks, row blocks, K splits)."""
    seen = []
    kernel = dl._decode_linear_kernel

    class Spy:
        def __getitem__(self, grid):
            seen.append(tuple(grid))
            return kernel[grid]

    monkeypatch.setattr(dl, "_decode_linear_kernel", Spy())
    return seen


@triton.jit
def _cast_bf16_kernel(X, Y):
    tl.store(Y, tl.load(X).to(tl.bfloat16))


@functools.cache
def _bf16_cast_truncates(device) -> bool:
    """Whether Triton's fp32 -> bf16 cast on `device` truncates (the interpreter) or rounds to nearest."""
    x = torch.tensor([1.0 + 2**-8 + 2**-9], device=device)  # 3/4 of a bf16 ulp above 1: nearest is 1 + 2^-7
    y = torch.zeros(1, dtype=torch.bfloat16, device=device)
    _cast_bf16_kernel[(1,)](x, y)
    assert y.item() in (1.0, 1.0 + 2**-7)
    return y.item() == 1.0


def _inputs(dtype, M, K, ns, *, device, lead=None, norm=False, residual=False, glu=False, seed=0):
    """x [*lead or M, K], weights [N_i, K] scaled so outputs are O(1), norm weight around 1, residual O(1)
    (as wide as the output: ns[0] with glu, else sum(ns))."""
    torch.manual_seed(seed)
    lead = (M,) if lead is None else lead
    x = randn(*lead, K, dtype=dtype, device=device)
    ws = [randn(n, K, dtype=dtype, device=device, scale=K**-0.5) for n in ns]
    nw = (torch.rand(K, device=device) + 0.5).to(dtype) if norm else None
    r = randn(*lead, ns[0] if glu else sum(ns), dtype=dtype, device=device) if residual else None
    return x, ws, nw, r


def _d64(t):
    return None if t is None else t.double()


def _spec(x, ws, *, norm_weight=None, eps=1e-6, residual=None, activation=None, truncate=False):
    """reference.decode_linear written out, each fp32 -> dtype cast rounding to nearest or, with truncate, toward
    zero (for bf16: the low 16 bits dropped, as Triton's interpreter casts)."""
    dt = x.dtype

    def cast(t):
        if truncate and dt == torch.bfloat16:
            t = (t.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
        return t.to(dt)

    h = x
    if norm_weight is not None:
        xf = x.float()
        n = cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).float()
        h = cast(n * norm_weight.float())
    outs = [cast(h.float() @ w.float().t()) for w in ws]
    if activation is not None:
        g, u = outs[0].float(), outs[1].float()
        y = cast((F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")) * u)
    else:
        y = torch.cat(outs, dim=-1)
    return cast(y.float() + residual.float()) if residual is not None else y


def _eager(x, ws, *, norm_weight=None, eps=1e-6, residual=None, activation=None):
    """The unfused HF modules in the input dtype (LlamaRMSNorm, nn.Linear, the MLP's act * up, residual +)."""
    h = reference.rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    outs = [F.linear(h, w) for w in ws]
    if activation == "silu":
        y = F.silu(outs[0]) * outs[1]
    elif activation == "gelu_tanh":
        y = F.gelu(outs[0], approximate="tanh") * outs[1]
    else:
        y = torch.cat(outs, dim=-1)
    return residual + y if residual is not None else y


def _assert_workspace_clean():
    # The partial tiles are overwritten by every call (no zeroing needed); the arrival counters must be zero.
    for ws in list(_rolling_buffer._workspaces.values()):
        for (name, _, _), buf in ws._pinned.items():
            if name == "decode_linear.counters":
                assert not buf.any(), "split-K arrival counters left in the workspace"


def _exact_and_fp32_tol(x, ws, *, norm_weight=None, eps=1e-6, residual=None, activation=None):
    """(decode_linear's fp64 value, the fp32 error model's per-element tolerance of it; tests/_grid.py): the norm
    output h within NORM_ULPS + sum_ulps(K) / 2 u of |h|; each projection h W^T from that h (`matmul_tol`, K
    terms); act(gate) * up carries the projections' errors through |d/d gate|, |d/d up| and adds GLU_ULPS; the
    residual add one rounding. A kernel summing K in any order, and torch on any host, is within it."""
    ws = [ws] if isinstance(ws, torch.Tensor) else list(ws)
    exact = reference.decode_linear(x.double(), [w.double() for w in ws], norm_weight=_d64(norm_weight), eps=eps,
                                    residual=_d64(residual), activation=activation)
    K = x.shape[-1]
    x2 = x.detach().double().reshape(-1, K)
    h = x2 if norm_weight is None else reference.rms_norm(x2, norm_weight.double(), eps)
    h_tol = None if norm_weight is None else U32 * (sum_ulps(K) / 2 + NORM_ULPS) * h.abs()
    w = torch.cat([w.detach().double() for w in ws])
    p, tol = h @ w.t(), matmul_tol(h, w.t(), h_tol)
    if activation is not None:
        (gate, up), (g_tol, u_tol) = p.chunk(2, dim=-1), tol.chunk(2, dim=-1)
        glu = reference.swiglu if activation == "silu" else reference.geglu
        g = gate.clone().requires_grad_()
        a = glu(g, torch.ones_like(g))
        (a1,) = torch.autograd.grad(a.sum(), g)
        a = a.detach()
        p = a * up
        tol = (a1 * up).abs() * g_tol + a.abs() * u_tol + GLU_ULPS * U32 * gate.abs() * up.abs()
    if residual is not None:
        p = p + residual.detach().double().reshape(p.shape)
        tol = tol + U32 * p.abs()
    return exact, tol.reshape(exact.shape)


def _check(name, x, weights, config=None, **kw):
    dtype = x.dtype
    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    y = decode_linear(x, weights, config=config, **kw)
    spec = reference.decode_linear(x, ws, **kw)
    exact, tol32 = _exact_and_fp32_tol(x, ws, **kw)
    assert y.dtype == dtype and y.shape == spec.shape == exact.shape, (y.shape, spec.shape)
    assert y.is_contiguous()
    assert torch.isfinite(y).all(), f"{name}: non-finite output (a NaN-poisoned element left unwritten?)"
    # The written-out spec is the module's, bit for bit (so its truncating twin below is that spec too).
    x2, r2 = x.reshape(-1, x.shape[-1]), kw.get("residual")
    kw2 = dict(kw, residual=None if r2 is None else r2.reshape(x2.shape[0], -1))
    assert torch.equal(_spec(x2, ws, **kw2), spec.reshape(x2.shape[0], -1))
    if dtype == torch.float32:
        assert_tol(f"{name}: kernel vs fp64", y, exact, tol32)
        assert_tol(f"{name}: kernel vs spec in fp32", y, spec, 2 * tol32)
        _assert_workspace_clean()
        return y
    truncate = dtype == torch.bfloat16 and _bf16_cast_truncates(x.device)
    if truncate:
        spec = _spec(x2, ws, **kw2, truncate=True).reshape(spec.shape)
    scale = max(exact.abs().max().item(), 1e-30) if exact.numel() else 0.0
    e_spec, tol = err(y, spec), SPEC_ULPS[dtype] * UNIT_ROUNDOFF[dtype] * scale
    assert e_spec <= tol, (f"{name}: kernel vs spec in {dtype}{' (truncating casts)' if truncate else ''} err "
                           f"{e_spec:.3e} > {tol:.3e} (scale {scale:.3g})")
    # fp64: within the contract's bound of the unfused modules in dtype (of the truncating spec, where the
    # kernel's casts truncate: no torch op rounds that way to compare with).
    assert_bound(name, y, spec if truncate else _eager(x, ws, **kw), exact, dtype)
    _assert_workspace_clean()
    return y


# ----------------------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True], ids=["", "norm"])
@pytest.mark.parametrize("res", [False, True], ids=["", "res"])
@pytest.mark.parametrize("act", [None, "silu", "gelu_tanh"])
def test_every_fusion(device, dtype, norm, res, act):
    # K = 77: one full and one masked 64-wide K step; N = 18: two 16-column blocks, the second 2 wide.
    ns = (18, 18) if act else (18,)
    x, ws, nw, r = _inputs(dtype, 3, 77, ns, device=device, norm=norm, residual=res, glu=bool(act))
    weights = ws if act else ws[0]
    _check(f"{dtype} norm={norm} res={res} act={act}", x, weights, norm_weight=nw, residual=r, activation=act)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M,K,ns",
    [
        (1, 77, (33,)),  # one decode row; 3 column blocks, the last 1 wide
        (3, 130, (5,)),  # N below one block
        (17, 77, (18,)),  # M past BLOCK_M = 16: two row blocks, the second 1 row
        (17, 130, (33, 5, 18)),  # q, k, v of three sizes, 2 row blocks
        (2, 64, (16,)),  # exact tiles: EVEN_K
        (1, 5, (1,)),  # K below one step, one output column
        (9, 1100, (18,)),  # the norm's statistics in three 512-wide steps (16 rows), the last one masked
    ],
)
def test_odd_sizes(device, dtype, M, K, ns):
    x, ws, nw, r = _inputs(dtype, M, K, ns, device=device, norm=True, residual=True, seed=M + K)
    _check(f"{dtype} {M}x{K}->{ns}", x, ws, norm_weight=nw, residual=r, eps=1e-5)
    _check(f"{dtype} {M}x{K}->{ns} plain", x, ws)


# fp32 and bf16: the split-K partials and their sum are fp32 whatever the dtype, and fp16 takes bf16's path
# through them (its split-K launches are held bit for bit in test_rounding_points_bit_for_bit, every fusion and
# odd size above)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=lambda c: f"n{c[0]}k{c[1]}s{c[4]}")
def test_split_k_and_column_blocks(device, dtype, config, grids):
    """SPLIT_K 1/2/3 and BLOCK_N 16/32 from the config passed in: three weights with a norm and a residual over
    two row blocks; the grid has the split the config asks for and the workspace is zero again after each call."""
    cfg = DecodeLinearConfig(*config)
    block_n, split = config[0], SPLIT_CONFIGS[config]
    ns = (33, 5, 18)
    x, ws, nw, r = _inputs(dtype, 17, 130, ns, device=device, norm=True, residual=True, seed=split)
    _check(f"{dtype} {config}", x, ws, norm_weight=nw, residual=r, config=cfg)
    n_blocks = sum(-(-n // block_n) for n in ns)
    assert grids == [(n_blocks, 2, split)]
    # Again without the extras and at one row: the cleaned workspace is reused.
    _check(f"{dtype} {config} M=1", x[:1], ws[0], config=cfg)
    assert grids[-1] == (-(-33 // block_n), 1, split)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_split_k_config_is_ignored_with_an_activation(device, act, grids):
    # Two accumulators (gate and up): the launcher runs one split whatever the config says.
    x, ws, nw, r = _inputs(torch.bfloat16, 3, 130, (40, 40), device=device, norm=True, residual=True, glu=True)
    _check(act, x, ws, norm_weight=nw, residual=r, activation=act, config=DecodeLinearConfig(32, 32, 4, 1, 3))
    assert grids == [(2, 1, 1)]


def _grid_values(*shape, dtype, device, seed):
    """k / 64 with |k| <= 64: exact in fp16 and bf16; a product of two is a multiple of 2^-12 and a sum of K < 2^11
    of them is exact in fp32, so the kernel's summation order cannot matter and its roundings compare bit
    for bit with the spec's."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-64, 65, shape, generator=g) / 64).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["norm", "residual", "qkv+residual", "silu+residual", "gelu_tanh+residual"])
def test_rounding_points_bit_for_bit(device, dtype, case):
    """Where the unfused modules round (the norm output before its weight, the weighted norm, each projection,
    the GLU product, the sum with the residual), the kernel rounds: on exact fp32 sums its output is the
    spec's bit for bit. Where an approximate function comes first (the norm's rsqrt, the activations' exp: an
    fp32 ulp off on a GPU), a rare 1-ulp flip is allowed; a rounding left out flips a large share."""
    M, K = 3, 77
    if case == "norm":  # identity weights: the output is the normalized, weighted x itself (a one-term sum)
        x = randn(M, K, dtype=dtype, device=device)
        ws = [torch.eye(K, dtype=dtype, device=device)[:40].contiguous()]
        kw = dict(norm_weight=(torch.rand(K, device=device) + 0.5).to(dtype))
    else:
        ns, act = {"residual": ((40,), None), "qkv+residual": ((33, 5, 18), None),
                   "silu+residual": ((40, 40), "silu"), "gelu_tanh+residual": ((40, 40), "gelu_tanh")}[case]
        x = _grid_values(M, K, dtype=dtype, device=device, seed=1)
        ws = [_grid_values(n, K, dtype=dtype, device=device, seed=2 + i) for i, n in enumerate(ns)]
        r = randn(M, ns[0] if act else sum(ns), dtype=dtype, device=device, scale=4.0)
        kw = dict(activation=act, residual=r)
    y = decode_linear(x, ws, **kw, config=DecodeLinearConfig(16, 32, 4, 1, 2))  # split-K: exact sums add up exactly
    truncate = dtype == torch.bfloat16 and _bf16_cast_truncates(x.device)
    spec = _spec(x, ws, **kw, truncate=truncate)
    if case in ("residual", "qkv+residual"):
        assert torch.equal(y, spec), f"{case}: {(y != spec).sum().item()} of {y.numel()} elements differ"
    else:
        assert (y != spec).float().mean() <= 0.02, f"{case}: {(y != spec).sum().item()} of {y.numel()} differ"
        assert ((y.float() - spec.float()).abs() <= 2 * UNIT_ROUNDOFF[dtype] * spec.float().abs()).all()
    _assert_workspace_clean()


def test_default_config_on_cpu():
    assert dl._pick_config(1, 130, 33, False, True, 4, torch.device("cpu")) == DecodeLinearConfig(64, 64, 4, 1, 1)


# hidden -> (q width, k / v width, intermediate): Qwen2-1.5B (12 q heads, 2 KV heads of 128), the 1.5B Llama of
# benchmarks/bench_decode.py (32 q heads, 8 KV heads of 64), Llama-3-8B (32 q heads, 8 KV heads of 128).
MODELS = {1536: (1536, 256, 8960), 2048: (2048, 512, 8192), 4096: (4096, 1024, 14336)}
# The 16-bit H200 picks, snapshotted from _pick_config before the shared-memory rule (bf16 and fp16 alike).
PICKS_16BIT = {
    "qkv": {h: DecodeLinearConfig(32, 256, 4, 4, 1) for h in MODELS},
    "o_proj": {1536: DecodeLinearConfig(16, 256, 4, 4, 1), 2048: DecodeLinearConfig(16, 256, 4, 4, 1),
               4096: DecodeLinearConfig(32, 256, 4, 4, 1)},
    "gate_up": {h: DecodeLinearConfig(32, 256, 4, 3, 1) for h in MODELS},
    "down": {h: DecodeLinearConfig(64, 256, 4, 4, 4) for h in MODELS},
    "lm_head": {h: DecodeLinearConfig(32, 256, 4, 4, 1) for h in MODELS},
}


def _uses(hidden):
    """use -> (K, output columns, glu, norm) of a decoder's projections."""
    q, kv, inter = MODELS[hidden]
    return {"qkv": (hidden, q + 2 * kv, False, True), "o_proj": (hidden, hidden, False, False),
            "gate_up": (hidden, inter, True, True), "down": (inter, hidden, False, False),
            "lm_head": (hidden, 128256, False, False)}


@pytest.mark.parametrize("hidden", MODELS)
def test_default_configs_fit_hopper_shared_memory(monkeypatch, hidden):
    """On an H200 (132 SMs, 227 KiB a block) the default launch of every projection fits the shared-memory model
    in every dtype; the 16-bit picks are the measured ones, unchanged; fp32 only gives up stages."""
    monkeypatch.setattr(dl._launch, "sm_count", lambda index: 132)
    # the rule's launches (decode_linear_picks' measured entries are checked in test_decode_linear_picks.py)
    monkeypatch.setattr(dl, "_gpu_name", lambda index: None)
    cuda = torch.device("cuda", 0)
    for use, (K, N, glu, norm) in _uses(hidden).items():
        for dtype in DTYPES:
            esize = torch.empty(0, dtype=dtype).element_size()
            for M in (1, 8, 16):
                cfg = dl._pick_config.__wrapped__(M, K, N, glu, norm, esize, cuda, dl.SMEM_LIMIT)
                assert dl._smem_bytes(cfg, esize, glu, norm) <= 232448, (use, hidden, dtype, cfg)
                want = PICKS_16BIT[use][hidden]
                if esize == 2:
                    assert cfg == want, (use, hidden, dtype)
                else:
                    assert cfg.num_stages <= want.num_stages and cfg == dataclasses.replace(
                        want, num_stages=cfg.num_stages), (use, hidden, cfg)


# Shared memory Triton 3.6 allocates for the kernel on sm_90, fp32 (triton.compile(..., target=GPUTarget("cuda",
# 90, 32)) on a CPU host, EVEN_K, no residual): (config, glu, norm) -> metadata.shared. It keeps num_stages - 1
# buffers; the model counts num_stages. The old fp32 down_proj pick, 4 stages of 80 KiB, is the 240 KiB the
# H200 refused.
TRITON_SM90_FP32 = {
    ((32, 256, 4, 4, 1), False, True): 166912,
    ((32, 256, 4, 4, 1), False, False): 147456,
    ((16, 256, 4, 4, 1), False, False): 98304,
    ((32, 256, 4, 1, 1), False, True): 49152,
    ((32, 256, 4, 3, 1), True, True): 182272,
    ((32, 256, 4, 2, 1), True, True): 99328,
    ((64, 256, 4, 4, 4), False, False): 245760,
    ((64, 256, 4, 3, 4), False, False): 163840,
    ((64, 256, 4, 2, 4), False, False): 81920,
}


def test_smem_model_bounds_what_triton_allocates():
    for (ints, glu, norm), shared in TRITON_SM90_FP32.items():
        assert dl._smem_bytes(DecodeLinearConfig(*ints), 4, glu, norm) >= shared, (ints, glu, norm)
    assert TRITON_SM90_FP32[((64, 256, 4, 4, 4), False, False)] > dl.SMEM_LIMIT
    # x [16, 256] and one weight tile [64, 256] per stage, in 4 bytes; gate and up and the norm's extras with a GLU
    assert dl._smem_bytes(DecodeLinearConfig(64, 256, 4, 4, 4), 4, False, False) == 4 * (16 + 64) * 256 * 4
    assert dl._smem_bytes(DecodeLinearConfig(32, 256, 4, 3, 1), 2, True, True) == (
        3 * (16 * 256 + 2 * 32 * 256 + 256) + 16 * 256) * 2
    assert dl._fit_smem(DecodeLinearConfig(64, 256, 4, 4, 4), 4, False, False) == DecodeLinearConfig(64, 256, 4, 2, 4)
    assert dl._fit_smem(DecodeLinearConfig(64, 256, 4, 1, 4), 4, False, False, limit=40000) == DecodeLinearConfig(
        64, 64, 4, 1, 4)  # one stage left: narrower K steps


def test_config_is_a_frozen_validated_value():
    cfg = DecodeLinearConfig(32, 256, 4, 4, 1)
    with pytest.raises(AttributeError):
        cfg.block_n = 64  # frozen: a sweep passes another config, it never edits one
    assert DecodeLinearConfig(*cfg.ints()) == cfg
    for bad, match in (((24, 256), "block_n must be a power of two"), ((32, 8), "block_k must be >= 16"),
                       ((32, 256, 3), "num_warps must be a power of two"), ((32, 256, 4, 0), "num_stages must be"),
                       ((32, 256, 4, 3, True), "split_k must be an int"),
                       ((32, 256, 4, 3, 1, 3000), "stats_elems must be a power of two")):
        with pytest.raises(ValueError, match=f"DecodeLinearConfig: {match}"):
            DecodeLinearConfig(*bad)
    with pytest.raises(TypeError, match="decode_linear: config must be a tigon.ops.DecodeLinearConfig"):
        decode_linear(torch.ones(3, 16), torch.ones(8, 16), config=(16, 16, 4, 1, 1))


def test_large_gate_values_reach_both_activation_tails(device):
    # gate ~ N(0, 20^2): silu's and the tanh-gelu's exp overflow / underflow sides (no inf / NaN out).
    torch.manual_seed(3)
    x = randn(3, 64)
    gate, up = randn(24, 64, scale=2.5), randn(24, 64, scale=0.125)
    for act in ("silu", "gelu_tanh"):
        _check(act, x.to(device), [gate.to(device), up.to(device)], activation=act)


def test_eps_is_used(device):
    # A large eps moves the result well beyond rounding: the kernel must read the one it is given.
    x, ws, nw, _ = _inputs(torch.float32, 3, 77, (18,), device=device, norm=True)
    y_small = _check("eps small", x * 0.1, ws, norm_weight=nw, eps=1e-6)
    y_big = _check("eps big", x * 0.1, ws, norm_weight=nw, eps=0.5)
    assert (y_small - y_big).abs().max() > 0.1


# ----------------------------------------------------------------------------------------------------------
# Layouts


def test_leading_dims_and_one_dim_x(device):
    x, ws, nw, r = _inputs(torch.bfloat16, None, 77, (18, 5), device=device, lead=(2, 3), norm=True, residual=True)
    y = _check("x [2, 3, K]", x, ws, norm_weight=nw, residual=r)
    assert y.shape == (2, 3, 23)
    y1 = _check("x [K]", x[0, 1], ws, norm_weight=nw, residual=r[0, 1])
    assert y1.shape == (23,)
    torch.testing.assert_close(y1, y[0, 1], rtol=0, atol=0)
    # Leading dims that cannot be merged into one row stride (a permuted view): copied, same result.
    xp, rp = x.transpose(0, 1).contiguous().transpose(0, 1), r.transpose(0, 1).contiguous().transpose(0, 1)
    assert not xp.is_contiguous() and torch.equal(xp, x)
    assert torch.equal(_check("x [2, 3, K] permuted", xp, ws, norm_weight=nw, residual=rp), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_x_and_residual(device, dtype):
    torch.manual_seed(1)
    M, K, N = 17, 77, 33
    ws = [randn(N, K, dtype=dtype, device=device, scale=K**-0.5)]
    nw = (torch.rand(K, device=device) + 0.5).to(dtype)
    x_wide = randn(M, 2 * K + 3, dtype=dtype, device=device)
    r_wide = randn(M, 3 * N, dtype=dtype, device=device)
    views = {
        "column slices (row stride > K, unit last stride)": (x_wide[:, 3:K + 3], r_wide[:, N:2 * N]),
        "transposed (copied)": (randn(M, K, dtype=dtype, device=device, transposed=True),
                                randn(M, N, dtype=dtype, device=device, transposed=True)),
        "every other row": (x_wide[::2, :K], r_wide[::2, :N]),
        "stride-0 rows (expanded)": (x_wide[:1, :K].expand(4, K), r_wide[:1, :N].expand(4, N)),
    }
    for name, (x, r) in views.items():
        x_before, r_before = x.clone(), r.clone()
        y = _check(name, x, ws, norm_weight=nw, residual=r)
        y_contig = decode_linear(x.contiguous(), ws, norm_weight=nw, residual=r.contiguous())
        assert torch.equal(y, y_contig), name
        assert torch.equal(x, x_before) and torch.equal(r, r_before), f"{name}: an input was written"
        if name.startswith("stride-0"):
            assert (y == y[:1]).all()


def test_three_weights_match_one_at_a_time(device):
    """q, k, v of different N in one launch equal the three single-weight launches bit for bit (the same config
    tiles each weight from its own column 0). The kernel addresses weights 1 and 2 by element offsets from
    weight 0: separate allocations, row blocks of one buffer in reverse memory order (negative offsets), and
    one weight twice (offset 0)."""
    cfg = DecodeLinearConfig(16, 32, 4, 1, 2)
    x, _, nw, _ = _inputs(torch.float32, 3, 130, (), device=device, norm=True)
    torch.manual_seed(5)
    packed = randn(33 + 5 + 18, 130, device=device, scale=130**-0.5)
    wv, wk, wq = packed.split([18, 5, 33])  # memory order v, k, q: q's offsets to k and v are negative
    apart = {"q": wq.clone(), "k": wk.clone(), "v": wv.clone()}
    views = {"q": wq, "k": wk, "v": wv}
    # each weight alone, once, from its own allocation: every layout below must give these bits
    alone = {n: decode_linear(x, w, norm_weight=nw, config=cfg) for n, w in apart.items()}
    for source, order in ((apart, "qkv"), (views, "qkv"), (views, "vkq"), (views, "kkq")):
        y = _check(f"{order} {'apart' if source is apart else 'views'}", x, [source[n] for n in order],
                   norm_weight=nw, config=cfg)
        assert torch.equal(y, torch.cat([alone[n] for n in order], dim=-1)), order


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gate_up_halves_of_one_fused_weight(device, act):
    # A fused gate_up [2I, K] (Phi-3 style) passed as its two row halves: contiguous views of one buffer.
    torch.manual_seed(2)
    x = randn(3, 77, dtype=torch.bfloat16, device=device)
    gate_up = randn(2 * 20, 77, dtype=torch.bfloat16, device=device, scale=77**-0.5)
    gate, up = gate_up.chunk(2)
    assert gate.is_contiguous() and up.is_contiguous() and up.data_ptr() > gate.data_ptr()
    nw = (torch.rand(77, device=device) + 0.5).to(torch.bfloat16)
    y = _check(act, x, [gate, up], norm_weight=nw, activation=act)
    assert y.shape == (3, 20)
    assert torch.equal(y, decode_linear(x, [gate.clone(), up.clone()], norm_weight=nw, activation=act))
    # Swapped halves: up comes before gate in memory.
    _check(f"{act} swapped", x, [up, gate], norm_weight=nw, activation=act)


def test_empty_rows(device):
    x, ws, nw, r = _inputs(torch.float32, 3, 16, (8, 4), device=device, norm=True, residual=True)
    assert decode_linear(x[:0], ws, norm_weight=nw, residual=r[:0]).shape == (0, 12)
    assert decode_linear(x.view(1, 3, 16)[:, :0], ws).shape == (1, 0, 12)


# ----------------------------------------------------------------------------------------------------------
# Dispatch, compile


def test_runs_the_kernel_on_this_device(device):
    x, ws, nw, r = _inputs(torch.float32, 2, 16, (8,), device=device, norm=True, residual=True)
    before = ops.dispatch_counts[("decode_linear", "triton")]
    ref_before = ops.dispatch_counts[("decode_linear", "reference")]
    decode_linear(x, ws, norm_weight=nw, residual=r)
    decode_linear(x, ws[0])
    assert ops.dispatch_counts[("decode_linear", "triton")] == before + 2
    assert ops.dispatch_counts[("decode_linear", "reference")] == ref_before


def test_opcheck(device):
    split = DecodeLinearConfig(16, 16, 4, 1, 2).ints()  # through the split-K path and its workspace
    x, ws, nw, r = _inputs(torch.bfloat16, 3, 32, (16, 8), device=device, norm=True, residual=True)
    # aot_dispatch is left to the fullgraph compile test below (it alone takes seconds on the interpreter)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.tigon.decode_linear, (x, ws, nw, 1e-6, r, 0, split), test_utils=utils)
    glu = _inputs(torch.bfloat16, 3, 32, (8, 8), device=device)[1]
    torch.library.opcheck(torch.ops.tigon.decode_linear, (x, glu, None, 1e-6, None, 1), test_utils=utils)
    _assert_workspace_clean()


def test_compile_fullgraph_uses_the_custom_op(device, grids):
    # A config passed in reaches the custom op as plain ints: the traced launch is that config's (split 2).
    cfg = DecodeLinearConfig(16, 32, 4, 1, 2)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    x, ws, nw, r = _inputs(torch.float32, 3, 77, (18, 5), device=device, norm=True, residual=True)
    gate, up = _inputs(torch.float32, 3, 23, (8, 8), device=device)[1]

    def fn(x, r):
        h = decode_linear(x * 2, ws, norm_weight=nw, eps=1e-5, residual=r, config=cfg)
        return decode_linear(h, [gate, up], activation="silu") + 1

    torch._dynamo.reset()
    before = ops.dispatch_counts[("decode_linear", "triton")]
    got = torch.compile(fn, fullgraph=True, backend=backend)(x, r)
    assert ops.dispatch_counts[("decode_linear", "triton")] == before  # traced: no eager dispatch counted
    torch.testing.assert_close(got, fn(x, r), rtol=0, atol=0)
    assert (-(-18 // 16) + 1, 1, 2) in grids  # the first launch took the config's split
    _assert_workspace_clean()


# ----------------------------------------------------------------------------------------------------------
# Bad input


def _bad(**over):
    def call():
        torch.manual_seed(0)
        a = dict(x=randn(3, 16), weights=[randn(8, 16), randn(8, 16)], norm_weight=torch.ones(16), eps=1e-6,
                 residual=randn(3, 16), activation=None)
        a.update({n: (f(a) if callable(f) else f) for n, f in over.items()})
        x, weights = a.pop("x"), a.pop("weights")
        return decode_linear(x, weights, **a)
    return call


def _w(*shape, dtype=torch.float32):
    return lambda a: torch.ones(*shape, dtype=dtype)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (_bad(x=[[1.0] * 16]), TypeError, "decode_linear: x must be a torch.Tensor"),
        (_bad(x=lambda a: a["x"].long()), TypeError, "decode_linear: x must be float32, float16 or bfloat16"),
        (_bad(x=lambda a: a["x"].double()), TypeError, "decode_linear: x must be float32"),
        (_bad(x=torch.tensor(1.0)), ValueError, r"decode_linear: x must have shape \[\.\.\., K\]"),
        (_bad(x=lambda a: a["x"][:, :15]), ValueError, r"decode_linear: weights\[0\] must have shape \[N, K=15\]"),
        (_bad(weights=lambda a: [a["weights"][0], torch.ones(8, 17)]), ValueError,
         r"decode_linear: weights\[1\] must have shape \[N, K=16\], got \(8, 17\)"),
        (_bad(weights=_w(16)), ValueError, r"decode_linear: weights\[0\] must have shape \[N, K=16\]"),
        (_bad(weights=_w(1, 8, 16)), ValueError, r"decode_linear: weights\[0\] must have shape"),
        (_bad(weights=lambda a: [a["weights"][0], torch.ones(16, 8).t()]), ValueError,
         r"decode_linear: weights\[1\] must be contiguous"),
        (_bad(weights=lambda a: torch.ones(8, 32)[:, ::2]), ValueError, r"decode_linear: weights\[0\] must be "
         "contiguous"),
        (_bad(weights=lambda a: [torch.ones(8, 16)] * 4), TypeError,
         "decode_linear: weights must be a tensor or a list of 1 to 3 tensors"),
        (_bad(weights=[]), TypeError, "decode_linear: weights must be a tensor or a list of 1 to 3"),
        (_bad(weights=None), TypeError, "decode_linear: weights must be a tensor or a list"),
        (_bad(weights=lambda a: [a["weights"][0], "up"]), TypeError,
         r"decode_linear: weights\[1\] must be a torch.Tensor"),
        (_bad(weights=lambda a: a["weights"][:1], activation="silu", residual=None), ValueError,
         "decode_linear: activation='silu' needs exactly two weights"),
        (_bad(weights=lambda a: a["weights"] + a["weights"][:1], activation="gelu_tanh", residual=None),
         ValueError, "decode_linear: activation='gelu_tanh' needs exactly two weights .* got 3"),
        (_bad(activation="relu"), ValueError, "decode_linear: activation must be one of"),
        (_bad(activation="gelu"), ValueError, "decode_linear: activation must be one of"),
        (_bad(activation="SiLU"), ValueError, "decode_linear: activation must be one of"),
        (_bad(weights=lambda a: [a["weights"][0], torch.ones(9, 16)], activation="silu", residual=None),
         ValueError, r"decode_linear: gate \(8, 16\) and up \(9, 16\) weights differ"),
        (_bad(weights=lambda a: [a["weights"][0], a["weights"][1].bfloat16()]), TypeError,
         r"decode_linear: weights\[1\] has dtype torch.bfloat16 but x has dtype torch.float32"),
        (_bad(weights=lambda a: a["weights"][0].half()), TypeError, r"decode_linear: weights\[0\] has dtype"),
        (_bad(norm_weight=lambda a: a["norm_weight"].bfloat16()), TypeError, "decode_linear: norm_weight has dtype"),
        (_bad(residual=lambda a: a["residual"].half()), TypeError, "decode_linear: residual has dtype"),
        (_bad(norm_weight=lambda a: a["norm_weight"].long()), TypeError, "decode_linear: norm_weight has dtype"),
        (_bad(weights=lambda a: [a["weights"][0], a["weights"][1].to("meta")]), ValueError,
         r"decode_linear: weights\[1\] is on meta but x is on cpu"),
        (_bad(residual=lambda a: a["residual"][:, :15]), ValueError,
         r"decode_linear: residual must have shape \(3, 16\), got \(3, 15\)"),
        (_bad(residual=lambda a: a["residual"][:1]), ValueError, r"decode_linear: residual must have shape \(3, 16\)"),
        (_bad(residual=lambda a: a["residual"].view(3, 1, 16)), ValueError, "decode_linear: residual must have"),
        (_bad(activation="silu"), ValueError, r"decode_linear: residual must have shape \(3, 8\), got \(3, 16\)"),
        (_bad(norm_weight=lambda a: a["norm_weight"][:15]), ValueError,
         r"decode_linear: norm_weight must have shape \(16,\), got \(15,\)"),
        (_bad(norm_weight=lambda a: a["norm_weight"].view(1, 16)), ValueError,
         r"decode_linear: norm_weight must have shape \(16,\)"),
        (_bad(eps=0.0), ValueError, "decode_linear: eps must be a finite number > 0, got 0.0"),
        (_bad(eps=-1e-6), ValueError, "decode_linear: eps must be a finite number > 0"),
        (_bad(eps=float("nan")), ValueError, "decode_linear: eps must be a finite number > 0"),
        (_bad(eps=float("inf")), ValueError, "decode_linear: eps must be a finite number > 0"),
        (_bad(eps=True), ValueError, "decode_linear: eps must be a finite number > 0"),
        (_bad(eps="1e-6"), ValueError, "decode_linear: eps must be a finite number > 0"),
        (_bad(eps=None), ValueError, "decode_linear: eps must be a finite number > 0"),
        (_bad(x=lambda a: a["x"].requires_grad_()), RuntimeError, "decode_linear: inference only"),
        (_bad(weights=lambda a: [a["weights"][0].requires_grad_(), a["weights"][1]]), RuntimeError,
         "decode_linear: inference only"),
        (_bad(norm_weight=lambda a: a["norm_weight"].requires_grad_()), RuntimeError, "decode_linear: inference"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_tensors_that_require_grad_are_fine_under_no_grad(device):
    x, ws, nw, r = _inputs(torch.float32, 3, 16, (8,), device=device, norm=True, residual=True)
    with torch.no_grad():
        y = decode_linear(x.requires_grad_(), [w.requires_grad_() for w in ws], norm_weight=nw, residual=r)
    assert not y.requires_grad
    torch.testing.assert_close(y, reference.decode_linear(x.detach(), [w.detach() for w in ws], norm_weight=nw,
                                                          residual=r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(norm_weight=[1.0] * 16), dict(residual=[[0.0] * 8] * 3),
                                dict(activation=["silu"])], ids=["norm_weight", "residual", "activation"])
def test_bad_argument_types_name_the_op(kw):
    with pytest.raises((TypeError, ValueError), match="decode_linear: (norm_weight|residual|activation)"):
        decode_linear(torch.ones(3, 16), torch.ones(8, 16), **kw)


@pytest.mark.skipif(not _library.interpreter_on(), reason="CPU tensors reach the split-K kernel only through "
                    "Triton's interpreter; without it (a CUDA machine) they run the reference, which has no splits")
def test_split_k_sums_in_split_order_every_call():
    # The partial tiles are summed by the last split in split order (not by float atomics in arrival order):
    # repeated calls give the same bits, and those are the bits of the kernel's own per-split products (one
    # launch per 16-wide K slice: the same tile, the same tl.dot) added in split order. torch's products of the
    # slices would sum within each slice in the host BLAS's order: the fp64 value is held to the fp32 model.
    cfg, one_split = DecodeLinearConfig(16, 16, 4, 1, 4), DecodeLinearConfig(16, 16, 4, 1, 1)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 64, generator=g), torch.randn(24, 64, generator=g)
    with torch.no_grad():
        first = decode_linear(x, w, config=cfg)
        assert all(torch.equal(first, decode_linear(x, w, config=cfg)) for _ in range(3))
        parts = [decode_linear(x[:, i:i + 16], w[:, i:i + 16].contiguous(), config=one_split)
                 for i in range(0, 64, 16)]
    assert torch.equal(first, ((parts[0] + parts[1]) + parts[2]) + parts[3])
    assert not torch.equal(first, ((parts[3] + parts[2]) + parts[1]) + parts[0])  # the order shows in the bits
    assert_tol("split-K vs fp64", first, *_exact_and_fp32_tol(x, w))
    _assert_workspace_clean()


@pytest.mark.parametrize("case", ["norm+qkv+residual", "norm+silu+residual", "gelu_tanh"])
def test_fp32_model_rejects_a_wrong_output(device, case):
    """The kernel's fp32 output passes the model's bound (using at most 0.02 of it here); the same output 1e-3
    off (79x the bound or more at its worst element), or one that lost a term of the math (the residual, the norm
    weight, the last K column), fails it."""
    act = {"norm+qkv+residual": None, "norm+silu+residual": "silu", "gelu_tanh": "gelu_tanh"}[case]
    ns = (33, 5, 18) if act is None else (40, 40)
    norm, res = case.startswith("norm"), case.endswith("residual")
    x, ws, nw, r = _inputs(torch.float32, 3, 130, ns, device=device, norm=norm, residual=res, glu=bool(act))
    kw = dict(norm_weight=nw, residual=r, activation=act)
    y = decode_linear(x, ws, **kw)
    exact, tol = _exact_and_fp32_tol(x, ws, **kw)
    assert_tol(case, y, exact, tol)
    wrong = {"1e-3 off": y * (1 + 1e-3),
             "last K column dropped": decode_linear(x[:, :-1].contiguous(), [w[:, :-1].contiguous() for w in ws],
                                                    **dict(kw, norm_weight=None if nw is None else nw[:-1]))}
    if res:
        wrong["residual dropped"] = decode_linear(x, ws, **dict(kw, residual=None))
    if norm:
        wrong["norm weight dropped"] = decode_linear(x, ws, **dict(kw, norm_weight=torch.ones_like(nw)))
    for what, bad in wrong.items():
        with pytest.raises(AssertionError, match=f"{what}: err"):
            assert_tol(what, bad, exact, tol)


def test_no_features_is_refused():
    with pytest.raises(ValueError, match="decode_linear: x must have K >= 1"):
        decode_linear(torch.ones(2, 0), torch.ones(3, 0))


def test_split_k_scratch_is_one_pinned_arena_buffer(device):
    # Two calls of one shape get the same split-K partials and counters (a stable address: what a captured decode
    # step replays) and allocate nothing the second time; the arena's stats count both calls.
    torch.manual_seed(0)
    x, w = randn(2, 130, device=device), randn(33, 130, device=device)
    ws = _rolling_buffer.workspace(device)
    cfg = DecodeLinearConfig(16, 64, 4, 1, 2)
    ptrs = []
    for _ in range(2):
        before = ws.stats()
        y = decode_linear(x, w, config=cfg)
        after = ws.stats()
        ptrs.append([b.data_ptr() for (name, _, _), b in ws._pinned.items() if name.startswith("decode_linear.")])
        assert after["pinned_calls"] == before["pinned_calls"] + 2  # partials and counters
    assert len(ptrs[0]) == 2 and ptrs[0] == ptrs[1]
    assert after["pinned_hits"] == before["pinned_hits"] + 2 and after["pinned_bytes"] == before["pinned_bytes"]
    assert after["pinned_bytes"] >= (1 << 18) * 4 + (1 << 12) * 4
    torch.testing.assert_close(y, reference.decode_linear(x, (w,)), rtol=1e-5, atol=1e-5)
    _assert_workspace_clean()


def test_stats_elems_sets_the_statistics_step(device, monkeypatch):
    """DecodeLinearConfig.stats_elems reaches the launch: 9 rows (16 statistics rows) of K = 1100 in 64-wide
    steps (1024 / 16) instead of the default's 512, and the result stays within the error model."""
    spy = KernelSpy(dl._decode_linear_kernel)
    monkeypatch.setattr(dl, "_decode_linear_kernel", spy)
    x, ws, nw, r = _inputs(torch.float32, 9, 1100, (18,), device=device, norm=True, residual=True, seed=3)
    for cfg in (DecodeLinearConfig(16, 64, 4, 1, 1), DecodeLinearConfig(16, 64, 4, 1, 1, stats_elems=1024)):
        _check(f"stats_elems={cfg.stats_elems}", x, ws, norm_weight=nw, residual=r, eps=1e-5, config=cfg)
    assert [(c["STATS_M"], c["STATS_K"]) for c in spy.calls] == [(16, 512), (16, 64)]
