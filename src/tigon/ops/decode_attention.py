"""Decode attention over a ring-buffer KV cache, read in place: flash-decoding in two Triton kernels.

One new query token per sequence attends to the keys of a fixed-capacity cache whose slots hold arbitrary
absolute positions (a ring written at `pos % C`, attention-sink slots, empty slots). Nothing is gathered
or reordered: each slot's position decides whether it is attended. Forward only (inference).

Layout contract (what `tigon.memory.RollingKVCache`, or any cache, hands over):
- `k_cache`, `v_cache`: `[B, Hkv, C, D]`, C = capacity slots, any strides (unit stride on D is fastest);
- `slot_pos`: int64 `[B, C]` (or `[C]`, shared by the batch), the absolute position stored in each slot,
  -1 for an empty slot;
- `q_pos`: int64 `[B]` (or `[1]` / `[]`, shared by the batch), the absolute position of the query token;
  on the device, never read by the host.
Slot s is attended iff `0 <= slot_pos[s] <= q_pos` and, with a sliding window w, `q_pos - slot_pos[s] < w`.
The caller writes the current token's key/value into the cache first, so at least one slot is attended;
a row with no attended slot comes out NaN (softmax over nothing), as in the reference.

Kernel 1 splits the C slots over `n_splits` programs per (sequence, kv head); each program loads the
Hq/Hkv query heads that share the kv head as one tile (K and V are read once per kv head), runs an online
softmax over its slots and writes (max, sum, unnormalized output) in fp32. Kernel 2 merges the splits.
The math and the byte model are in docs/ops/decode_attention.md.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from . import _launch, _library, _pdl, reference
from . import _rolling_buffer as _ws
from .config import DECODE_ATTENTION, DecodeAttentionConfig

# Launch settings: a DecodeAttentionConfig (ops/config.py), the measured defaults unless the caller passes one.
_MAX_GROUP_BLOCK = 64  # query heads per program; a larger GQA group is split over programs
MAX_HEAD_DIM = 256


@triton.jit(do_not_specialize=["C"])  # the ring's capacity: no recompile when C % 16 changes (kv_write.py)
def _decode_attention_split_kernel(
    Q,  # [B, Hq, 1, D] query
    K,  # [B, Hkv, C, D] key cache
    V,  # [B, Hkv, C, D] value cache
    SLOT_POS,  # [B, C] (stride_sb = 0 for a shared [C]) int64 absolute position per slot, -1 empty
    Q_POS,  # [B] int64 absolute position of the query
    OUT,  # [B, Hq, 1, D] output, written here when ONE_SPLIT
    M_PART,  # [B * Hq, n_splits] fp32 running max per split (when not ONE_SPLIT)
    L_PART,  # [B * Hq, n_splits] fp32 softmax denominator per split
    ACC_PART,  # [B * Hq, n_splits, D] fp32 unnormalized output per split
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kc, stride_kd,
    stride_vb, stride_vh, stride_vc, stride_vd,
    stride_sb, stride_sc,
    stride_qp,
    stride_ob, stride_oh,
    Hq,  # query heads
    Hkv,  # kv heads
    G,  # Hq // Hkv, query heads per kv head
    C,  # cache slots
    D,  # head dim
    chunk,  # slots per split, a multiple of BLOCK_N
    n_splits,
    n_gblk,  # programs per kv head along the query group (1 unless G > _MAX_GROUP_BLOCK)
    scale,  # runtime float: 1/sqrt(D) or the model's
    window,  # sliding window (read when HAS_WINDOW)
    softcap,  # logit softcap (read when HAS_SOFTCAP)
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter: fp32 dots (its bf16/fp16 arithmetic is wrong); GPU: native dots
    SPLIT_P: tl.constexpr,  # 16-bit inputs: p = p_hi + p_lo in the input dtype, two dots (p to ~2^-16)
    DOT_PRECISION: tl.constexpr,  # fp32 inputs on GPU: "tf32x3" (about fp32 accuracy on tensor cores)
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/_pdl.py)
):
    pid = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    gblk = pid % n_gblk
    hk = (pid // n_gblk) % Hkv
    b = pid // (n_gblk * Hkv)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    g = gblk * BLOCK_G + o_g
    m_g = g < G
    m_d = o_d < D
    o_hq = hk * G + g  # int64: query head of each tile row

    _pdl.wait(PDL)  # the query, the positions, the cache and every store: after the previous kernel
    p_q = Q + b * stride_qb + o_hq[:, None] * stride_qh + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_g[:, None] & m_d[None, :], other=0.0)
    if UPCAST:
        b_q = b_q.to(tl.float32)
    qp = tl.load(Q_POS + b * stride_qp)
    sc = tl.cast(scale, tl.float32)
    cap = tl.cast(softcap, tl.float32)

    b_m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    p_k0 = K + b * stride_kb + hk * stride_kh + o_d[None, :] * stride_kd
    p_v0 = V + b * stride_vb + hk * stride_vh + o_d[None, :] * stride_vd
    split_start = pid_s * chunk
    split_end = tl.minimum(split_start + chunk, C)
    for start in range(split_start, split_end, BLOCK_N):
        o_c = tl.cast(start, tl.int64) + o_n  # slot index, int64 before it meets the strides
        m_c = o_c < split_end
        sp = tl.load(SLOT_POS + b * stride_sb + o_c * stride_sc, mask=m_c, other=-1)
        m_s = m_c & (sp >= 0) & (sp <= qp)
        if HAS_WINDOW:
            m_s = m_s & (qp - sp < window)
        # Masked slots are not read: an empty or out-of-window slot costs no K/V bytes (whole masked
        # rows of a tile skip their memory transactions).
        m_kv = m_s[:, None] & m_d[None, :]
        b_k = tl.load(p_k0 + o_c[:, None] * stride_kc, mask=m_kv, other=0.0)
        b_v = tl.load(p_v0 + o_c[:, None] * stride_vc, mask=m_kv, other=0.0)
        if UPCAST:
            b_k = b_k.to(tl.float32)
            b_v = b_v.to(tl.float32)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * sc  # [BLOCK_G, BLOCK_N]
        if HAS_SOFTCAP:
            # cap * tanh(s / cap), tanh(u) = 2 sigmoid(2u) - 1 (no libdevice): abs error ~cap * 2^-24
            b_s = cap * (2.0 * tl.sigmoid(2.0 * b_s / cap) - 1.0)
        b_s = tl.where(m_s[None, :], b_s, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
        # A row with nothing attended yet keeps max -inf; subtracting 0 instead avoids -inf - -inf = NaN.
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_alpha = tl.exp(b_m - b_ms)
        b_p = tl.exp(b_s - b_ms[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None]
        if SPLIT_P:
            # p rounded once to bf16 would cost 2^-9 relative per weight (torch's own bf16 SDPA error);
            # hi + lo keeps ~16 bits for one more [G, N] x [N, D] dot, free in a memory-bound loop.
            b_ph = b_p.to(V.dtype.element_ty)
            b_pl = (b_p - b_ph.to(tl.float32)).to(V.dtype.element_ty)
            if UPCAST:
                b_ph = b_ph.to(tl.float32)
                b_pl = b_pl.to(tl.float32)
            b_acc = tl.dot(b_ph, b_v, b_acc, input_precision=DOT_PRECISION)
            b_acc = tl.dot(b_pl, b_v, b_acc, input_precision=DOT_PRECISION)
        else:
            b_acc = tl.dot(b_p, b_v, b_acc, input_precision=DOT_PRECISION)
        b_m = b_mn

    _pdl.start(PDL)  # after the loop (ops/_pdl.py)
    m_gd = m_g[:, None] & m_d[None, :]
    if ONE_SPLIT:
        # nothing attended: l = 0 and acc = 0 give NaN, as the reference's softmax over no keys
        b_o = b_acc / b_l[:, None]
        p_o = OUT + b * stride_ob + o_hq[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, b_o.to(OUT.dtype.element_ty), mask=m_gd)
    else:
        o_row = b * Hq + o_hq  # [BLOCK_G] row of the [B * Hq, n_splits] partials
        tl.store(M_PART + o_row * n_splits + pid_s, b_m, mask=m_g)
        tl.store(L_PART + o_row * n_splits + pid_s, b_l, mask=m_g)
        p_a = ACC_PART + (o_row[:, None] * n_splits + pid_s) * D + o_d[None, :]
        tl.store(p_a, b_acc, mask=m_gd)


@triton.jit
def _decode_attention_merge_kernel(
    M_PART,  # [B * Hq, n_splits] fp32
    L_PART,  # [B * Hq, n_splits] fp32
    ACC_PART,  # [B * Hq, n_splits, D] fp32
    OUT,  # [B, Hq, 1, D]
    Q_POS,  # int64 [n_pos] query positions, each advanced by one (ADVANCE) after kernel 1 has read them
    stride_ob, stride_oh,
    Hq,
    D,
    n_splits,
    n_pos,
    stride_qp,
    ADVANCE: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch: every access after the wait
):
    _pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    if ADVANCE:  # the caller's position counter, for the next step: kernel 1 has finished reading it
        if row == 0:
            o_p = tl.arange(0, BLOCK_P)
            p_p = Q_POS + o_p * stride_qp
            tl.store(p_p, tl.load(p_p, mask=o_p < n_pos) + 1, mask=o_p < n_pos)
    b = row // Hq
    hq = row % Hq
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < n_splits
    m_d = o_d < D
    b_m = tl.load(M_PART + row * n_splits + o_s, mask=m_s, other=float("-inf"))
    b_l = tl.load(L_PART + row * n_splits + o_s, mask=m_s, other=0.0)
    p_a = ACC_PART + (row * n_splits + o_s[:, None]) * D + o_d[None, :]
    b_a = tl.load(p_a, mask=m_s[:, None] & m_d[None, :], other=0.0)
    b_mx = tl.max(b_m, axis=0)
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)  # no split attended anything: 0 / 0 = NaN below
    b_w = tl.exp(b_m - b_mx)  # splits that attended nothing (max -inf) weigh 0
    b_o = tl.sum(b_w[:, None] * b_a, axis=0) / tl.sum(b_w * b_l, axis=0)
    tl.store(OUT + b * stride_ob + hq * stride_oh + o_d, b_o.to(OUT.dtype.element_ty), mask=m_d)


def _block_n(device, d_block: int, cfg: DecodeAttentionConfig) -> int:
    if cfg.block_n:
        return cfg.block_n
    if device.type != "cuda":
        return 16
    return 64 if d_block <= 128 else 32  # [64, 128] bf16 K and V tiles: 32 KiB in flight per stage


@functools.lru_cache(maxsize=256)  # one loop over the cache's steps per shape, not per call
def _splits_for(C: int, block_n: int, programs: int, per_wave: int, cfg: DecodeAttentionConfig) -> int:
    """The split count whose programs fill their last wave best: a memory-bound grid of `programs * s` programs
    runs in ceil(programs * s / per_wave) waves, and a last wave that is a quarter full costs a whole wave's
    time at a quarter of the bandwidth. Candidates give every split a whole number of `block_n` steps, at least
    `min_split_slots` slots, at most `max_splits` splits; of those within `wave_slack_pct` percent of the best
    fill, the fewest splits (the least partial-sum traffic and merge work)."""
    steps = _launch.cdiv(C, block_n)
    least = _launch.cdiv(cfg.min_split_slots, block_n)
    fills = {}
    for per_split in range(min(least, steps), steps + 1):
        s = _launch.cdiv(steps, per_split)
        if s <= cfg.max_splits and s not in fills:
            waves = programs * s / per_wave
            fills[s] = waves / math.ceil(waves)
    best = max(fills.values())
    return min(s for s, f in fills.items() if 100 * f >= (100 - cfg.wave_slack_pct) * best)


_PER_WAVE: dict = {}  # launch key -> programs of the split kernel the GPU runs at once


def _per_wave(key, device_index: int, warps: int, compile_kernel) -> int:
    """Programs of the split kernel resident on the whole GPU at once, from its compiled registers and shared
    memory (compiled once per key, ahead of its first launch; two programs an SM if the kernel does not say)."""
    found = _PER_WAVE.get(key)
    if found is None:
        per_sm = _launch.programs_per_sm(compile_kernel(), device_index, warps) or 2
        found = _PER_WAVE[key] = per_sm * _launch.sm_count(device_index)
    return found


def _launch_shape(q, k_cache, v_cache, C, programs, block_n, kernel_key, cfg, compile_kernel) -> tuple[int, int]:
    """(num_warps, n_splits) of the split kernel. On a GPU: the split count from `_splits_for` at the launch's
    compiled occupancy, with two warps a program, or four where two warps' pick leaves fewer programs than SMs
    (a short cache at batch 1: more loads in flight a program). `kernel_key`: the split kernel's other
    compile-time settings (head-dim and group tiles, window, softcap). The interpreter, or a config that gives
    both: the config's (else 4 warps, 2 splits)."""
    if q.device.type != "cuda" or (cfg.n_splits and cfg.num_warps):  # the interpreter pays ~1 ms a program
        return cfg.num_warps or 4, max(1, min(cfg.n_splits or 2, _launch.cdiv(C, block_n)))
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    spec = (index, q.dtype, block_n, cfg.num_stages, *kernel_key, tuple(  # what selects the compiled kernel
        v % 16 == 0 for v in (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), q.stride(0), q.stride(1),
                              *k_cache.stride()[:3], *v_cache.stride()[:3])))
    for warps in (cfg.num_warps,) if cfg.num_warps else (2, 4):
        n = cfg.n_splits or _splits_for(C, block_n, programs,
                                        _per_wave((*spec, warps), index, warps, lambda w=warps: compile_kernel(w)),
                                        cfg)
        if cfg.num_warps or programs * n >= _launch.sm_count(index):
            break
    return warps, max(1, min(n, _launch.cdiv(C, block_n)))


