"""Decode-step linear layers: y = x @ W^T for a few rows x (the batch of one decode step), with the neighbours
of a transformer's projections fused in.

At decode a projection reads its whole weight to produce a handful of rows: it is bound by the weight bytes
and, at 1-2 B parameters, by how many kernels a step launches. One kernel here does, for `x [M, K]`:
- `norm_weight`: RMSNorm of each row first ("llama" casting, as `ops.rms_norm`); every program recomputes the
  row statistics from x, which is a few KiB and sits in L2, so the norm costs no kernel and no pass over HBM;
- `weights`: 1 to 3 matrices `[N_i, K]` whose outputs are concatenated (q, k, v in one launch);
- `activation` ("silu" / "gelu_tanh"): exactly two weights (gate, up), the output is act(gate) * up: the
  gated MLP's first half without its `[M, 2 * I]` intermediate;
- `residual [M, N]`: added to the rounded product (the decoder's residual stream).

Each program owns BLOCK_N output columns of one matrix for BLOCK_M rows and walks K; the product is a
`tl.dot` with M padded to 16 (tensor cores, fp32 accumulation), which makes M = 1..16 cost the same. Rounding
follows the unfused modules: the norm output, each projection output and the GLU product are rounded to the
input dtype where the separate ops would round them. Inference only (no autograd).
"""

import json
import os

import torch
import triton
import triton.language as tl

from . import _launch, _library, _pdl, reference
from ._pdl import gdc_launch_dependents, gdc_wait

ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2}
MAX_WEIGHTS = 3
# Launch settings; None picks from the shapes (benchmarks/bench_decode_ops.py sweeps them on a GPU).
CONFIG = None  # (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K[, FMA]); FMA: the M == 1 experiment
ROPE_BLOCK_N = 16  # decode_qkv_rope: rotation pairs per program (a program covers twice as many rows)
# With programmatic dependent launch a program may start before the previous kernel ends: it then prefetches
# its weight rows into L2 while it waits, up to this many bytes per launch (24 << 20 would take the whole
# weight of a q/k/v or o projection, a first part of the MLP's), at least its first two K steps.
PREFETCH_BYTES = 0  # 0: two K steps (the H200 A/B in benchmarks/results/decode_pdl.md: larger budgets gained nothing)


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 1:  # silu
        return g / (1.0 + tl.exp(-g))
    # gelu, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1) (no libdevice under the interpreter)
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))


