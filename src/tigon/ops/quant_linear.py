"""Weight-only quantized linear layers: y = x @ W^T with W kept in 4 or 8 bits (a `QuantizedWeight`), dequantized in
registers; activations are never quantized. docs/ops/quant_linear.md has the formats, the byte model and the design.

Both kernels read W in tiles of [BLOCK_N, GPT, GW]: GPT chunks of GW columns along K, each chunk inside one scale
group (GW = the largest power of two dividing both the group size and BLOCK_K), so a [BLOCK_N, GPT] tile of
scales serves a tile.
- `_quant_gemv_kernel`, the decode step (M <= `gemv_max_rows`, default 1): CUDA-core FMAs, one row of x a
  program; each chunk is summed against x and scaled once (s * sum(v x), v the stored value), split-K filling the
  GPU, the splits summed in a fixed order by the last program of a tile to arrive.
- `_quant_mm_kernel`, the rest (a few decode rows on tensor cores with M padded to 16, and the prefill GEMM): each
  tile is dequantized in fp32, rounded to x's dtype and fed to `tl.dot` (fp32 accumulation); fp8 tiles with one
  scale a row are exact in x's dtype and scaled after the dot.
- `_quant_code_mma_kernel` (ops/quant_code_mma.py, `QuantLinearConfig(code_mma=1)`): int4 with 16-bit x on tensor
  cores, the codes as the dot's register operand in a K order that keeps each thread's words its own: the decode
  GEMV at up to 16 rows, a GEMM past them; the default at 2 to 16 rows on Hopper GPUs (`_mma_by_rule`), else
  where a config or a measured pick turns it on.
- `_dequant_kernel`, the prefill path (M >= `dequant_min_rows`, default 256 on a GPU, 16-bit x): W dequantized once
  into a transient [N, K] buffer of x's dtype by the mm kernel's own tile code, then one cuBLAS GEMM and the
  epilogue in torch; at prefill rows the GEMM's FLOPs, not the weight's bytes, set the time.
int4 is read as 32-bit words of 8 codes, each code turned into the fp32 1 + q / 16 by a shift and a LOP3 (no
int -> float conversion); nf4 and fp4 codes index a 256 x 2 table (the value pair of a byte: one 8-byte gather a
byte), the same code with each kind's table (`KERNEL_KIND`); `perm` is applied to x's columns in the loads.
Inference only.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from . import _launch, _library, _pdl, quant_linear_picks, reference
from . import _rolling_buffer as _ws
from . import quant_code_mma as _mma
from . import swiglu as _glu
from ._quant_tiles import _finish, _gemv_sum, _load_scales, _load_tile, _mm_tile, _scaled, _values, _x_tile
from .config import QuantLinearConfig
from .decode_linear import _gpu_name
from .quantized_weight import TABLES, QuantizedWeight, linear_reference

ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2}
# A weight kind's number: the op's `kind` argument (what `_launch_kernel` and `_dequant` take)
KIND_CODES = {"int4": 0, "nf4": 1, "fp8": 2, "fp4": 3}
_KIND_NAMES = {code: kind for kind, code in KIND_CODES.items()}
# The kernels' code path for a weight kind (their constexpr KIND): 0 int4 affine (a shift and a LOP3), 1 a 4-bit
# table lookup through T (nf4 and fp4, each with its own table: `_pairs`), 2 fp8
KERNEL_KIND = {"int4": 0, "nf4": 1, "fp8": 2, "fp4": 1}
OP = "tigon.ops.quant_linear"


_DEFAULT_CONFIG = QuantLinearConfig()


@triton.jit(do_not_specialize=["M", "N"])  # N: may be 1, and `N.to` must see a tensor
def _quant_gemv_kernel(
    X,  # [M, K] activations, unit stride on K
    D,  # [N, K // 2] uint8 (int4, nf4) or [N, K] float8_e4m3fn (its bytes with FP8_BITS) data, unit stride on K
    S, Z,  # scales [N, K / G] (int4, nf4), [N] (fp8 per channel) or [ceil(N / G), ceil(K / G)] (fp8); zeros like S
    P,  # [K] int perm: stored column j multiplies x[:, P[j]] (read when HAS_PERM)
    T,  # [256, 2] fp32: the table's values of each byte's (low, high) nibbles (read for KIND 1: nf4, fp4)
    BIAS, R, Y,  # [N] bias, [M, N_OUT] residual, [M, N_OUT] output
    WS, CNT,  # fp32 [SPLIT_K, M, N] split-K partials; int32 [tiles] zeroed arrival counters
    M, N, K, N_OUT, K_SPLIT,
    stride_xm, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg, stride_rm, stride_ym,
    G: tl.constexpr,  # group size (int4, nf4), block size (fp8; 1 per channel)
    KIND: tl.constexpr, WORDS: tl.constexpr, FP8_BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    RESIDUAL: tl.constexpr, PER_CHANNEL: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, GPT: tl.constexpr, GW: tl.constexpr, PREFETCH: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX (a GPU; the interpreter has none)
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    pid_k = tl.program_id(2)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N_OUT
    o_x = tl.arange(0, GPT)[:, None] * GW + tl.arange(0, GW)[None, :]  # [GPT, GW] column offsets in a tile
    p_x = X + row.to(tl.int64) * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, GPT], dtype=tl.float32)
    if PDL:
        _pdl.wait(PDL)
    if PREFETCH:
        # Triton's pipeliner stages only the loads that feed a tl.dot: here the next tile's loads are issued by hand
        # before this tile's math (two tiles in flight a program, at twice the registers: half the programs an SM)
        w, s, z = _load_tile(D, S, Z, o_n, m_n, k_lo, k_hi, G, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg,
                             KIND, WORDS, HAS_ZEROS, not PER_CHANNEL, EVEN_K, GPT, GW)
        w_u, s_u, z_u = w, s, z
        if ACT != 0:  # up's rows sit N_OUT below gate's
            w_u, s_u, z_u = _load_tile(D, S, Z, o_n + N_OUT, m_n, k_lo, k_hi, G, stride_dn, stride_sn, stride_sg,
                                       stride_zn, stride_zg, KIND, WORDS, HAS_ZEROS, not PER_CHANNEL, EVEN_K, GPT, GW)
        x = _x_tile(p_x, P, o_x, k_lo, k_hi, HAS_PERM)
        for k0 in range(k_lo, k_hi, GPT * GW):
            k1 = k0 + GPT * GW
            w1, s1, z1 = _load_tile(D, S, Z, o_n, m_n, k1, k_hi, G, stride_dn, stride_sn, stride_sg, stride_zn,
                                    stride_zg, KIND, WORDS, HAS_ZEROS, not PER_CHANNEL, EVEN_K, GPT, GW)
            x1 = _x_tile(p_x, P, o_x, k1, k_hi, HAS_PERM)
            xf = x.to(tl.float32)
            sx = tl.sum(xf, axis=1)
            acc += _gemv_sum(w, s, z, T, xf, sx, KIND, WORDS, FP8_BITS, ASM, PER_CHANNEL, GPT, GW)
            if ACT != 0:
                w1_u, s1_u, z1_u = _load_tile(D, S, Z, o_n + N_OUT, m_n, k1, k_hi, G, stride_dn, stride_sn,
                                              stride_sg, stride_zn, stride_zg, KIND, WORDS, HAS_ZEROS,
                                              not PER_CHANNEL, EVEN_K, GPT, GW)
                acc_u += _gemv_sum(w_u, s_u, z_u, T, xf, sx, KIND, WORDS, FP8_BITS, ASM, PER_CHANNEL, GPT, GW)
                w_u, s_u, z_u = w1_u, s1_u, z1_u
            w, s, z, x = w1, s1, z1, x1
    else:
        for k0 in range(k_lo, k_hi, GPT * GW):
            w, s, z = _load_tile(D, S, Z, o_n, m_n, k0, k_hi, G, stride_dn, stride_sn, stride_sg, stride_zn,
                                 stride_zg, KIND, WORDS, HAS_ZEROS, not PER_CHANNEL, EVEN_K, GPT, GW)
            xf = _x_tile(p_x, P, o_x, k0, k_hi, HAS_PERM).to(tl.float32)
            sx = tl.sum(xf, axis=1)
            acc += _gemv_sum(w, s, z, T, xf, sx, KIND, WORDS, FP8_BITS, ASM, PER_CHANNEL, GPT, GW)
            if ACT != 0:
                w_u, s_u, z_u = _load_tile(D, S, Z, o_n + N_OUT, m_n, k0, k_hi, G, stride_dn, stride_sn, stride_sg,
                                           stride_zn, stride_zg, KIND, WORDS, HAS_ZEROS, not PER_CHANNEL, EVEN_K,
                                           GPT, GW)
                acc_u += _gemv_sum(w_u, s_u, z_u, T, xf, sx, KIND, WORDS, FP8_BITS, ASM, PER_CHANNEL, GPT, GW)
    if PDL:
        _pdl.start(PDL)
    o_m = tl.zeros([1], dtype=tl.int32) + row
    _finish(tl.sum(acc, axis=1)[None, :], tl.sum(acc_u, axis=1)[None, :], S, BIAS, R, Y, WS, CNT,
            row * tl.num_programs(0) + pid_n, pid_k, o_m, o_m < M, o_n, m_n, M, N, N_OUT, stride_sn, stride_rm,
            stride_ym, HAS_BIAS, ACT, RESIDUAL, PER_CHANNEL, SPLIT_K, False)


@triton.jit(do_not_specialize=["N"])
def _dequant_kernel(
    D, S, Z, T,  # as in _quant_gemv_kernel
    W,  # [N, K] out, x's dtype: the stored weight (columns in stored order; fp8 per channel: unscaled)
    N, K, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg, stride_wn,
    G: tl.constexpr, KIND: tl.constexpr, WORDS: tl.constexpr, FP8_BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
    PER_CHANNEL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, GPT: tl.constexpr, GW: tl.constexpr,
    ASM: tl.constexpr,
):
    """One [BLOCK_N, GPT * GW] tile of W a program, through the mm kernel's own `_load_tile`, `_values` and
    `_scaled`: each element its fp32 value rounded once to W's dtype, as the mm kernel's tile before its dot.
    fp8 with one scale a row is written exact and scaled after the GEMM (the mm kernel's order); fp8 blocks are
    scaled here, as the mm kernel does where a tile spans several blocks' chunks."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    k0 = tl.program_id(1) * (GPT * GW)
    raw, s, z = _load_tile(D, S, Z, o_n, m_n, k0, K, G, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg,
                           KIND, WORDS, HAS_ZEROS, not PER_CHANNEL, EVEN_K, GPT, GW)
    w = _values(raw, T, KIND, WORDS, FP8_BITS, ASM, GPT, GW)
    if not PER_CHANNEL:
        w = _scaled(w, s, z, KIND)
    kk = k0 + tl.arange(0, GPT * GW)
    tl.store(W + o_n.to(tl.int64)[:, None] * stride_wn + kk[None, :],
             tl.reshape(w, [BLOCK_N, GPT * GW]).to(W.dtype.element_ty), mask=m_n[:, None] & (kk < K)[None, :])


@triton.jit(do_not_specialize=["M", "N"])  # N: may be 1, and `N.to` must see a tensor
def _quant_mm_kernel(
    X, D, S, Z, P, T, BIAS, R, Y, WS, CNT,  # as in _quant_gemv_kernel
    M, N, K, N_OUT, K_SPLIT,
    stride_xm, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg, stride_rm, stride_ym,
    G: tl.constexpr,  # group size (int4, nf4), block size (fp8; 1 per channel)
    KIND: tl.constexpr, WORDS: tl.constexpr, FP8_BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    RESIDUAL: tl.constexpr, PER_CHANNEL: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GPT: tl.constexpr, GW: tl.constexpr, GROUP_M: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    SCALES_AHEAD: tl.constexpr,  # the next step's scales loaded before this step's math (not per channel)
):
    # GROUP_M row blocks share a band of column blocks, so their weight tiles are read from L2 after the first
    tile = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_blocks = tl.cdiv(N_OUT, BLOCK_N)
    first_m = tile // (GROUP_M * n_blocks) * GROUP_M
    rows_in_group = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + tile % (GROUP_M * n_blocks) % rows_in_group
    pid_n = tile % (GROUP_M * n_blocks) // rows_in_group
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N_OUT
    o_k = tl.arange(0, GPT * GW)
    p_x = X + o_m.to(tl.int64)[:, None] * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PDL:
        _pdl.wait(PDL)
    # bf16 scales are 2 B a thread, under cp.async's 4 B: the pipeliner leaves them as loads waited every step
    # (docs/ops/quant_decode_rows_model.md); SCALES_AHEAD issues the next step's with this step's math
    if SCALES_AHEAD:
        s, z = _load_scales(S, Z, o_n, m_n, k_lo, k_hi, G, stride_sn, stride_sg, stride_zn, stride_zg, KIND,
                            HAS_ZEROS, GPT, GW)
    else:
        s, z = acc, acc  # unused
    s_u, z_u = s, z
    if SCALES_AHEAD and ACT != 0:
        s_u, z_u = _load_scales(S, Z, o_n + N_OUT, m_n, k_lo, k_hi, G, stride_sn, stride_sg, stride_zn, stride_zg,
                                KIND, HAS_ZEROS, GPT, GW)
    for k0 in range(k_lo, k_hi, GPT * GW):
        kk = k0 + o_k
        m_k = kk < K
        if HAS_PERM:
            kk = tl.load(P + kk, mask=m_k, other=0)
        x = tl.load(p_x + kk[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        s1, z1, s1_u, z1_u = s, z, s_u, z_u
        if SCALES_AHEAD:  # the next step's (0 past k_hi)
            s1, z1 = _load_scales(S, Z, o_n, m_n, k0 + GPT * GW, k_hi, G, stride_sn, stride_sg, stride_zn,
                                  stride_zg, KIND, HAS_ZEROS, GPT, GW)
            if ACT != 0:
                s1_u, z1_u = _load_scales(S, Z, o_n + N_OUT, m_n, k0 + GPT * GW, k_hi, G, stride_sn, stride_sg,
                                          stride_zn, stride_zg, KIND, HAS_ZEROS, GPT, GW)
        acc += _mm_tile(x, D, T, S, Z, o_n, m_n, k0, k_hi, G, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg,
                        KIND, WORDS, FP8_BITS, HAS_ZEROS, PER_CHANNEL, EVEN_K, UPCAST, PRECISION, ASM, GPT,
                        GW, s, z, SCALES_AHEAD)
        if ACT != 0:
            acc_u += _mm_tile(x, D, T, S, Z, o_n + N_OUT, m_n, k0, k_hi, G, stride_dn, stride_sn, stride_sg, stride_zn,
                              stride_zg, KIND, WORDS, FP8_BITS, HAS_ZEROS, PER_CHANNEL, EVEN_K, UPCAST, PRECISION,
                              ASM, GPT, GW, s_u, z_u, SCALES_AHEAD)
        s, z, s_u, z_u = s1, z1, s1_u, z1_u
    if PDL:
        _pdl.start(PDL)
    _finish(acc, acc_u, S, BIAS, R, Y, WS, CNT, tile, pid_k, o_m, m_m, o_n, m_n, M, N, N_OUT, stride_sn,
            stride_rm, stride_ym, HAS_BIAS, ACT, RESIDUAL, PER_CHANNEL, SPLIT_K, False)


@functools.lru_cache(maxsize=16)
def _pairs(kind: str, device: torch.device) -> torch.Tensor:
    """The kernels' T for a table kind (nf4, fp4): [256, 2] fp32, TABLES[kind][byte & 15], TABLES[kind][byte >> 4]
    for every byte (made once a kind and device: warm up before a CUDA graph capture, like every first call)."""
    table, b = torch.tensor(TABLES[kind], dtype=torch.float32), torch.arange(256)
    return torch.stack((table[b & 15], table[b >> 4]), dim=1).contiguous().to(device)


def _kernel_args(kind: int, scales: torch.Tensor, zeros: torch.Tensor | None):
    """(KIND, T, zeros) for the op's `kind` (KIND_CODES): the kernels' code path, the table (the scales where none
    is read) and the zero points (int4's only: `dequantize` reads none for the other kinds)."""
    name = _KIND_NAMES[kind]
    path = KERNEL_KIND[name]
    table = _pairs(name, scales.device) if path == 1 else scales
    return path, table, zeros if path == 0 else None


@functools.lru_cache(maxsize=16)
def _fp8_native(device: torch.device) -> bool:
    """Whether Triton converts float8_e4m3fn on `device`: from sm_89 (and in the interpreter); before, the kernels
    decode the bytes (`_values`)."""
    return device.type != "cuda" or _launch.capability(device) >= (8, 9)


@dataclasses.dataclass(frozen=True)
class _Plan:
    gemv: bool
    block_m: int
    block_n: int
    gw: int  # columns of a chunk under one scale
    gpt: int  # chunks a tile: BLOCK_K = gpt * gw
    num_warps: int
    num_stages: int
    k_split: int
    split: int
    prefetch: bool
    dequant: bool = False  # the prefill path: `_dequant_kernel` tiles of block_n x gpt * gw, then cuBLAS
    mma: bool = False  # the code-MMA kernel (`quant_code_mma`): block_n rows, K steps of 128 columns, dots of gw


@functools.lru_cache(maxsize=1024)
def _plan(M: int, n_out: int, K: int, kind: str, G: int, glu: bool, device: torch.device,
          cfg: QuantLinearConfig, picks: bool = False, zeros: bool = False, x16: bool = False) -> _Plan:
    """The launch for these shapes (cached: no host work a call); every field of `cfg` that is not 0 wins.
    kind: a weight kind (KINDS); fp4 plans as nf4, the same code path and bytes with another table.
    picks (no config passed, 16-bit x; zeros: int4 with zero points): on a CUDA device, a measured pick for this GPU
    and shape (`quant_linear_picks.lookup`: the user cache, then MEASURED_PICKS; up to 128 rows) replaces the default
    config, and the rule below fills what the pick leaves 0. GPU
    defaults, by the byte model in docs/ops/quant_linear.md (where a card has no picks): the GEMV streams 64 rows
    x 256 columns a step (8 KiB of int4 a program, 16 B a lane on 4 warps); the decode dot 16 x 128 x 64 tiles;
    the prefill GEMM 64 or 128 x 128 x 64. Rows <= 16 split K until enough programs stream the weight (below);
    the interpreter splits in 2, so the tests' default launches sum splits. From `dequant_min_rows` rows (256 on a
    GPU) the dequantization's tiles: 32 x 256, 16 KiB of bf16 written a program (at the copy rate on an H100).
    x16: x is bf16 or fp16, which `code_mma` needs (with int4 and the shapes `quant_code_mma.eligible` names)."""
    gpu = device.type == "cuda"
    if kind == "fp4":
        kind = "nf4"
    if picks and gpu and cfg == _DEFAULT_CONFIG:
        pick = quant_linear_picks.lookup(_gpu_name(device.index or 0), K, n_out, M,
                                         quant_linear_picks.format_of(kind, zeros), G, glu)
        if pick is not None:
            cfg = QuantLinearConfig(*pick)
    if x16 and _mma.eligible(kind, K, G) and (cfg.code_mma == 1 or _mma_by_rule(M, cfg, device)):
        return _mma_plan(M, n_out, K, glu, device, cfg)
    gemv = M <= (1 if cfg.gemv_max_rows < 0 else cfg.gemv_max_rows)
    pow2_g = G & -G  # the largest power of two dividing the group (fp8 per channel: G = 0, one chunk a tile)
    dequant_rows = cfg.dequant_min_rows if cfg.dequant_min_rows >= 0 else (256 if gpu else 0)
    if not gemv and 0 < dequant_rows <= M:
        block_n, block_k = cfg.block_n or (32 if gpu else 64), cfg.block_k or (256 if gpu else 128)
        block_k = min(block_k, max(16, _launch.next_power_of_2(K)))
        gw = block_k if G == 0 else min(pow2_g, block_k)
        return _Plan(False, 1, block_n, gw, block_k // gw, cfg.num_warps or 4, 1, K, 1, False, dequant=True)
    # (block_m, block_n, block_k, num_warps, num_stages), from the sm_90 SASS of each kernel (docs/ops/quant_linear.md,
    # "Instructions an element"): wider column blocks spread x's conversion and the per-step overhead over more
    # weight elements; nf4 keeps 32 columns (its gathers need the registers). The interpreter pays per program and
    # per op, not per element: one or two wide tiles over the tests' shapes.
    if gemv:
        picked = (1, 32 if kind == "nf4" else 64, 256, 4, 1) if gpu else (1, 64, 128, 4, 1)
    elif M <= _launch.DECODE_ROWS:
        picked = (16, 64 if glu else 128, 64, 4, 3) if gpu else (16, 64, 128, 4, 1)
    elif gpu:
        # a GLU keeps two accumulators: 64 columns (128 x 128 x 2 fp32 spilled on sm_90 in fp8)
        picked = (64, 64 if glu else 128, 64, 4, 3) if M <= 64 else (128, 64 if glu else 128, 64, 8, 3)
    else:
        picked = (32, 64, 128, 4, 1)
    block_m, block_n, block_k, warps, stages = picked
    if not gemv:
        block_m = cfg.block_m or block_m
    block_n = cfg.block_n or block_n if gemv else max(16, cfg.block_n or block_n)  # tl.dot: >= 16
    block_k = min(cfg.block_k or block_k, max(16, _launch.next_power_of_2(K)))
    if kind == "fp8" and not gemv and 16 <= pow2_g < block_k:
        block_k = pow2_g  # one fp8 block a tile: the dot runs on exact fp8 values, scaled after
    gw = block_k if G == 0 else min(pow2_g, block_k)
    split = cfg.split_k
    if not split and M <= _launch.DECODE_ROWS:
        steps = _launch.cdiv(K, block_k)
        if gpu:
            # programs an SM: the GEMV 8 (~64 registers a thread at 4 warps on sm_90: 8 fit), 4 with a GLU (~128
            # registers) and in the dot kernel; the most splits under that which divide the K steps evenly and leave
            # each split two steps
            tiles = _launch.cdiv(n_out, block_n) * (M if gemv else 1)
            want = (4 if glu or not gemv else 8) * _launch.sm_count(device.index or 0) / tiles
            split = max([d for d in range(1, steps // 2 + 1) if steps % d == 0 and d <= max(want, 1)], default=1)
        else:
            split = 2  # the tests' default launches sum two splits
    split = split or 1
    k_split = _launch.cdiv(_launch.cdiv(K, split), block_k) * block_k
    return _Plan(gemv, block_m, block_n, gw, block_k // gw, cfg.num_warps or warps, cfg.num_stages or stages,
                 k_split, _launch.cdiv(K, k_split), cfg.prefetch == 1)


def _mma_by_rule(M: int, cfg: QuantLinearConfig, device: torch.device) -> bool:
    """Whether a launch with no config and no pick runs the code-MMA kernel: 2 to 16 rows on a Hopper GPU (sm_90,
    CUDA), where its wgmma tiles beat the tensor-core decode kernel's rule on every Llama-3-8B launch timed (H100,
    8 rows, 40189fe: 1.18-1.76x, docs/ops/quant_linear.md); one row stays the FMA GEMV's, other architectures the
    decode kernel's (untimed there)."""
    if cfg != _DEFAULT_CONFIG or not 1 < M <= _launch.DECODE_ROWS or device.type != "cuda" or torch.version.hip:
        return False
    return _launch.capability(device)[0] == 9


def _mma_plan(M: int, n_out: int, K: int, glu: bool, device: torch.device, cfg: QuantLinearConfig) -> _Plan:
    """The code-MMA kernel's launch. Up to 16 rows (the decode GEMV): 128 weight rows a program on 4 warps (one
    warpgroup: two m64 wgmmas a K step of 128 columns), x's rows padded to 16, Triton's three pipeline stages, K
    split as the other decode kernels' (4 programs an SM at ~128-170 registers, 2 with a GLU). More rows (a GEMM):
    tiles of 128 weight rows x 128 rows of x (64 with a GLU's two accumulators) on 8 warps, no split: the sm_90 SASS
    fits them without spills (222 and 227 registers), and a K step issues ~670 cycles against ~1020 of tensor work.
    The interpreter: 64 weight rows, one stage, two splits where K allows."""
    gpu = device.type == "cuda"
    gemm = M > _mma.MAX_ROWS
    block_m = max(16, cfg.block_m or ((64 if glu else 128) if gemm else _mma.MAX_ROWS))
    block_n = max(16, cfg.block_n or (128 if gpu else 64))
    steps = _launch.cdiv(K, _mma.COLUMNS)
    split = cfg.split_k
    if not split and gemm:
        split = 1
    elif not split and gpu:
        want = (2 if glu else 4) * _launch.sm_count(device.index or 0) / _launch.cdiv(n_out, block_n)
        split = max([d for d in range(1, steps // 2 + 1) if steps % d == 0 and d <= max(want, 1)], default=1)
    elif not split:
        split = 2 if steps % 2 == 0 else 1
    k_split = _launch.cdiv(steps, split) * _mma.COLUMNS
    dot_k = min(max(cfg.block_k or _mma.COLUMNS, 32), _mma.COLUMNS)  # a dot's columns (gw): 32, 64 or 128
    return _Plan(False, block_m, block_n, dot_k, 1, cfg.num_warps or (8 if gemm and gpu else 4),
                 cfg.num_stages or (3 if gpu else 1), k_split, _launch.cdiv(K, k_split), False, mma=True)


@functools.lru_cache(maxsize=64)
def _without_mma(cfg: QuantLinearConfig) -> QuantLinearConfig:
    """cfg with the code-MMA kernel off (a weight whose codes are not whole aligned words), made once a config."""
    return dataclasses.replace(cfg, code_mma=0)


@functools.lru_cache(maxsize=64)
def _without_dequant(cfg: QuantLinearConfig) -> QuantLinearConfig:
    """cfg with the prefill path off (fp32 x), made once a config: no host work a call."""
    return dataclasses.replace(cfg, dequant_min_rows=0)


def _word_aligned(data) -> bool:
    """Whether the rows of 4-bit codes (unit stride along K, or copied so) can be read as 32-bit words."""
    return data.stride(-1) != 1 or (data.shape[1] % 4 == 0 and data.stride(0) % 4 == 0
                                    and data.storage_offset() % 4 == 0)


def _stored(data, path, gw, device):
    """(data, words, fp8_bits): the data as the kernels read it, for their code path (KERNEL_KIND): fp8 as bytes
    where Triton has no e4m3 (`_fp8_native`); int4 as 32-bit words (8 codes a load element, no byte extraction)
    when every chunk of gw columns is whole words."""
    fp8_bits = path == 2 and not _fp8_native(device)
    data = _launch.unit_last(data)
    if fp8_bits:
        data = data.view(torch.uint8)
    words = path == 0 and gw % 8 == 0 and _word_aligned(data)
    if words:
        data = data.view(torch.int32)
    return data, words, fp8_bits


def _dequant(data, scales, zeros, kind, group_size, shape, dtype, plan):
    """W [N, K] in `dtype` (`_dequant_kernel`; kind: a KIND_CODES number): a fresh buffer, columns in stored order
    (perm is x's)."""
    N, K = shape
    w = torch.empty((N, K), dtype=dtype, device=data.device)
    if N == 0 or K == 0:
        return w
    path, table, zeros = _kernel_args(kind, scales, zeros)
    data, words, fp8_bits = _stored(data, path, plan.gw, data.device)
    z = zeros if zeros is not None else scales
    block_k = plan.gpt * plan.gw
    _dequant_kernel[(_launch.cdiv(N, plan.block_n), _launch.cdiv(K, block_k))](
        data, scales, z, table, w, N, K, data.stride(0), scales.stride(0),
        scales.stride(-1) if scales.dim() == 2 else 0, z.stride(0), z.stride(-1) if z.dim() == 2 else 0, w.stride(0),
        G=max(group_size, 1), KIND=path, WORDS=words, FP8_BITS=fp8_bits, HAS_ZEROS=zeros is not None,
        PER_CHANNEL=path == 2 and group_size == 0, EVEN_K=K % block_k == 0, BLOCK_N=plan.block_n, GPT=plan.gpt,
        GW=plan.gw, ASM=data.device.type == "cuda" and torch.version.hip is None, num_warps=plan.num_warps)
    return w


def _dequant_mm(x, data, scales, zeros, perm, bias, residual, kind, group_size, n, act, plan):
    """The prefill path: W dequantized once (`_dequant`), x's columns gathered through perm (as the kernels'
    loads), one cuBLAS GEMM (fp32 accumulation, rounded to x's dtype: the projection `quant_linear_reference`
    rounds), then the epilogue with the reference's roundings: fp8's per-channel scale and the bias in fp32 on the
    GEMM's output (a bias alone in the GEMM: addmm), the GLU on the rounded halves (ops.swiglu's forward pass, fp32
    math and one rounding: one read of the [M, 2I] output and one write, where torch's chain of fp32 temporaries
    took ~5 passes, 0.7 ms of the 8B gate_up at 4096 rows on an H100), the residual. torch's 16-bit elementwise ops
    compute in fp32 and round once, so the in-place ones are the same roundings."""
    w = _dequant(data, scales, zeros, kind, group_size, (n, x.shape[1]), x.dtype, plan)
    if perm is not None:
        x = x.index_select(1, perm.long())  # stored column j multiplies x[:, perm[j]]
    per_channel = kind == KIND_CODES["fp8"] and group_size == 0
    if per_channel and bias is not None:
        y = (torch.mm(x, w.t()).float() * scales.float() + bias.float()).to(x.dtype)
    elif per_channel:
        y = torch.mm(x, w.t()).mul_(scales)
    elif bias is not None:
        y = torch.addmm(bias, x, w.t())
    else:
        y = torch.mm(x, w.t())
    del w  # back to the allocator before the epilogue's temporaries
    if act:  # y is [gate | up]: ACTIVATIONS' silu / gelu_tanh are swiglu's 0 / 1
        y = _glu.glu_fwd_launch(y, None, act - 1)
    if residual is not None:
        y = y.add_(residual)
    return y


def _launch_kernel(x, data, scales, zeros, perm, bias, residual, kind, group_size, n, act, config,
                   per_call_scratch=False):
    """x [M, K] (unit stride on K); returns [M, n_out]. kind: a KIND_CODES number. config: None or
    `QuantLinearConfig.ints()`.
    per_call_scratch: the split-K scratch allocated for this call (`_rolling_buffer.split_scratch`)."""
    M, K = x.shape
    n_out = n // 2 if act else n
    if M == 0 or n_out == 0:
        return torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    cfg = QuantLinearConfig(*config) if config is not None else _DEFAULT_CONFIG
    if x.dtype == torch.float32:  # cuBLAS may run fp32 in TF32 (a process-wide switch): the IEEE dot kernel
        cfg = _without_dequant(cfg)
    # measured picks (`_plan`): for the default launch of 16-bit x, as the picks were timed (bf16; fp16 the same bytes)
    plan = _plan(M, n_out, K, _KIND_NAMES[kind], group_size, bool(act), x.device, cfg,
                 config is None and x.element_size() == 2, zeros is not None, x.element_size() == 2)
    if plan.mma and not _word_aligned(data):  # codes not readable as aligned words: the FMA kernels
        plan = _plan(M, n_out, K, _KIND_NAMES[kind], group_size, bool(act), x.device, _without_mma(cfg))
    if plan.dequant:
        return _dequant_mm(x, data, scales, zeros, perm, bias, residual, kind, group_size, n, act, plan)
    y = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    n_blocks = _launch.cdiv(n_out, plan.block_n)
    tiles = n_blocks * (M if plan.gemv else _launch.cdiv(M, plan.block_m))
    ws = cnt = y
    if plan.split > 1:  # pinned, as decode_linear's: counters stay zero between calls, and a graph replays them
        ws = _ws.split_scratch(x.device, "quant_linear.partials", plan.split * M * n, torch.float32, least=1 << 18,
                               per_call=per_call_scratch)
        cnt = _ws.split_scratch(x.device, "quant_linear.counters", tiles, torch.int32, least=1 << 12, zeros=True,
                                per_call=per_call_scratch)
    path, table, zeros = _kernel_args(kind, scales, zeros)
    per_channel = path == 2 and group_size == 0
    data, words, fp8_bits = _stored(data, path, plan.gw, x.device)
    z = zeros if zeros is not None else scales
    pdl = _pdl.enabled(x.device)
    args = (x, data, scales, z, perm if perm is not None else data, table, bias if bias is not None else y,
            residual if residual is not None else y, y, ws, cnt, M, n, K, n_out, plan.k_split,
            x.stride(0), data.stride(0), scales.stride(0), scales.stride(-1) if scales.dim() == 2 else 0,
            z.stride(0), z.stride(-1) if z.dim() == 2 else 0, residual.stride(0) if residual is not None else 0,
            y.stride(0))
    flags = dict(G=max(group_size, 1), KIND=path, WORDS=words, FP8_BITS=fp8_bits, HAS_ZEROS=zeros is not None,
                 HAS_PERM=perm is not None, HAS_BIAS=bias is not None, ACT=act, RESIDUAL=residual is not None,
                 PER_CHANNEL=per_channel, SPLIT_K=plan.split, EVEN_K=K % (plan.gpt * plan.gw) == 0, GPT=plan.gpt,
                 GW=plan.gw, PDL=pdl, ASM=x.device.type == "cuda" and torch.version.hip is None,
                 num_warps=plan.num_warps, num_stages=plan.num_stages,
                 **_pdl.launch_options(pdl))
    if plan.mma:
        # the table is not read (int4 only); the kernel's own constexprs, then the launch options of `flags`
        taken = ("G", "HAS_ZEROS", "HAS_PERM", "HAS_BIAS", "ACT", "RESIDUAL", "SPLIT_K", "PDL", "num_warps",
                 "num_stages")
        _mma._quant_code_mma_kernel[(n_blocks, plan.split, _launch.cdiv(M, plan.block_m))](
            *args[:5], *args[6:], BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.gw,
            EVEN_N=n_out % plan.block_n == 0,
            KWIDTH=_mma.k_width(_launch.capability(x.device), plan.block_n, plan.num_warps),
            MAGIC=0x4300 if x.dtype == torch.bfloat16 else 0x6400, NATIVE=flags["ASM"],
            **{k: flags[k] for k in taken}, **_pdl.launch_options(pdl))
    elif plan.gemv:
        _quant_gemv_kernel[(n_blocks, M, plan.split)](*args, BLOCK_N=plan.block_n, PREFETCH=plan.prefetch, **flags)
    else:
        _quant_mm_kernel[(tiles, plan.split)](
            *args, UPCAST=x.device.type == "cpu", PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, GROUP_M=8, SCALES_AHEAD=plan.prefetch and not per_channel,
            **flags)
    return y


@torch.library.custom_op("tigon::quant_linear", mutates_args=())
def quant_linear_op(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    perm: torch.Tensor | None, bias: torch.Tensor | None, residual: torch.Tensor | None, kind: int,
                    group_size: int, n: int, activation: int, config: list[int] | None = None) -> torch.Tensor:
    """x [M, K] and a QuantizedWeight's tensors; returns [M, n] ([M, n // 2] with an activation). The node
    torch.compile puts in its graphs: its split-K scratch is the call's own (`_rolling_buffer.split_scratch`)."""
    return _launch_kernel(x, data, scales, zeros, perm, bias, residual, kind, group_size, n, activation, config,
                          per_call_scratch=True)


@quant_linear_op.register_fake
def _(x, data, scales, zeros, perm, bias, residual, kind, group_size, n, activation, config=None):
    return x.new_empty((x.shape[0], n // 2 if activation else n))


def quant_linear_reference(x, qw, *, bias=None, residual=None, activation=None):
    """The spec: `linear_reference` (fp32 math, rounded to qw.dtype), then the GLU on the rounded halves (rounded),
    then the residual sum (rounded): the roundings of the unfused modules (a quantized Linear, the GLU, the add)."""
    y = linear_reference(x, qw, bias)
    if activation is not None:
        gate, up = y.chunk(2, dim=-1)
        y = (reference.swiglu if activation == "silu" else reference.geglu)(gate, up)
    if residual is not None:
        y = (y.float() + residual.float()).to(y.dtype)
    return y


def _validate(x, qw, bias, residual, activation, config) -> int:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"{OP}: qw must be a tigon.ops.QuantizedWeight, got {type(qw).__name__}")
    if config is not None and not isinstance(config, QuantLinearConfig):
        raise TypeError(f"{OP}: config must be a tigon.ops.QuantLinearConfig or None, got {type(config).__name__}")
    _launch.check_tensor(OP, "x", x)
    _launch.check_min_dim(OP, "x", x)
    if x.dtype != qw.dtype:
        raise TypeError(f"{OP}: x has dtype {x.dtype} but qw.dtype is {qw.dtype} (the output's dtype)")
    N, K = qw.shape
    if x.shape[-1] != K:
        raise ValueError(f"{OP}: x must have shape [..., K={K}] (qw.shape {tuple(qw.shape)}), got {tuple(x.shape)}")
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ValueError(f"{OP}: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if activation is not None and N % 2:
        raise ValueError(f"{OP}: activation={activation!r} needs qw's N rows to be [gate; up], an even count, got {N}")
    if qw.kind != "fp8" and qw.group_size % 2:
        raise ValueError(f"{OP}: qw.group_size must be even for {qw.kind} (a byte's two codes share a group), "
                         f"got {qw.group_size}")
    _launch.check_tensor(OP, "qw.scales", qw.scales)
    if qw.zeros is not None:
        _launch.check_tensor(OP, "qw.zeros", qw.zeros)
    if qw.perm is not None and (qw.perm.dtype.is_floating_point or qw.perm.dtype.is_complex or
                                qw.perm.dtype == torch.bool):
        raise TypeError(f"{OP}: qw.perm must be an integer tensor, got {qw.perm.dtype}")
    n_out = N // 2 if activation is not None else N
    if bias is not None:
        _launch.check_tensor(OP, "bias", bias, floating=False)
        _launch.check_same_dtype(OP, "x", x, bias=bias)
        _launch.check_shape(OP, "bias", bias, (N,))
    if residual is not None:
        _launch.check_tensor(OP, "residual", residual, floating=False)
        _launch.check_same_dtype(OP, "x", x, residual=residual)
        _launch.check_shape(OP, "residual", residual, tuple(x.shape[:-1]) + (n_out,))
    _launch.check_same_device(OP, "x", x, **{"qw.data": qw.data, "qw.scales": qw.scales, "qw.zeros": qw.zeros,
                                             "qw.perm": qw.perm}, bias=bias, residual=residual)
    if qw.perm is not None and qw.perm.numel() and _library.host_checks(x.device):
        if int(qw.perm.min()) < 0 or int(qw.perm.max()) >= K:
            raise ValueError(f"{OP}: qw.perm must hold column indices in [0, {K}), got values in "
                             f"[{int(qw.perm.min())}, {int(qw.perm.max())}]")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, bias, residual)):
        raise RuntimeError(f"{OP}: inference only, no backward; call it under torch.no_grad() or on detached tensors")
    return n_out


def quant_linear(x, qw, *, bias=None, residual=None, activation=None, config=None):
    """x [..., K] @ W^T + bias for a quantized weight W [N, K] (`QuantizedWeight`), in x's dtype (= qw.dtype).

    activation "silu" / "gelu_tanh": W's rows are [gate; up] and the result is act(gate) * up, [..., N // 2].
    residual [..., N_out]: added last. Rounding as the unfused modules (`quant_linear_reference`). Up to
    `gemv_max_rows` rows (1) run the decode GEMV, more the tensor-core kernel, and from `dequant_min_rows` (256 on
    a GPU; bf16 / fp16 x) W is dequantized once into a buffer for one cuBLAS GEMM; on a device without the
    kernels, the reference. config: a `QuantLinearConfig` (speed only). Inference only: a
    RuntimeError if x, bias or residual needs a gradient."""
    n_out = _validate(x, qw, bias, residual, activation, config)
    if not _library.use_kernels("quant_linear", x):
        return quant_linear_reference(x, qw, bias=bias, residual=residual, activation=activation)
    lead = x.shape[:-1]
    x2 = _launch.as_rows(x)
    r2 = _launch.unit_last(residual.reshape(-1, n_out)) if residual is not None else None
    y = _library.dispatch(quant_linear_op, None, _launch_kernel, x2, qw.data, qw.scales, qw.zeros, qw.perm,
                          bias.contiguous() if bias is not None else None, r2, KIND_CODES[qw.kind], qw.group_size,
                          qw.shape[0], ACTIVATIONS[activation], config.ints() if config is not None else None)
    return y.reshape(*lead, n_out)


__all__ = ["QuantLinearConfig", "QuantizedWeight", "quant_linear", "quant_linear_reference"]