def _dot_precision(dtype, interp: bool) -> str:
    if interp:
        return "ieee"  # numpy fp32 matmul
    # fp32 operands: 3 tf32 products (~fp32 accuracy; plain tf32 would cost 2^-11 relative per score).
    # 16-bit operands ignore it; "tf32" is the default that every dtype accepts.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _fwd_launch(q, k_cache, v_cache, slot_pos, q_pos, scale, window, softcap, advance=None, cfg=DECODE_ATTENTION,
                per_call_scratch=False):
    """advance: None, or the int64 tensor q_pos is a view of, to add one to once the positions are read.
    per_call_scratch: the split partials allocated for this call (`_rolling_buffer.split_scratch`)."""
    B, Hq, _, D = q.shape
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.empty((B, Hq, 1, D), dtype=q.dtype, device=q.device)
    if B == 0 or Hq == 0:
        if advance is not None:
            advance.add_(1)
        return out
    block_d = max(16, _launch.next_power_of_2(D))  # tl.dot needs every dim >= 16
    block_g = min(max(16, _launch.next_power_of_2(G)), _MAX_GROUP_BLOCK)
    n_gblk = _launch.cdiv(G, block_g)
    block_n = _block_n(q.device, block_d, cfg)
    interp = q.device.type != "cuda"
    pdl = _pdl.enabled(q.device)
    shared_pos = slot_pos.dim() == 1

    def split_kernel(grid, chunk, n_splits, one, warps, parts, warmup=False):
        m_part, l_part, acc_part = parts
        kernel = _decode_attention_split_kernel.warmup if warmup else _decode_attention_split_kernel[grid]
        return kernel(
            q, k_cache, v_cache, slot_pos, q_pos, out, m_part, l_part, acc_part,
            q.stride(0), q.stride(1), q.stride(3),
            *k_cache.stride(), *v_cache.stride(),
            0 if shared_pos else slot_pos.stride(0), slot_pos.stride(-1),
            q_pos.stride(0),
            out.stride(0), out.stride(1),
            Hq, Hkv, G, C, D, chunk, n_splits, n_gblk, scale, window, softcap if softcap else 1.0,
            HAS_WINDOW=bool(window), HAS_SOFTCAP=bool(softcap), ONE_SPLIT=one,
            UPCAST=interp, SPLIT_P=q.dtype != torch.float32, DOT_PRECISION=_dot_precision(q.dtype, interp),
            BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, PDL=pdl,
            num_warps=warps, num_stages=cfg.num_stages, **_pdl.launch_options(pdl), **(
                dict(grid=grid) if warmup else {}))

    programs = B * Hkv * n_gblk
    # the multi-split kernel compiled (not launched) for its occupancy: these arguments, stand-in partials
    kernel_key = (block_d, block_g, bool(window), bool(softcap))
    warps, n_splits = _launch_shape(q, k_cache, v_cache, C, programs, block_n, kernel_key, cfg, lambda w: split_kernel(
        (programs, 2), block_n, 2, False, w, (torch.empty(4, dtype=torch.float32, device=q.device),) * 3, warmup=True))
    chunk = _launch.cdiv(_launch.cdiv(C, n_splits), block_n) * block_n
    n_splits = _launch.cdiv(C, chunk)  # no split without slots
    one = n_splits == 1
    if one:
        parts = (out, out, out)
    else:
        # Per-split partials from one pinned buffer of the arena (a stable address for a captured decode step,
        # nothing allocated per step once it fits): m and l [B Hq, n_splits], then acc [B Hq, n_splits, D].
        n = B * Hq * n_splits
        part = _ws.split_scratch(q.device, "decode_attention.partials", n * (D + 2), torch.float32,
                                 per_call=per_call_scratch)
        parts = (part[:n].view(B * Hq, n_splits), part[n:2 * n].view(B * Hq, n_splits),
                 part[2 * n:n * (D + 2)].view(B * Hq, n_splits, D))
    split_kernel((programs, n_splits), chunk, n_splits, one, warps, parts)
    if not one:
        adv = advance if advance is not None else q_pos
        _decode_attention_merge_kernel[(B * Hq,)](
            *parts, out, adv, out.stride(0), out.stride(1), Hq, D, n_splits,
            adv.numel(), adv.stride(0) if adv.dim() else 1,
            ADVANCE=advance is not None, BLOCK_S=_launch.next_power_of_2(n_splits), BLOCK_D=block_d,
            BLOCK_P=_launch.next_power_of_2(max(adv.numel(), 1)), PDL=pdl, num_warps=4,
            **_pdl.launch_options(pdl),
        )
    elif advance is not None:  # no merge kernel to carry it
        advance.add_(1)
    return out