@triton.jit
def _dot(b_x, b_w, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:  # the interpreter computes raw 16-bit products wrongly: fp32 numpy matmul instead
        return tl.dot(b_x.to(tl.float32), tl.trans(b_w.to(tl.float32)), input_precision="ieee")
    return tl.dot(b_x, tl.trans(b_w), input_precision=PRECISION)


@triton.jit(do_not_specialize=["N0", "N1", "N2", "NB0", "NB1"])
def _decode_linear_kernel(
    X,  # [M, K], unit stride on K
    NW,  # [K] RMSNorm weight (read when NORM)
    W,  # [N0, K] first weight, contiguous; the others sit at element offsets D1, D2 from it
    R,  # [M, N_total] residual (read when RESIDUAL)
    Y,  # [M, N_total] output
    WS,  # fp32 [SPLIT_K, M, N_total]: split-K partial tiles (SPLIT_K > 1)
    CNT,  # int32 [n_blocks * m_blocks] zeros: split-K arrival counters (reset by the last arrival)
    M, K, N0, N1, N2,
    NB0, NB1,  # column blocks of weights 0 and 1 (program ranges: [0, NB0), [NB0, NB0 + NB1), the rest)
    D1, D2,  # element offsets of weights 1 and 2 from W (weight 1 = up when ACT)
    K_SPLIT,  # K elements per split, a multiple of BLOCK_K
    stride_xm, stride_rm, stride_ym,
    eps,
    # ROPE (decode_qkv_rope): RoPE tables, the KV cache, its slot positions and next position
    COS, SIN, K_CACHE, V_CACHE, POS, NEXT,
    stride_cb, stride_sb,  # batch strides of cos / sin (0: one row for the batch); unit stride on the dim
    HD, HALF,  # head dim, HD // 2
    C_SLOTS, sink,  # cache slots; the first `sink` slots keep their positions, the others roll
    s_kcb, s_kch, s_kcc, s_vcb, s_vch, s_vcc,
    NUM_W: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 and the splits tile K exactly: no mask along K
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_K: tl.constexpr = 0,  # weight elements per row to prefetch into L2 before the PDL wait,
    PF_LINES: tl.constexpr = 1,  # in loop steps of PF_LINES 128-byte lines of PF_LINE elements
    PF_LINE: tl.constexpr = 64,
    FMA: tl.constexpr = False,  # M == 1 and BLOCK_M == 1: fp32 multiply-adds on [BLOCK_N, BLOCK_K], no tl.dot
    ROPE: tl.constexpr = False,  # q, k, v weights; q and k rotated, k and v written into the cache
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    # The matrix this program reads (an element offset from W, so the loads keep W's alignment); with ACT
    # every program reads gate (W) and up (W + D1) for the same columns.
    off = tl.zeros([], dtype=tl.int64)
    N, col0, blk = N0, 0, pid_n
    if NUM_W > 1 and ACT == 0:
        if pid_n >= NB0 + NB1:
            off, N, col0, blk = D2.to(tl.int64), N2, N0 + N1, pid_n - NB0 - NB1
        elif pid_n >= NB0:
            off, N, col0, blk = D1.to(tl.int64), N1, N0, pid_n - NB0
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    # The second accumulator's rows (ACT: up's, at D1; ROPE: each row's RoPE partner, du rows further on)
    is_v = pid_n >= NB0 + NB1
    if ROPE:
        # q and k programs own BLOCK_N rotation pairs (rows i and i + HALF of one head); a v program owns
        # 2 * BLOCK_N consecutive rows, as two halves
        per_head = HALF // BLOCK_N
        base = tl.where(is_v, blk * 2 * BLOCK_N, (blk // per_head) * HD + (blk % per_head) * BLOCK_N)
        du = tl.where(is_v, BLOCK_N, HALF)
    else:
        base = blk * BLOCK_N
        du = 0
    o_n = base + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_n2 = o_n + du
    m_n2 = o_n2 < N
    o_k = tl.arange(0, BLOCK_K)
    p_x = X + o_m.to(tl.int64)[:, None] * stride_xm
    dt = X.dtype.element_ty
    k_lo = pid_k * K_SPLIT
    if PDL:
        # Programmatic dependent launch (ops/_pdl.py): this kernel may start while the previous one runs. No
        # kernel writes the weights, so this program's weight rows head for L2 now; then wait for the previous
        # kernel (x, the residual and the workspace are read only after the wait), and let the next kernel's
        # programs launch once all of ours are past their wait.
        _prefetch_l2(W + off, D1, o_n, m_n, K, k_lo, ACT, PF_LINES, PF_LINE, PREFETCH_K)
        if ROPE:
            _prefetch_l2(W + off, D1, o_n2, m_n2, K, k_lo, 0, PF_LINES, PF_LINE, PREFETCH_K)
        gdc_wait()
        gdc_launch_dependents()

    if NORM:  # the row statistics over all of K, whatever this program's split
        b_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + o_k
            b_x = tl.load(p_x + kk[None, :], mask=m_m[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
            b_ss += tl.sum(b_x * b_x, axis=1)
        b_rstd = tl.rsqrt(b_ss / K + tl.cast(eps, tl.float32))

    if ROPE:  # the token's slot and the cos/sin tiles, loaded before the K loop so their latency hides in it
        c1, c2, s1, s2, p_new, slot = _rope_operands(COS, SIN, NEXT, o_m, m_m, o_n, m_n, is_v, stride_cb, stride_sb,
                                                     HD, HALF, C_SLOTS, sink)
    p_w = W + off + o_n.to(tl.int64)[:, None] * K
    if ROPE:
        p_u = W + off + o_n2.to(tl.int64)[:, None] * K
    else:
        p_u = W + D1.to(tl.int64) + o_n.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # FMA: per-lane partial sums, reduced once after
    acc2_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
        kk = k0 + o_k
        if EVEN_K:
            m_k = o_k < BLOCK_K
        else:
            m_k = kk < K
        b_x = tl.load(p_x + kk[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        if NORM:  # round the normalized value to the input dtype, then scale by the weight (LlamaRMSNorm)
            b_nw = tl.load(NW + kk, mask=m_k, other=0.0).to(tl.float32)
            b_n = (b_x.to(tl.float32) * b_rstd[:, None]).to(dt).to(tl.float32)
            b_x = (b_n * b_nw[None, :]).to(dt)
        m_w = m_n[:, None] & m_k[None, :]
        if FMA:
            b_xf = b_x.to(tl.float32)  # [1, BLOCK_K], broadcast over the rows
            acc2 += tl.load(p_w + kk[None, :], mask=m_w, other=0.0).to(tl.float32) * b_xf
            if ACT != 0:
                acc2_u += tl.load(p_u + kk[None, :], mask=m_w, other=0.0).to(tl.float32) * b_xf
        else:
            acc += _dot(b_x, tl.load(p_w + kk[None, :], mask=m_w, other=0.0), UPCAST, PRECISION)
            if ACT != 0:
                acc_u += _dot(b_x, tl.load(p_u + kk[None, :], mask=m_w, other=0.0), UPCAST, PRECISION)
            if ROPE:
                m_w2 = m_n2[:, None] & m_k[None, :]
                acc_u += _dot(b_x, tl.load(p_u + kk[None, :], mask=m_w2, other=0.0), UPCAST, PRECISION)
    if FMA:
        acc = tl.sum(acc2, axis=1)[None, :]
        acc_u = tl.sum(acc2_u, axis=1)[None, :]

    o_col = col0 + o_n
    m_y = m_m[:, None] & m_n[None, :]
    if ROPE:
        _rope_epilogue(acc, acc_u, Y, o_m, m_m, o_n, o_n2, m_n, m_n2, col0, stride_ym, is_v, pid_n == NB0, dt,
                       c1, c2, s1, s2, HD, K_CACHE, V_CACHE, POS, p_new, slot, C_SLOTS,
                       s_kcb, s_kch, s_kcc, s_vcb, s_vch, s_vcc, pid_m, pid_n >= NB0)
    elif SPLIT_K > 1:
        # Each split stores its fp32 partial tile in its own workspace slice; the last split to arrive (an
        # arrival counter per tile, acq_rel atomics) sums the slices in split order: the same sum every run.
        n_total = N0 + N1 + N2
        o_ws = o_m.to(tl.int64)[:, None] * n_total + o_col[None, :]
        slice_size = n_total.to(tl.int64) * M  # (M may be the constant 1: no .to on it)
        tl.store(WS + pid_k * slice_size + o_ws, acc, mask=m_y)
        # All of this program's threads' stores happen before the counter's release (barrier, then the
        # gpu-scope acq_rel atomic: the threadfence-reduction pattern).
        tl.debug_barrier()
        p_cnt = CNT + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(p_cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # L2 reads (.cg): the other splits' stores, made visible by the counter
                acc += tl.load(WS + s * slice_size + o_ws, mask=m_y, other=0.0, cache_modifier=".cg")
            tl.store(p_cnt, 0)  # every split has arrived: the counter is free for the next call
            _epilogue(acc, acc_u, R, Y, o_m, o_col, m_y, stride_rm, stride_ym, dt, ACT, RESIDUAL)
    else:
        _epilogue(acc, acc_u, R, Y, o_m, o_col, m_y, stride_rm, stride_ym, dt, ACT, RESIDUAL)


@triton.jit
def _prefetch_l2(W, D1, o_n, m_n, K, k_lo, ACT: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr,
                 PREFETCH_K: tl.constexpr):
    """L2 prefetch of PREFETCH_K elements of each of this program's rows from k_lo: one instruction per
    128-byte line (PF_LINE elements), PF_LINES lines per row and loop step; masked-out lines prefetch W's
    first line (always valid)."""
    o_l = tl.arange(0, PF_LINES) * PF_LINE
    for k0 in range(0, PREFETCH_K, PF_LINES * PF_LINE):
        kk = k_lo + k0 + o_l
        m = m_n[:, None] & (kk < K)[None, :]
        offs = tl.where(m, o_n.to(tl.int64)[:, None] * K + kk[None, :], 0)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [W + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)
        if ACT != 0:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [W + D1 + offs],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rope_operands(COS, SIN, NEXT, o_m, m_m, o_n, m_n, is_v, stride_cb, stride_sb, HD, HALF, C_SLOTS, sink):
    """cos and sin of each row's pair (c1, s1 at index i of the head's first half, c2, s2 at i + HALF; zeros for
    a v program), the new token's position (NEXT) and its ring slot: below the sinks, else sink + (p - sink) %
    recent."""
    i = (o_n % HD)[None, :]  # in [0, HALF) for a q or k program
    m = m_m[:, None] & m_n[None, :] & (is_v == 0)
    p_c = COS + o_m.to(tl.int64)[:, None] * stride_cb + i
    p_s = SIN + o_m.to(tl.int64)[:, None] * stride_sb + i
    c1 = tl.load(p_c, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(p_c + HALF, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(p_s, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(p_s + HALF, mask=m, other=0.0).to(tl.float32)
    p = tl.load(NEXT)
    recent = C_SLOTS - sink
    slot = p - tl.maximum((p - sink) // recent, 0) * recent
    return c1, c2, s1, s2, p, slot


@triton.jit
def _rope_epilogue(acc, acc_u, Y, o_m, m_m, o_n, o_n2, m_n, m_n2, col0, stride_ym, is_v, first_k, dt,
                   c1, c2, s1, s2, HD, K_CACHE, V_CACHE, POS, p_new, slot, C_SLOTS,
                   s_kcb, s_kch, s_kcc, s_vcb, s_vch, s_vcc, pid_m, is_kv):
    """q, k: RoPE of the rounded projections (x1 = row i, x2 = row i + HALF of a head; fp32 math, one rounding:
    ops.rope_kv_append's), v as is; all three into Y, k and v also into the token's cache slot of each row's
    sequence, and the slot's position recorded (the first k program of the first row block)."""
    x1 = acc.to(dt).to(tl.float32)
    x2 = acc_u.to(dt).to(tl.float32)
    m1 = m_m[:, None] & m_n[None, :]
    m2 = m_m[:, None] & m_n2[None, :]
    if is_v:
        y1, y2 = x1, x2
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    p_y = Y + o_m.to(tl.int64)[:, None] * stride_ym + col0
    tl.store(p_y + o_n[None, :], y1.to(Y.dtype.element_ty), mask=m1)
    tl.store(p_y + o_n2[None, :], y2.to(Y.dtype.element_ty), mask=m2)
    if is_kv:
        if (slot >= 0) & (slot < C_SLOTS):
            om = o_m.to(tl.int64)[:, None]
            h1, d1 = (o_n // HD)[None, :], (o_n % HD)[None, :]
            h2, d2 = (o_n2 // HD)[None, :], (o_n2 % HD)[None, :]
            if is_v:
                p_c1 = V_CACHE + om * s_vcb + h1 * s_vch + slot * s_vcc + d1
                p_c2 = V_CACHE + om * s_vcb + h2 * s_vch + slot * s_vcc + d2
            else:
                p_c1 = K_CACHE + om * s_kcb + h1 * s_kch + slot * s_kcc + d1
                p_c2 = K_CACHE + om * s_kcb + h2 * s_kch + slot * s_kcc + d2
            tl.store(p_c1, y1.to(K_CACHE.dtype.element_ty), mask=m1)
            tl.store(p_c2, y2.to(K_CACHE.dtype.element_ty), mask=m2)
            if first_k & (pid_m == 0):
                tl.store(POS + slot, p_new)


@triton.jit
def _epilogue(acc, acc_u, R, Y, o_m, o_col, m_y, stride_rm, stride_ym, dt, ACT: tl.constexpr,
              RESIDUAL: tl.constexpr):
    if ACT != 0:  # act and product on the rounded projections, one rounding after (ops.swiglu / geglu)
        b_g = acc.to(dt).to(tl.float32)
        b_y = _act(b_g, ACT) * acc_u.to(dt).to(tl.float32)
    else:
        b_y = acc
    if RESIDUAL:  # HF: residual + proj(x), with proj(x) rounded first
        p_r = R + o_m.to(tl.int64)[:, None] * stride_rm + o_col[None, :]
        b_y = b_y.to(dt).to(tl.float32) + tl.load(p_r, mask=m_y, other=0.0).to(tl.float32)
    tl.store(Y + o_m.to(tl.int64)[:, None] * stride_ym + o_col[None, :], b_y.to(Y.dtype.element_ty), mask=m_y)


_TUNED = None  # {(K, N out, glu): config} from the JSON file named by TIGON_DECODE_LINEAR_TUNED, if set


def _tuned() -> dict:
    global _TUNED
    if _TUNED is None:
        path = os.environ.get("TIGON_DECODE_LINEAR_TUNED")
        _TUNED = {}
        if path:
            with open(path) as f:
                _TUNED = {tuple(int(v) for v in key.split("x")): tuple(cfg) for key, cfg in json.load(f).items()}
    return _TUNED


def _pick_config(M: int, K: int, n_total: int, glu: bool, norm: bool, device) -> tuple:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)."""
    if CONFIG is not None:
        return CONFIG
    tuned = _tuned().get((K, n_total, int(glu)))
    if tuned is not None and device.type == "cuda":
        return tuned
    if device.type != "cuda":
        return 16, 64, 4, 1, 1  # the interpreter: a few K steps on small test shapes
    # From the H200 sweeps (benchmarks/results/decode_ops.md, 1.5B Llama shapes, batch 1 and 8): 32 columns a
    # program except for a plain square projection (o_proj: 16, twice the programs), 256-wide K steps, 4 warps;
    # a long K over few column blocks (down_proj, K = 4 N) splits K in 4 over 64-column blocks.
    block_k = 256 if K >= 256 else max(16, triton.next_power_of_2(K))
    if not glu and K >= 4 * 2048 and triton.cdiv(n_total, 64) < 2 * _launch.sm_count(device.index or 0):
        return 64, block_k, 4, 4, 4
    block_n = 32 if glu or norm or n_total >= 4096 else 16
    return block_n, block_k, 4, 3 if glu else 4, 1


def _prefetch(rows: int, K: int, k_split: int, block_k: int, esize: int) -> dict:
    """The prefetch constexprs: 128-byte lines of PF_LINE elements, PF_LINES of them per row and loop step (two
    K steps' worth), and PREFETCH_K elements per row from the program's split start: PREFETCH_BYTES over all
    rows and splits, in whole loop steps, at least one, at most the split."""
    line = 128 // esize
    lines = max(1, 2 * block_k // line)
    step = lines * line
    per_row = PREFETCH_BYTES // max(1, rows * esize * triton.cdiv(K, k_split))
    n = min(triton.cdiv(k_split, step), max(1, per_row // step)) * step
    return dict(PREFETCH_K=n, PF_LINES=lines, PF_LINE=line)


_WORKSPACE: dict = {}  # (device, stream) -> (fp32 partial tiles, int32 arrival counters: zeros between calls)


def _workspace(device, n_sums: int, n_counters: int):
    key = (device, torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    ws = _WORKSPACE.get(key)
    if ws is None or ws[0].numel() < n_sums or ws[1].numel() < n_counters:
        size = max(n_sums, 1 << 18, 0 if ws is None else ws[0].numel())
        count = max(n_counters, 1 << 12, 0 if ws is None else ws[1].numel())
        ws = _WORKSPACE[key] = (torch.zeros(size, dtype=torch.float32, device=device),
                                torch.zeros(count, dtype=torch.int32, device=device))
    return ws


def _launch_kernel(x, weights, norm_weight, eps, residual, act, rope=None):
    """rope: None, or (cos, sin, k_cache, v_cache, positions, next_position, sink) for decode_qkv_rope."""
    M, K = x.shape
    ns = [w.shape[0] for w in weights]
    n_out = ns[0] if act else sum(ns)
    y = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if M == 0 or n_out == 0:
        return y
    config = _pick_config(M, K, n_out, bool(act), norm_weight is not None, x.device)
    block_n, block_k, warps, stages, split = config[:5]
    fma = len(config) > 5 and bool(config[5]) and M == 1 and rope is None  # M == 1 experiment (bench_decode_ops)
    ns_all = ns + [0] * (MAX_WEIGHTS - len(ns))
    if rope is not None:
        hd = rope[2].shape[-1]
        block_n = min(ROPE_BLOCK_N if CONFIG is None else block_n, hd // 2)
        while (hd // 2) % block_n:
            block_n //= 2
        nb = [ns_all[0] // (2 * block_n), ns_all[1] // (2 * block_n), triton.cdiv(ns_all[2], 2 * block_n)]
    else:
        nb = [triton.cdiv(n, block_n) for n in ns_all]
    if act or rope is not None:
        split = 1  # two accumulators: twice the columns per program fill the GPU without splitting K
    n_blocks = nb[0] if act else sum(nb)
    block_m = 1 if fma else 16
    m_blocks = triton.cdiv(M, block_m)
    k_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, k_split)
    if split > 1:
        ws, cnt = _workspace(x.device, split * M * n_out, n_blocks * m_blocks)
    else:
        ws, cnt = y, y
    esize = x.element_size()
    # Unused offsets get 16: a value Triton neither specializes to a constant nor misaligns.
    deltas = [(w.data_ptr() - weights[0].data_ptr()) // esize for w in weights[1:]] + [16, 16]
    interp = x.device.type == "cpu"
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (n_blocks, m_blocks, split)
    if rope is not None:
        cos, sin, kc, vc, positions, nxt, sink = rope
        rope_args = (cos, sin, kc, vc, positions, nxt, cos.stride(0) if cos.shape[0] > 1 else 0,
                     sin.stride(0) if sin.shape[0] > 1 else 0, kc.shape[-1], kc.shape[-1] // 2, kc.shape[2], sink,
                     *kc.stride()[:3], *vc.stride()[:3])
    else:
        rope_args = (y, y, y, y, y, y, 0, 0, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0)
    args = (
        x, norm_weight if norm_weight is not None else x, weights[0],
        residual if residual is not None else y, y, ws, cnt,
        M, K, ns_all[0], ns_all[1], ns_all[2], nb[0], nb[1], deltas[0], deltas[1], k_split,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), float(eps), *rope_args,
    )
    meta = dict(
        NUM_W=len(weights), NORM=norm_weight is not None, ACT=act, RESIDUAL=residual is not None, SPLIT_K=split,
        EVEN_K=K % block_k == 0 and k_split * split == K, UPCAST=interp, PRECISION=precision, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, FMA=fma, ROPE=rope is not None,
        **_prefetch(sum(ns), K, k_split, block_k, esize),
    )
    _pdl.launch(_decode_linear_kernel, grid, args, meta, x.device)
    return y


@torch.library.custom_op("tigon::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None, eps: float,
                     residual: torch.Tensor | None, activation: int) -> torch.Tensor:
    """x [M, K], weights 1-3 x [N_i, K]; returns [M, sum N_i] ([M, N] with an activation)."""
    return _launch_kernel(x, weights, norm_weight, eps, residual, activation)


@decode_linear_op.register_fake
def _(x, weights, norm_weight, eps, residual, activation):
    n = weights[0].shape[0] if activation else sum(w.shape[0] for w in weights)
    return x.new_empty((x.shape[0], n))


def decode_linear_reference(x, weights, *, norm_weight=None, eps=1e-6, residual=None, activation=None):
    """The spec: the unfused modules in fp32 (fp64 for fp64 inputs), rounding where they round."""
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = reference.rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    outs = [(h.to(ct) @ w.to(ct).t()).to(x.dtype) for w in weights]
    if activation is not None:
        glu = reference.swiglu if activation == "silu" else reference.geglu
        y = glu(outs[0], outs[1])
    else:
        y = torch.cat(outs, dim=-1)
    if residual is not None:
        y = (y.to(ct) + residual.to(ct)).to(x.dtype)
    return y


def _validate(x, weights, norm_weight, eps, residual, activation):
    op = "decode_linear"
    _launch.check_tensor(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have shape [..., K], got a 0-d tensor")
    if isinstance(weights, torch.Tensor):
        weights = (weights,)
    if not isinstance(weights, (list, tuple)) or not 1 <= len(weights) <= MAX_WEIGHTS:
        raise TypeError(f"{op}: weights must be a tensor or a list of 1 to {MAX_WEIGHTS} tensors, got {weights!r}")
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if activation is not None and len(weights) != 2:
        raise ValueError(f"{op}: activation={activation!r} needs exactly two weights (gate, up), got {len(weights)}")
    K = x.shape[-1]
    if K < 1:
        raise ValueError(f"{op}: x must have K >= 1 features (its last dim), got shape {tuple(x.shape)}")
    for name, t in (("norm_weight", norm_weight), ("residual", residual)):
        if t is not None:
            _launch.check_tensor(op, name, t, floating=False)  # its dtype: checked against x below
    for i, w in enumerate(weights):
        _launch.check_tensor(op, f"weights[{i}]", w)
        if w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"{op}: weights[{i}] must have shape [N, K={K}], got {tuple(w.shape)}")
        if not w.is_contiguous():
            raise ValueError(f"{op}: weights[{i}] must be contiguous, got strides {w.stride()}")
    if activation is not None and weights[0].shape != weights[1].shape:
        raise ValueError(f"{op}: gate {tuple(weights[0].shape)} and up {tuple(weights[1].shape)} weights differ")
    _launch.check_same_dtype(op, "x", x, **{f"weights[{i}]": w for i, w in enumerate(weights)},
                             norm_weight=norm_weight, residual=residual)
    _launch.check_same_device(op, "x", x, **{f"weights[{i}]": w for i, w in enumerate(weights)},
                              norm_weight=norm_weight, residual=residual)
    if norm_weight is not None:
        _launch.check_shape(op, "norm_weight", norm_weight, (K,))
    n_out = weights[0].shape[0] if activation is not None else sum(w.shape[0] for w in weights)
    if residual is not None:
        _launch.check_shape(op, "residual", residual, tuple(x.shape[:-1]) + (n_out,))
    eps = _launch.check_eps(op, eps)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, norm_weight, residual, *weights)):
        raise RuntimeError(f"{op}: inference only, no backward; call it under torch.no_grad() or on detached "
                           "tensors")
    return tuple(weights), eps, n_out


def decode_linear(x, weights, *, norm_weight=None, eps=1e-6, residual=None, activation=None):
    """`x @ W^T` for the few rows of a decode step, with an RMSNorm before and a GLU or residual add after.

    x [..., K]; weights: one `[N, K]` tensor or a list of up to three (outputs concatenated along the last dim,
    e.g. q, k, v); norm_weight [K]: `rms_norm(x, norm_weight, eps)` first; activation "silu" / "gelu_tanh":
    weights must be (gate, up) and the result is `act(x gate^T) * (x up^T)`; residual [..., N]: added last.
    All tensors share x's dtype and device; the weights are contiguous. Returns [..., N] in x's dtype.
    Any number of rows is correct; it is fast for up to 16 (one decode step's batch). Inference only.
    """
    weights, eps, n_out = _validate(x, weights, norm_weight, eps, residual, activation)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, n_out)
        if n_out > 1 and r2.stride(-1) != 1:
            r2 = r2.contiguous()
    nw = norm_weight.contiguous() if norm_weight is not None else None
    if not _library.use_kernels("decode_linear", x):
        y = decode_linear_reference(x2, weights, norm_weight=nw, eps=eps, residual=r2, activation=activation)
        return y.reshape(*lead, n_out)
    act = ACTIVATIONS[activation]
    if torch.compiler.is_compiling():
        y = torch.ops.tigon.decode_linear(x2, list(weights), nw, eps, r2, act)
    else:  # eager: the launcher directly (the custom-op dispatcher's host time is a kernel's worth here)
        y = _launch_kernel(x2, weights, nw, eps, r2, act)
    return y.reshape(*lead, n_out)


# ----------------------------------------------------------------------------------------------------------
# decode_qkv_rope: the q/k/v projection of a decode step with RoPE and the KV-cache write in its epilogue.


@torch.library.custom_op("tigon::decode_qkv_rope", mutates_args=("k_cache", "v_cache", "positions"))
def decode_qkv_rope_op(x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       positions: torch.Tensor, next_position: torch.Tensor, sink: int) -> torch.Tensor:
    """x [M, K], weights (q, k, v); returns [M, Nq + Nk + Nv] (q and k rotated) and writes the cache."""
    return _launch_kernel(x, weights, norm_weight, eps, None, 0,
                          rope=(cos, sin, k_cache, v_cache, positions, next_position, sink))


@decode_qkv_rope_op.register_fake
def _(x, weights, norm_weight, eps, cos, sin, k_cache, v_cache, positions, next_position, sink):
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in weights)))


def decode_qkv_rope_reference(x, weights, *, norm_weight=None, eps=1e-6, cos, sin, k_cache, v_cache, positions,
                              next_position, sink=0):
    """The spec: decode_linear's reference for q, k, v, then ops.rope_kv_append's reference (RoPE on the
    rounded projections, the cache write at the ring slot of next_position, the slot's position)."""
    from .kv_write import ring_slots, rope_kv_append_reference

    M, hd = x.shape[0], k_cache.shape[-1]
    nq, nk = weights[0].shape[0], weights[1].shape[0]
    y = decode_linear_reference(x, weights, norm_weight=norm_weight, eps=eps)
    q = y[:, :nq].reshape(M, 1, -1, hd).transpose(1, 2)
    k = y[:, nq:nq + nk].reshape(M, 1, -1, hd).transpose(1, 2)
    v = y[:, nq + nk:].reshape(M, 1, -1, hd).transpose(1, 2)
    kc, vc = k_cache[:M], v_cache[:M]
    q_rot = rope_kv_append_reference(k, v, cos, sin, kc, vc, positions, next_position, sink=sink, query=q)
    slot = ring_slots(next_position.reshape(1), k_cache.shape[2], sink)
    k_rot = kc.index_select(2, slot).transpose(1, 2).reshape(M, nk)
    return torch.cat((q_rot.transpose(1, 2).reshape(M, nq), k_rot, y[:, nq + nk:]), dim=-1)


def decode_qkv_rope(x, weights, *, norm_weight=None, eps=1e-6, cos, sin, k_cache, v_cache, positions,
                    next_position, sink=0):
    """The q/k/v projection of a decode step with RoPE and the KV-cache write fused in: one kernel for what
    `decode_linear(x, [wq, wk, wv], norm_weight=...)` then `rope_kv_append(k, v, cos, sin, ..., query=q)` do.

    x [M, K] (M = batch, one token each); weights (wq [Hq*D, K], wk [Hkv*D, K], wv [Hkv*D, K]); cos, sin
    [1 or M, 1, D] (HF's rotary embedding of the new token, full rotary dim, D a multiple of 32); k_cache,
    v_cache [>= M, Hkv, C, D] with unit stride on D; positions int64 [C], next_position int64 [1]: the token
    goes to the ring slot of next_position (after `sink` fixed slots) and its position is recorded there;
    next_position is not advanced. Returns [M, Nq + Nk + Nv]: RoPE(q), RoPE(k), v. Inference only.
    """
    op = "decode_qkv_rope"
    if isinstance(weights, torch.Tensor) or not isinstance(weights, (list, tuple)) or len(weights) != 3:
        raise TypeError(f"{op}: weights must be the three tensors (wq, wk, wv), got {type(weights).__name__}")
    weights, eps, n_out = _validate(x, weights, norm_weight, eps, None, None)
    for name, t in (("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        _launch.check_tensor(op, name, t)
    for name, t in (("positions", positions), ("next_position", next_position)):
        _launch.check_tensor(op, name, t, floating=False)
        if t.dtype != torch.int64:
            raise TypeError(f"{op}: {name} must be int64, got {t.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must have shape [M, K] (one token per sequence), got {tuple(x.shape)}")
    M = x.shape[0]
    if k_cache.dim() != 4 or k_cache.shape[0] < M or k_cache.stride(-1) != 1:
        raise ValueError(f"{op}: k_cache must be [B >= {M}, Hkv, C, D] with unit stride on D, got "
                         f"{tuple(k_cache.shape)} strides {k_cache.stride()}")
    _launch.check_shape(op, "v_cache", v_cache, k_cache.shape)
    if v_cache.stride(-1) != 1:
        raise ValueError(f"{op}: v_cache must have unit stride on D, got strides {v_cache.stride()}")
    hkv, C, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if hd % 32:
        raise ValueError(f"{op}: head dim {hd} must be a multiple of 32")
    nq, nk, nv = (w.shape[0] for w in weights)
    if nq % hd or nk != hkv * hd or nv != nk:
        raise ValueError(f"{op}: weights must have Hq * {hd}, {hkv} * {hd} and {hkv} * {hd} rows for a cache of "
                         f"{hkv} heads of {hd}, got {nq}, {nk}, {nv}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, M) or t.shape[1] != 1 or t.shape[2] != hd or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be [1 or {M}, 1, {hd}] with unit stride on the last dim (full "
                             f"rotary dim), got {tuple(t.shape)} strides {t.stride()}")
    _launch.check_same_dtype(op, "x", x, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)
    _launch.check_same_device(op, "x", x, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, positions=positions,
                              next_position=next_position)
    if tuple(positions.shape) != (C,) or positions.stride(0) != 1:
        raise ValueError(f"{op}: positions must be a contiguous int64 [{C}] tensor, got {tuple(positions.shape)}")
    if next_position.numel() != 1:
        raise ValueError(f"{op}: next_position must be one int64 element, got shape {tuple(next_position.shape)}")
    if isinstance(sink, bool) or not isinstance(sink, int) or not 0 <= sink < C:
        raise ValueError(f"{op}: sink must be an int in [0, {C}), got {sink!r}")
    nw = norm_weight.contiguous() if norm_weight is not None else None
    nxt = next_position.reshape(1)
    if not _library.use_kernels(op, x):
        return decode_qkv_rope_reference(x, weights, norm_weight=nw, eps=eps, cos=cos, sin=sin, k_cache=k_cache,
                                         v_cache=v_cache, positions=positions, next_position=nxt, sink=sink)
    x2 = x if x.stride(-1) == 1 or x.shape[-1] == 1 else x.contiguous()
    if torch.compiler.is_compiling():
        return torch.ops.tigon.decode_qkv_rope(x2, list(weights), nw, eps, cos, sin, k_cache, v_cache, positions,
                                               nxt, sink)
    return _launch_kernel(x2, weights, nw, eps, None, 0, rope=(cos, sin, k_cache, v_cache, positions, nxt, sink))
