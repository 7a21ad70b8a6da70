"""The tile code of `quant_linear`'s kernels (`ops/quant_linear.py`): loading a [BLOCK_N, GPT, GW] weight tile and
its scales, turning its codes into values (int4 as 1 + q / 16 in fp32; nf4 through its table; fp8 from its bytes
where Triton has no e4m3), the GEMV's chunk sums, the tensor-core step (`_mm_tile`, `_dot`), and the split-K finish
and epilogue both kernels share."""

import triton
import triton.language as tl

from .decode_linear import _act


@triton.jit
def _load_tile(D, S, Z, o_n, m_n, k0, k_end, G: tl.constexpr, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg,
               KIND: tl.constexpr, WORDS: tl.constexpr, HAS_ZEROS: tl.constexpr, SCALES: tl.constexpr,
               EVEN_K: tl.constexpr, GPT: tl.constexpr, GW: tl.constexpr):
    """The stored weight tile at columns k0.. (k0 a multiple of BLOCK_K = GPT * GW; nothing is read at or past
    k_end): raw, [BLOCK_N, GPT, GW // 8] int32 words (int4 with WORDS), [BLOCK_N, GPT, GW // 2] bytes (int4, nf4)
    or [BLOCK_N, GPT, GW] fp8 values, 0 where masked; s, z [BLOCK_N, GPT], the chunks' scales and zero points in
    fp32 (z = 8 for symmetric int4, 0 for nf4 and fp8; both 0 when not SCALES). EVEN_K: a tile is all in or all
    out, so the mask is constant along K and the loads stay 16 B wide."""
    o_g = tl.arange(0, GPT)
    p_row = D + o_n.to(tl.int64)[:, None, None] * stride_dn
    if KIND == 2:
        kk = tl.multiple_of(k0, GPT * GW) + o_g[:, None] * GW + tl.arange(0, GW)[None, :]
        p, m_k = p_row + kk[None, :, :], kk < k_end
    elif WORDS:
        kw = tl.multiple_of(k0 // 8, GPT * GW // 8) + o_g[:, None] * (GW // 8) + tl.arange(0, GW // 8)[None, :]
        p, m_k = p_row + kw[None, :, :], 8 * kw < k_end
    else:
        kb = tl.multiple_of(k0 // 2, GPT * GW // 2) + o_g[:, None] * (GW // 2) + tl.arange(0, GW // 2)[None, :]
        p, m_k = p_row + kb[None, :, :], 2 * kb < k_end
    if EVEN_K:
        m = m_n[:, None, None] & (k0 < k_end)
    else:
        m = m_n[:, None, None] & m_k[None, :, :]
    if D.dtype.element_ty.is_floating():
        raw = tl.load(p, mask=m, other=0.0)
    else:
        raw = tl.load(p, mask=m, other=0)
    s = tl.zeros([o_n.shape[0], GPT], tl.float32)
    z = tl.zeros([o_n.shape[0], GPT], tl.float32)
    if SCALES:
        s, z = _load_scales(S, Z, o_n, m_n, k0, k_end, G, stride_sn, stride_sg, stride_zn, stride_zg, KIND,
                            HAS_ZEROS, GPT, GW)
    return raw, s, z


@triton.jit
def _load_scales(S, Z, o_n, m_n, k0, k_end, G: tl.constexpr, stride_sn, stride_sg, stride_zn, stride_zg,
                 KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, GPT: tl.constexpr, GW: tl.constexpr):
    """The [BLOCK_N, GPT] scales and zero points (fp32) of the tile at columns k0..: `_load_tile`'s s, z."""
    o_g = tl.arange(0, GPT)
    z = tl.zeros([o_n.shape[0], GPT], tl.float32)
    k_c = k0 + o_g * GW
    rows = o_n
    if KIND == 2:  # fp8 blocks are G x G
        rows = o_n // G
    m_s = m_n[:, None] & (k_c < k_end)[None, :]
    s = tl.load(S + rows.to(tl.int64)[:, None] * stride_sn + (k_c // G)[None, :] * stride_sg, mask=m_s, other=0.0)
    s = s.to(tl.float32)
    if HAS_ZEROS:
        p_z = Z + o_n.to(tl.int64)[:, None] * stride_zn + (k_c // G)[None, :] * stride_zg
        z = tl.load(p_z, mask=m_s, other=0.0).to(tl.float32)
    elif KIND == 0:
        z += 8.0
    return s, z


@triton.jit
def _values(raw, T, KIND: tl.constexpr, WORDS: tl.constexpr, FP8_BITS: tl.constexpr, ASM: tl.constexpr,
            GPT: tl.constexpr, GW: tl.constexpr):
    """The fp32 values [BLOCK_N, GPT, GW] of a `_load_tile` tile, in K order: 1 + q / 16 for the int4 codes q (the
    low nibble first); nf4 table values (one 8-byte gather a byte: its two nibbles' values); fp8 values (FP8_BITS:
    from the bytes, where Triton has no e4m3 conversion: before sm_89).

    int4 without int -> float conversions (a quarter of the FMA rate on sm_90: they made the GEMV compute-bound):
    the fp32 with bits 0x3F800000 | q << 19 (q in the mantissa's top 4 bits) is 1 + q / 16 exactly, one shift
    and one LOP3 a code from its word; the callers take 16 v - 16 = q back exactly, or fold it into a sum."""
    if KIND == 2 and FP8_BITS:
        # e4m3 |b| = (exponent e, mantissa m) in 4 + 3 bits: as the fp16 with bits |b| << 7 it reads
        # 2^(e - 15) (1 + m / 8), or (m / 8) 2^-14 for e = 0; times 2^8 that is e4m3's value, subnormals included
        b = raw.to(tl.int32)
        h = ((b & 0x7F) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        v = tl.where(b >= 128, -h, h)
    elif KIND == 2:
        v = raw.to(tl.float32)
    elif KIND == 1:
        b2 = (raw.to(tl.int32) * 2)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
        v = tl.reshape(tl.load(T + b2), [raw.shape[0], GPT, GW])
    elif WORDS:  # code i of word j is column 8 j + i; >> is arithmetic, its sign bits land outside the mask
        # each join adds the innermost dim: [.., a, b, c] flattens to 4 a + 2 b + c, and the last join picks c
        v = tl.join(tl.join(tl.join(raw << 19, raw << 3), tl.join(raw << 11, raw >> 5)),
                    tl.join(tl.join(raw << 15, raw >> 1), tl.join(raw << 7, raw >> 9)))
        v = tl.reshape(_code_bits(v, ASM), [raw.shape[0], GPT, GW]).to(tl.float32, bitcast=True)
    else:
        b = raw.to(tl.int32)
        v = _code_bits(tl.interleave(b << 19, b << 15), ASM).to(tl.float32, bitcast=True)
    return v


@triton.jit
def _code_bits(b, ASM: tl.constexpr):
    """(b & 0x780000) | 0x3F800000: the code in bits 19..22 under the exponent of 1.0. ASM: one LOP3 (the compiler
    makes two, its and / or taking one immediate each, on the GEMV's critical path of integer ops)."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x780000, 0x3F800000, 0xea;", "=r,r", [b],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return (b & 0x780000) | 0x3F800000


@triton.jit
def _gemv_sum(raw, s, z, T, x, sx, KIND: tl.constexpr, WORDS: tl.constexpr, FP8_BITS: tl.constexpr,
              ASM: tl.constexpr, PER_CHANNEL: tl.constexpr, GPT: tl.constexpr, GW: tl.constexpr):
    """A tile's [BLOCK_N, GPT] contribution to y: per chunk, the sum of values times x, scaled once; for int4,
    sum((q - z) x) = 16 sum((1 + q / 16) x) - (16 + z) sum(x)."""
    t = tl.sum(_values(raw, T, KIND, WORDS, FP8_BITS, ASM, GPT, GW) * x[None, :, :], axis=2)
    if KIND == 0:
        t = s * (16.0 * t - (16.0 + z) * sx[None, :])
    elif not PER_CHANNEL:
        t = s * t
    return t


@triton.jit
def _x_tile(p_x, P, o_x, k0, k_end, HAS_PERM: tl.constexpr):
    """x's [GPT, GW] columns of the tile at k0 (through perm), 0 at and past k_end."""
    m_x = k0 + o_x < k_end
    kk = k0 + o_x
    if HAS_PERM:
        kk = tl.load(P + kk, mask=m_x, other=0)
    return tl.load(p_x + kk, mask=m_x, other=0.0)


@triton.jit
def _dot(x, w, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:  # the interpreter computes raw 16-bit products wrongly: fp32 numpy matmul instead
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return tl.dot(x, tl.trans(w), input_precision=PRECISION)


@triton.jit
def _mm_tile(x, D, T, S, Z, o_n, m_n, k0, k_end, G: tl.constexpr, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg,
             KIND: tl.constexpr, WORDS: tl.constexpr, FP8_BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
             PER_CHANNEL: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
             ASM: tl.constexpr, GPT: tl.constexpr, GW: tl.constexpr, s_given, z_given, GIVEN: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] @ (this weight tile)^T in fp32, the tile dequantized in fp32 and rounded to x's dtype.
    GIVEN: the tile's scales and zero points are s_given, z_given (loaded a step ahead), not loaded here."""
    raw, s, z = _load_tile(D, S, Z, o_n, m_n, k0, k_end, G, stride_dn, stride_sn, stride_sg, stride_zn, stride_zg,
                           KIND, WORDS, HAS_ZEROS, not PER_CHANNEL and not GIVEN, EVEN_K, GPT, GW)
    if GIVEN:
        s, z = s_given, z_given
    v = _values(raw, T, KIND, WORDS, FP8_BITS, ASM, GPT, GW)
    if KIND == 2 and (PER_CHANNEL or GPT == 1):  # fp8 values are exact in x's dtype: scale after the dot
        d = _dot(x, tl.reshape(v, [o_n.shape[0], GPT * GW]).to(x.dtype), UPCAST, PRECISION)
        if not PER_CHANNEL:
            d = d * tl.reshape(s, [o_n.shape[0]])[None, :]
    else:
        w = _scaled(v, s, z, KIND)
        d = _dot(x, tl.reshape(w, [o_n.shape[0], GPT * GW]).to(x.dtype), UPCAST, PRECISION)
    return d


@triton.jit
def _scaled(v, s, z, KIND: tl.constexpr):
    """The fp32 weight [BLOCK_N, GPT, GW] of a tile's `_values` v and its chunks' s, z: int4 (q - z) s as
    v (16 s) - (16 + z) s, one FMA an element; otherwise (v - z) s (z = 0)."""
    if KIND == 0:
        return v * (16.0 * s)[:, :, None] - ((16.0 + z) * s)[:, :, None]
    return (v - z[:, :, None]) * s[:, :, None]


@triton.jit
def _finish(acc, acc_u, S, BIAS, R, Y, WS, CNT, tile, pid_k, o_m, m_m, o_n, m_n, M, N, N_OUT, stride_sn, stride_rm,
            stride_ym, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, PER_CHANNEL: tl.constexpr,
            SPLIT_K: tl.constexpr, BY_ROW: tl.constexpr):
    """Sum the splits (the last program of a tile to arrive reads the others' partials in split order: the same
    sum every run, as ops/decode_linear.py), then the epilogue. BY_ROW: the last program sums and finishes one real
    row of the tile at a time, so its registers hold SPLIT_K rows, not SPLIT_K tiles (a tile of 16 padded rows
    holding one or a few real ones: the code-MMA kernel's)."""
    if SPLIT_K > 1:
        m_y = m_m[:, None] & m_n[None, :]
        slice_size = N.to(tl.int64) * M
        o_ws = o_m.to(tl.int64)[:, None] * N + o_n[None, :]
        tl.store(WS + pid_k * slice_size + o_ws, acc, mask=m_y)
        if ACT != 0:
            tl.store(WS + pid_k * slice_size + o_ws + N_OUT, acc_u, mask=m_y)
        tl.debug_barrier()  # every thread's stores before the counter's gpu-scope release
        if tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tl.store(CNT + tile, 0)  # every split has arrived: the counter is free for the next call
            if BY_ROW:
                for r in range(tl.min(o_m, axis=0), tl.minimum(tl.max(o_m, axis=0) + 1, M)):  # the tile's real rows
                    o_r = tl.zeros([1], dtype=tl.int32) + r
                    a, a_u = _split_sum(WS, o_r.to(tl.int64)[:, None] * N + o_n[None, :], m_n[None, :], slice_size,
                                        N_OUT, ACT, SPLIT_K)
                    _epilogue(a, a_u, S, BIAS, R, Y, o_r, o_r < M, o_n, m_n, N_OUT, stride_sn, stride_rm, stride_ym,
                              HAS_BIAS, ACT, RESIDUAL, PER_CHANNEL)
            else:
                acc, acc_u = _split_sum(WS, o_ws, m_y, slice_size, N_OUT, ACT, SPLIT_K)
                _epilogue(acc, acc_u, S, BIAS, R, Y, o_m, m_m, o_n, m_n, N_OUT, stride_sn, stride_rm, stride_ym,
                          HAS_BIAS, ACT, RESIDUAL, PER_CHANNEL)
    else:
        _epilogue(acc, acc_u, S, BIAS, R, Y, o_m, m_m, o_n, m_n, N_OUT, stride_sn, stride_rm, stride_ym, HAS_BIAS,
                  ACT, RESIDUAL, PER_CHANNEL)


@triton.jit
def _split_sum(WS, o_ws, m_y, slice_size, N_OUT, ACT: tl.constexpr, SPLIT_K: tl.constexpr):
    """The partials at o_ws of every split, summed in split order (and the up half's, N_OUT along, with ACT).
    Unrolled: every split's load in flight at once (a loop waited on each in turn, on the critical path of the
    launch's last tile), summed in split order all the same."""
    acc = tl.zeros(o_ws.shape, dtype=tl.float32)
    acc_u = tl.zeros(o_ws.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(WS + s * slice_size + o_ws, mask=m_y, other=0.0, cache_modifier=".cg")
        if ACT != 0:
            acc_u += tl.load(WS + s * slice_size + o_ws + N_OUT, mask=m_y, other=0.0, cache_modifier=".cg")
    return acc, acc_u


@triton.jit
def _epilogue(acc, acc_u, S, BIAS, R, Y, o_m, m_m, o_n, m_n, N_OUT, stride_sn, stride_rm, stride_ym,
              HAS_BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """Per-channel scale, bias; with ACT act(gate) * up on the rounded halves; + residual on the rounded product."""
    dt = Y.dtype.element_ty
    if PER_CHANNEL:
        acc *= tl.load(S + o_n.to(tl.int64) * stride_sn, mask=m_n, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc_u *= tl.load(S + (o_n + N_OUT).to(tl.int64) * stride_sn, mask=m_n, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc_u += tl.load(BIAS + N_OUT + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    y = acc
    if ACT != 0:
        y = _act(acc.to(dt).to(tl.float32), ACT) * acc_u.to(dt).to(tl.float32)
    m_y = m_m[:, None] & m_n[None, :]
    if RESIDUAL:
        p_r = R + o_m.to(tl.int64)[:, None] * stride_rm + o_n[None, :]
        y = y.to(dt).to(tl.float32) + tl.load(p_r, mask=m_y, other=0.0).to(tl.float32)
    tl.store(Y + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :], y.to(dt), mask=m_y)