@torch.library.custom_op("tigon::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pos: torch.Tensor,
    q_pos: torch.Tensor, scale: float, sliding_window: int, softcap: float, config: list[int] | None = None,
) -> torch.Tensor:
    """q [B, Hq, 1, D], caches [B, Hkv, C, D], slot_pos int64 [B, C] or [C], q_pos int64 [B];
    sliding_window 0 and softcap 0.0 mean none; config: None (the defaults) or `DecodeAttentionConfig.ints()`.
    Returns [B, Hq, 1, D] in q.dtype (contiguous)."""
    cfg = DecodeAttentionConfig(*config) if config is not None else DECODE_ATTENTION
    return _fwd_launch(q, k_cache, v_cache, slot_pos, q_pos, scale, sliding_window, softcap, cfg=cfg,
                       per_call_scratch=True)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, slot_pos, q_pos, scale, sliding_window, softcap, config=None):
    return q.new_empty((q.shape[0], q.shape[1], 1, q.shape[3]))


def _validate(q, k_cache, v_cache, slot_pos, q_pos, scale, sliding_window, softcap):
    op = "tigon.ops.decode_attention"
    _launch.check_tensor(op, "q", q)
    _launch.check_tensor(op, "k_cache", k_cache)
    _launch.check_tensor(op, "v_cache", v_cache)
    _launch.check_tensor(op, "slot_pos", slot_pos, floating=False)
    _launch.check_tensor(op, "q_pos", q_pos, floating=False)
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"{op}: q must have shape [B, Hq, 1, D], got {tuple(q.shape)}")
    B, Hq, _, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"{op}: k_cache must have shape [B={B}, Hkv, C, D={D}], got {tuple(k_cache.shape)}")
    _launch.check_shape(op, "v_cache", v_cache, k_cache.shape)
    _launch.check_same_dtype(op, "q", q, k_cache=k_cache, v_cache=v_cache)
    _launch.check_same_device(op, "q", q, k_cache=k_cache, v_cache=v_cache, slot_pos=slot_pos, q_pos=q_pos)
    Hkv, C = k_cache.shape[1], k_cache.shape[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{op}: q heads ({Hq}) must be a multiple of k_cache heads ({Hkv})")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim D = {D} must be in [1, {MAX_HEAD_DIM}]")
    if C == 0:
        raise ValueError(f"{op}: k_cache has no slots (C = 0)")
    if slot_pos.dtype != torch.int64:
        raise TypeError(f"{op}: slot_pos must be int64, got {slot_pos.dtype}")
    if tuple(slot_pos.shape) not in ((B, C), (C,)):
        raise ValueError(f"{op}: slot_pos must have shape ({B}, {C}) or ({C},), got {tuple(slot_pos.shape)}")
    if q_pos.dtype != torch.int64:
        raise TypeError(f"{op}: q_pos must be int64, got {q_pos.dtype}")
    if tuple(q_pos.shape) not in ((B,), (1,), ()):
        raise ValueError(f"{op}: q_pos must have shape ({B},), (1,) or (), got {tuple(q_pos.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat)) or not _launch.finite(scale):
        raise ValueError(f"{op}: scale must be a finite number or None, got {scale!r}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float, torch.SymFloat))
                                or not _launch.finite(softcap) or softcap <= 0):
        raise ValueError(f"{op}: softcap must be a finite number > 0 or None, got {softcap!r}")
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        raise RuntimeError(f"{op}: inference only, no backward; call it under torch.no_grad() or on detached "
                           "tensors")
    return float(scale), int(sliding_window or 0), float(softcap or 0.0)


def decode_attention(q, k_cache, v_cache, slot_pos, q_pos, *, scale=None, sliding_window=None, softcap=None,
                     advance_q_pos=False, config=None):
    """One decode step of attention over a ring-buffer KV cache read in place (layout: the module docstring).

    q [B, Hq, 1, D], k_cache / v_cache [B, Hkv, C, D] in q's dtype (fp32/fp16/bf16), Hq a multiple of Hkv,
    D <= 256; slot_pos int64 [B, C] or [C] (-1 = empty), q_pos int64 [B], [1] or []. scale defaults to
    1/sqrt(D); sliding_window w keeps q_pos - pos < w; softcap c maps the scaled scores s to c * tanh(s / c)
    (Gemma-2). advance_q_pos: add 1 to q_pos in place once it is read (a decode loop's position counter for
    the next step, folded into the split merge: no kernel of its own); q_pos must then be contiguous. config: a
    `DecodeAttentionConfig` (splits, tile, warps; None: the measured defaults).
    Returns [B, Hq, 1, D] in q's dtype. No autograd; no host sync.
    """
    scale, window, softcap = _validate(q, k_cache, v_cache, slot_pos, q_pos, scale, sliding_window, softcap)
    if config is not None and not isinstance(config, DecodeAttentionConfig):
        raise TypeError(f"tigon.ops.decode_attention: config must be a tigon.ops.DecodeAttentionConfig or "
                        f"None, got {type(config).__name__}")
    if advance_q_pos and not q_pos.is_contiguous():
        raise ValueError(f"tigon.ops.decode_attention: advance_q_pos=True needs a contiguous q_pos (it is updated in "
                         f"place), got strides {q_pos.stride()}")
    counter = q_pos
    q_pos = q_pos.reshape(-1).expand(q.shape[0])  # one position for the batch: a stride-0 view, no copy
    if not _library.use_kernels("decode_attention", q):
        out = reference.decode_attention(q, k_cache, v_cache, slot_pos, q_pos, scale=scale,
                                         sliding_window=window, softcap=softcap)
        if advance_q_pos:
            counter.add_(1)
        return out
    return _library.dispatch(_traced, None, _eager, q, k_cache, v_cache, slot_pos, q_pos, scale, window, softcap,
                             counter.view(-1) if advance_q_pos else None, config)


def _traced(q, k_cache, v_cache, slot_pos, q_pos, scale, window, softcap, advance, config):
    """torch.compile: the custom op, the config as plain ints across its boundary, the counter advanced after."""
    out = torch.ops.tigon.decode_attention(q, k_cache, v_cache, slot_pos, q_pos, scale, window, softcap,
                                           config.ints() if config is not None else None)
    if advance is not None:
        advance.add_(1)
    return out


def _eager(q, k_cache, v_cache, slot_pos, q_pos, scale, window, softcap, advance, config):
    """Eager: the launcher, the counter advanced by the merge kernel (no kernel of its own)."""
    return _fwd_launch(q, k_cache, v_cache, slot_pos, q_pos, scale, window, softcap, advance=advance,
                       cfg=config if config is not None else DECODE_ATTENTION)
