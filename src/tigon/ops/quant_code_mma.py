"""The code-MMA kernel: `quant_linear` over int4 weights on tensor cores with the codes as the dot's register operand
(`QuantLinearConfig(code_mma=1)`; docs/ops/quant_linear.md, "The code-MMA kernel"), for 16-bit x: the decode GEMV
(up to 16 rows of x, padded to 16, K split to fill the GPU) and, with more rows, a GEMM (BLOCK_M rows of x a program).

The weight tile is the dot's A operand ([BLOCK_N rows, group columns]) and x^T [.., BLOCK_M] its B. The K order of
each 32 columns is chosen so that a thread's own 32-bit words fill its own slots of A. On sm_90 (wgmma's register
operand, Triton's kWidth 2) a thread (t = lane % 4) holds columns 2 t, 2 t + 1, 2 t + 8, 2 t + 9 of each 16, and dot
column 32 b + 16 c + 8 h + 2 w + e holds code 4 e + 2 c + h of word NB w + b (NB = the words of a row a group / 4);
with mma.sync (kWidth 4: sm_80 to sm_89, and sm_90 below a warpgroup's tile) it holds 4 t .. 4 t + 3, and
column 32 b + 16 c + 4 w + 2 h + e the same code. x is loaded in column order and reordered the same way. Either way a
thread's word (w = t) gives it both halves of its 32-bit A registers: one LOP3 of the word shifted by 4 i makes the
pair (codes i, i + 4) as the 16-bit floats 128 + q (bf16) or 1024 + q (fp16), one packed subtraction makes them
q - 8, exact. No shared memory between the load of the codes and the mma (Triton's pipeliner may still stage the loads
through it, asynchronously): at one row about 2.3 instructions a weight element on sm_90 against the FMA GEMV's 4.3
(the SASS counts in docs/ops/quant_gemv_issue_model.md).

The products (q - 8) x are exact and summed in fp32 by the tensor core, a group's sum scaled once (s d), as the
FMA GEMV's; zero points add s (8 - z) sum(x) from x's exact fp32 group sum. The interpreter has no 16-bit
arithmetic: off a GPU the same tile, in the same K order, is built in fp32 and multiplied in fp32 (IEEE).
"""

import triton
import triton.language as tl

from . import _pdl
from ._quant_tiles import _finish

COLUMNS = 128  # the columns of a K step (one group, or 128 // G groups)
MAX_ROWS = 16  # up to this many rows of x: one tile of 16 (the dot's least N) and K split, the decode GEMV


@triton.jit
def _pair(w, i: tl.constexpr, MAGIC: tl.constexpr, NATIVE: tl.constexpr):
    """Codes i and i + 4 of each word as a pair [.., 2]: the 16-bit floats with bits MAGIC | q (NATIVE: one LOP3 a
    pair) or, off a GPU, the integers q."""
    if NATIVE:
        if MAGIC == 0x4300:
            b = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xea;", "=r,r", [w >> (4 * i)],
                                          dtype=tl.int32, is_pure=True, pack=1)
            lo = (b & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
            hi = (b >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            b = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xea;", "=r,r", [w >> (4 * i)],
                                          dtype=tl.int32, is_pure=True, pack=1)
            lo = (b & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (b >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        lo = (w >> (4 * i)) & 0xF
        hi = (w >> (4 * i + 16)) & 0xF
    return tl.join(lo, hi)


@triton.jit
def _a_tile(D, o_n, m_n, kw, stride_dn, C: tl.constexpr, EVEN_N: tl.constexpr, KWIDTH: tl.constexpr,
            MAGIC: tl.constexpr, NATIVE: tl.constexpr):
    """The [BLOCK_N, C] A operand q - 8 of the C columns from word kw (C = 32, 64 or 128), in the K order of the
    operand's KWIDTH (above). EVEN_N: every row of the tile is real (no mask: no compare and zero fill a load)."""
    NB: tl.constexpr = C // 32
    p = D + o_n.to(tl.int64)[:, None] * stride_dn + (kw + tl.arange(0, C // 8))[None, :]
    if EVEN_N:
        w = tl.load(p)
    else:
        w = tl.load(p, mask=m_n[:, None], other=0)
    w = tl.reshape(w, [o_n.shape[0], 4, NB])  # [n, w, b]: word NB w + b
    a = tl.join(tl.join(_pair(w, 0, MAGIC, NATIVE), _pair(w, 1, MAGIC, NATIVE)),
                tl.join(_pair(w, 2, MAGIC, NATIVE), _pair(w, 3, MAGIC, NATIVE)))  # [n, w, b, e, h, c]
    if KWIDTH == 2:
        a = tl.permute(a, (0, 2, 5, 4, 1, 3))  # [n, b, c, h, w, e]
    else:
        a = tl.permute(a, (0, 2, 5, 1, 4, 3))  # [n, b, c, w, h, e]
    a = tl.reshape(a, [o_n.shape[0], C])
    if not NATIVE:
        a = a.to(tl.float32) - 8.0
    elif MAGIC == 0x4300:
        a = a - 136.0  # 128 + q - 136 in bf16
    else:
        a = a - 1032.0  # 1024 + q - 1032 in fp16
    return a


@triton.jit
def _x_tile(p_x, P, m_m, k, C: tl.constexpr, HAS_PERM: tl.constexpr, KWIDTH: tl.constexpr):
    """x^T [C, BLOCK_M] of the C columns from k, in `_a_tile`'s K order: loaded in column order (16 B a lane, rows
    past M masked), then reordered in registers: column 8 (NB w + b) + 4 e + 2 c + h goes to 32 b + 16 c + 8 h +
    2 w + e (KWIDTH 2; 4: 32 b + 16 c + 4 w + 2 h + e). Through a permutation (act order) the columns are gathered
    one by one anyway, so they are gathered in that order (the register reorder of a gather fails to compile for
    sm_90 in Triton 3.6: "Illegal shared layout")."""
    NB: tl.constexpr = C // 32
    if HAS_PERM:  # gathered in the dot's order: column j of the tile is x[perm[k + src(j)]]
        j = tl.arange(0, C)
        if KWIDTH == 2:
            src = 8 * (NB * ((j // 2) % 4) + j // 32) + 4 * (j % 2) + 2 * ((j // 16) % 2) + (j // 8) % 2
        else:
            src = 8 * (NB * ((j // 4) % 4) + j // 32) + 4 * (j % 2) + 2 * ((j // 16) % 2) + (j // 2) % 2
        kk = tl.load(P + k + src)
        return tl.trans(tl.load(p_x + kk[None, :], mask=m_m[:, None], other=0.0))
    x = tl.load(p_x + (k + tl.arange(0, C))[None, :], mask=m_m[:, None], other=0.0)  # [BLOCK_M, C]
    x = tl.reshape(x, [m_m.shape[0], 4, NB, 2, 2, 2])  # [m, w, b, e, c, h]
    if KWIDTH == 2:
        x = tl.permute(x, (0, 2, 4, 5, 1, 3))  # [m, b, c, h, w, e]
    else:
        x = tl.permute(x, (0, 2, 4, 1, 5, 3))  # [m, b, c, w, h, e]
    return tl.trans(tl.reshape(x, [m_m.shape[0], C]))


@triton.jit
def _dot_part(d, D, xt, o_n, m_n, k, stride_dn, C: tl.constexpr, EVEN_N: tl.constexpr, KWIDTH: tl.constexpr,
              MAGIC: tl.constexpr, NATIVE: tl.constexpr):
    """d + sum((q - 8) x) over the C columns from column k."""
    a = _a_tile(D, o_n, m_n, k // 8, stride_dn, C, EVEN_N, KWIDTH, MAGIC, NATIVE)
    if NATIVE:
        d = tl.dot(a, xt, d)
    else:
        d = tl.dot(a, xt.to(tl.float32), d, input_precision="ieee")
    return d


@triton.jit
def _scaled(acc, d, sx, S, Z, o_n, m_n, k, stride_sn, stride_sg, stride_zn, stride_zg, G: tl.constexpr,
            HAS_ZEROS: tl.constexpr):
    """acc + s (d + (8 - z) sum(x)): one group's sums d scaled once, with the group's scale and zero point."""
    s = tl.load(S + o_n.to(tl.int64) * stride_sn + (k // G) * stride_sg, mask=m_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(Z + o_n.to(tl.int64) * stride_zn + (k // G) * stride_zg, mask=m_n, other=0.0).to(tl.float32)
        d += (8.0 - z)[:, None] * sx[None, :]
    return acc + s[:, None] * d


@triton.jit(do_not_specialize=["M", "N"])
def _quant_code_mma_kernel(
    X, D, S, Z, P, BIAS, R, Y, WS, CNT,  # as in quant_linear's _quant_gemv_kernel; D as int32 words
    M, N, K, N_OUT, K_SPLIT,
    stride_xm, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg, stride_rm, stride_ym,
    G: tl.constexpr,  # the group size: 32, 64 or a multiple of 128
    HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the columns of one dot: 32, 64 or 128 (fewer live A registers, more dots a step)
    EVEN_N: tl.constexpr,  # N_OUT a multiple of BLOCK_N
    KWIDTH: tl.constexpr,  # consecutive K elements a thread holds of the A operand (`k_width`): the K order
    MAGIC: tl.constexpr,  # 0x4300 for bf16 x, 0x6400 for fp16
    NATIVE: tl.constexpr,  # 16-bit tensor-core operands and inline PTX (a GPU), else fp32 (the interpreter)
    PDL: tl.constexpr,
):
    """y [BLOCK_M rows of x, BLOCK_N] of one tile and one K range: K steps of 128 columns, each
    summed a group at a time (GS columns under one scale) in dots of C columns and scaled once a group, then the
    split-K finish and epilogue of the FMA GEMV."""
    GS: tl.constexpr = G if G < 128 else 128
    C: tl.constexpr = GS if GS < BLOCK_K else BLOCK_K
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N_OUT
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    p_x = X + o_m.to(tl.int64)[:, None] * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PDL:
        _pdl.wait(PDL)
    for k0 in range(k_lo, k_hi, 128):
        for g in tl.static_range(128 // GS):
            kg = k0 + g * GS
            d = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            d_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            sx = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in tl.static_range(GS // C):
                xt = _x_tile(p_x, P, m_m, kg + j * C, C, HAS_PERM, KWIDTH)
                if HAS_ZEROS:
                    sx += tl.sum(xt.to(tl.float32), axis=0)
                d = _dot_part(d, D, xt, o_n, m_n, kg + j * C, stride_dn, C, EVEN_N, KWIDTH, MAGIC, NATIVE)
                if ACT != 0:  # up's rows sit N_OUT below gate's
                    d_u = _dot_part(d_u, D, xt, o_n + N_OUT, m_n, kg + j * C, stride_dn, C, EVEN_N, KWIDTH, MAGIC,
                                    NATIVE)
            acc = _scaled(acc, d, sx, S, Z, o_n, m_n, kg, stride_sn, stride_sg, stride_zn, stride_zg, G, HAS_ZEROS)
            if ACT != 0:
                acc_u = _scaled(acc_u, d_u, sx, S, Z, o_n + N_OUT, m_n, kg, stride_sn, stride_sg, stride_zn,
                                stride_zg, G, HAS_ZEROS)
    if PDL:
        _pdl.start(PDL)
    _finish(tl.trans(acc), tl.trans(acc_u), S, BIAS, R, Y, WS, CNT, pid_m * tl.num_programs(0) + pid_n, pid_k, o_m,
            m_m, o_n, m_n, M, N, N_OUT, stride_sn, stride_rm, stride_ym, HAS_BIAS, ACT, RESIDUAL, False, SPLIT_K, True)


def k_width(capability: tuple[int, int] | None, block_n: int, num_warps: int) -> int:
    """The A operand's kWidth Triton gives this kernel's 16-bit dot, which fixes the K order: 2 where it takes
    sm_90's wgmma (compute capability 9.x and up, warpgroups: num_warps a multiple of 4 and block_n weight rows a
    multiple of 64), else 4 (mma.sync: sm_80 to sm_89, smaller tiles on sm_90, and the interpreter, capability
    None, where any K order computes the same sums). A wrong width costs speed (A through shared memory), never
    the result."""
    wgmma = capability is not None and capability >= (9, 0) and num_warps % 4 == 0 and block_n % 64 == 0
    return 2 if wgmma else 4


def eligible(kind: str, k: int, group_size: int) -> bool:
    """Whether a weight's shape fits this kernel: int4, K in whole steps of 128 columns, groups of 32, 64 or a
    multiple of 128 (any rows of x; x must be 16-bit and the codes whole aligned words, which the launch checks)."""
    return kind == "int4" and k % COLUMNS == 0 and (group_size in (32, 64) or group_size % COLUMNS == 0)
