"""RMSNorm of every head of q and k over head_dim, then rotate-half RoPE, in one kernel (Qwen3's attention input).

    q_embed, k_embed = apply_rope(rms_norm(q, q_weight), rms_norm(k, k_weight), cos, sin, unsqueeze_dim=2)

Each head of a token is a row of D elements. Forward, per row: rstd = 1 / sqrt(mean(x^2) + eps); y = (offset + w) *
n with n = x * rstd (rounded to x.dtype first in "llama" casting), y rounded to its output dtype as the norm's
output is; then with y1, y2 the halves of y and c, s the halves of cos, sin at the row's token:
o1 = y1 c1 - y2 s1, o2 = y2 c2 + y1 s2, one cast on store. The result equals rms_norm then apply_rope.
Backward, per row: dy = the transposed rotation of do (dy1 = do1 c1 + do2 s2, dy2 = do2 c2 - do1 s1, kept in fp32),
then the norm's backward (dx = rstd (dn - n mean(dn n)), dn = dy (offset + w), dw = sum over rows of dy * n);
rstd is recomputed from x, which the backward reads anyway.

A tile is `tile_elems` elements of one tensor (QKNormRopeConfig): tokens x heads x head_dim, all heads of a token
where they fit, so cos / sin are read once a token. Forward and backward launch one program a tile of q and of k;
each backward program also writes its tile's partial row of dw_q or dw_k, summed in a fixed order after
(deterministic; 1/16 of the traffic of x at head_dim 64 and 2048-element tiles). A persistent backward (programs
looping over tiles, one partial row each) ran 1.4x slower on the H200 at head_dim 64 (175 vs 125 us, the best
setting of each): its few resident programs, each loading a tile only after storing the last, kept too few bytes
in flight. Against the two ops run one after the other, the
normalized heads never travel through HBM: one write and one read of q and k saved each way. The math and the
byte model are in docs/ops/qk_norm_rope.md.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, _library, reference
from .config import QKNormRopeConfig
from .rms_norm import _CASTING, _CASTING_NAMES
from .rope import check_cos_sin

_DEFAULT = tuple(QKNormRopeConfig().ints())
_OP = "tigon.ops.qk_norm_rope"


@triton.jit
def _tile(X, G, COS, SIN, tile, n_tok, H, T, sxb, sxt, sxh, sgb, sgt, sgh, scb, sct, scd, ssb, sst, ssd, HALF,
          BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """A tile of one tensor: BLOCK_T tokens x BLOCK_H heads x the two halves of head_dim. Returns (the dense row
    index of each (token, head) [BLOCK_T, BLOCK_H, 1], the element mask, pointers to the first halves in X and in
    G (a second tensor of the same shape, its own strides; the backward's output gradient), and the four halves of
    cos / sin at the tokens, fp32 [BLOCK_T, 1, BLOCK_R]: read once a token, not once a head)."""
    n_hb = tl.cdiv(H, BLOCK_H)
    o_t = tl.cast(tile // n_hb, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_h = tl.cast(tile % n_hb, tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    o_r = tl.arange(0, BLOCK_R)
    b = o_t // T
    t = o_t % T
    m_t = o_t < n_tok
    m_r = o_r < HALF
    m = (m_t[:, None] & (o_h < H)[None, :])[:, :, None] & m_r[None, None, :]
    row = (o_t[:, None] * H + o_h[None, :])[:, :, None]
    p_x = X + ((b * sxb + t * sxt)[:, None] + (o_h * sxh)[None, :])[:, :, None] + o_r[None, None, :]
    p_g = G + ((b * sgb + t * sgt)[:, None] + (o_h * sgh)[None, :])[:, :, None] + o_r[None, None, :]
    m_cs = m_t[:, None] & m_r[None, :]
    p_c = COS + (b * scb + t * sct)[:, None] + o_r[None, :] * scd
    p_s = SIN + (b * ssb + t * sst)[:, None] + o_r[None, :] * ssd
    c1 = tl.load(p_c, mask=m_cs, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(p_c + HALF * scd, mask=m_cs, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(p_s, mask=m_cs, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(p_s + HALF * ssd, mask=m_cs, other=0.0).to(tl.float32)[:, None, :]
    return row, m, p_x, p_g, c1, c2, s1, s2


@triton.jit
def _normed(p_x, m, W, D, eps, offset, BLOCK_R: tl.constexpr):
    """rstd [T, H, 1], n's halves (n = x * rstd in fp32) and the weight's halves (offset added) [1, 1, BLOCK_R]."""
    HALF = D // 2
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < HALF
    x1 = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p_x + HALF, mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)
    rstd = (1.0 / tl.sqrt(tl.math.div_rn(ss, tl.cast(D, tl.float32)) + eps))[:, :, None]
    w1 = tl.load(W + o_r, mask=m_r, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    w2 = tl.load(W + HALF + o_r, mask=m_r, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    return rstd, x1 * rstd, x2 * rstd, w1[None, None, :], w2[None, None, :]


@triton.jit
def _fwd_tile(X, W, Y, COS, SIN, tile, n_tok, H, T, sxb, sxt, sxh, scb, sct, scd, ssb, sst, ssd, D, eps, offset,
              CASTING: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    HALF = D // 2
    row, m, p_x, _, c1, c2, s1, s2 = _tile(X, X, COS, SIN, tile, n_tok, H, T, sxb, sxt, sxh, sxb, sxt, sxh, scb, sct,
                                           scd, ssb, sst, ssd, HALF, BLOCK_T, BLOCK_H, BLOCK_R)
    _, n1, n2, w1, w2 = _normed(p_x, m, W, D, eps, offset, BLOCK_R)
    if CASTING == 0:  # llama: the normalized x rounded to x.dtype before the weight
        n1 = n1.to(X.dtype.element_ty).to(tl.float32)
        n2 = n2.to(X.dtype.element_ty).to(tl.float32)
    # the norm's output, rounded as rms_norm stores it, then rotated in fp32
    y1 = (n1 * w1).to(Y.dtype.element_ty).to(tl.float32)
    y2 = (n2 * w2).to(Y.dtype.element_ty).to(tl.float32)
    p_y = Y + row * D + tl.arange(0, BLOCK_R)[None, None, :]
    tl.store(p_y, (y1 * c1 - y2 * s1).to(Y.dtype.element_ty), mask=m)
    tl.store(p_y + HALF, (y2 * c2 + y1 * s2).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_rope_fwd_kernel(
    Q, K, WQ, WK, QO, KO, COS, SIN,  # q [B, T, Hq, D], k [B, T, Hk, D] any strides, unit on D; outputs dense
    n_tok, Hq, Hk, T, D,  # tokens (B * T), heads, tokens a sequence, head dim
    sqb, sqt, sqh, skb, skt, skh,  # q / k strides (batch, token, head)
    scb, sct, scd, ssb, sst, ssd,  # cos / sin strides (batch stride 0 when shared)
    eps, offset,
    CASTING: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TQ: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    pid = tl.program_id(0)
    q_tiles = tl.cdiv(n_tok, BLOCK_TQ) * tl.cdiv(Hq, BLOCK_HQ)
    if pid < q_tiles:
        _fwd_tile(Q, WQ, QO, COS, SIN, pid, n_tok, Hq, T, sqb, sqt, sqh, scb, sct, scd, ssb, sst, ssd, D, eps, offset,
                  CASTING, BLOCK_TQ, BLOCK_HQ, BLOCK_R)
    else:
        _fwd_tile(K, WK, KO, COS, SIN, pid - q_tiles, n_tok, Hk, T, skb, skt, skh, scb, sct, scd, ssb, sst, ssd, D,
                  eps, offset, CASTING, BLOCK_TK, BLOCK_HK, BLOCK_R)


@triton.jit
def _bwd_tile(DO, X, W, DX, COS, SIN, DW_PART, tile, n_tok, H, T, sdb, sdt, sdh, sxb, sxt, sxh,
              scb, sct, scd, ssb, sst, ssd, D, eps, offset, COMPUTE_DW: tl.constexpr, CASTING: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """One tile of one tensor: dx, and the tile's partial dw row at DW_PART[tile]."""
    HALF = D // 2
    o_r = tl.arange(0, BLOCK_R)
    row, m, p_x, p_do, c1, c2, s1, s2 = _tile(X, DO, COS, SIN, tile, n_tok, H, T, sxb, sxt, sxh, sdb, sdt, sdh,
                                              scb, sct, scd, ssb, sst, ssd, HALF, BLOCK_T, BLOCK_H, BLOCK_R)
    rstd, n1, n2, w1, w2 = _normed(p_x, m, W, D, eps, offset, BLOCK_R)
    do1 = tl.load(p_do, mask=m, other=0.0).to(tl.float32)
    do2 = tl.load(p_do + HALF, mask=m, other=0.0).to(tl.float32)
    dy1 = do1 * c1 + do2 * s2  # the rotation's transpose
    dy2 = do2 * c2 - do1 * s1
    if COMPUTE_DW:
        if CASTING == 0:
            dw1 = tl.sum(tl.sum(dy1 * n1.to(X.dtype.element_ty).to(tl.float32), axis=1), axis=0)
            dw2 = tl.sum(tl.sum(dy2 * n2.to(X.dtype.element_ty).to(tl.float32), axis=1), axis=0)
        else:
            dw1 = tl.sum(tl.sum(dy1 * n1, axis=1), axis=0)
            dw2 = tl.sum(tl.sum(dy2 * n2, axis=1), axis=0)
        p_dw = DW_PART + tl.cast(tile, tl.int64) * D + o_r
        tl.store(p_dw, dw1, mask=o_r < HALF)
        tl.store(p_dw + HALF, dw2, mask=o_r < HALF)
    dn1 = dy1 * w1
    dn2 = dy2 * w2
    inv_d = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.cast(D, tl.float32))
    dot = ((tl.sum(dn1 * n1, axis=2) + tl.sum(dn2 * n2, axis=2)) * inv_d)[:, :, None]
    p_dx = DX + row * D + o_r[None, None, :]
    tl.store(p_dx, (rstd * (dn1 - n1 * dot)).to(DX.dtype.element_ty), mask=m)
    tl.store(p_dx + HALF, (rstd * (dn2 - n2 * dot)).to(DX.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    DQO, DKO, Q, K, WQ, WK, DQ, DK, COS, SIN, DWQ_PART, DWK_PART,  # DW*_PART [tiles, D] fp32
    n_tok, Hq, Hk, T, D,
    sdqb, sdqt, sdqh, sdkb, sdkt, sdkh,  # strides of the output gradients (batch, token, head)
    sqb, sqt, sqh, skb, skt, skh,
    scb, sct, scd, ssb, sst, ssd,
    eps, offset,
    COMPUTE_DW: tl.constexpr, CASTING: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TQ: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    pid = tl.program_id(0)
    q_tiles = tl.cdiv(n_tok, BLOCK_TQ) * tl.cdiv(Hq, BLOCK_HQ)
    if pid < q_tiles:
        _bwd_tile(DQO, Q, WQ, DQ, COS, SIN, DWQ_PART, pid, n_tok, Hq, T, sdqb, sdqt, sdqh, sqb, sqt, sqh,
                  scb, sct, scd, ssb, sst, ssd, D, eps, offset, COMPUTE_DW, CASTING, BLOCK_TQ, BLOCK_HQ, BLOCK_R)
    else:
        _bwd_tile(DKO, K, WK, DK, COS, SIN, DWK_PART, pid - q_tiles, n_tok, Hk, T, sdkb, sdkt, sdkh, skb, skt, skh,
                  scb, sct, scd, ssb, sst, ssd, D, eps, offset, COMPUTE_DW, CASTING, BLOCK_TK, BLOCK_HK, BLOCK_R)


def _blocks(H, block_r, tile_elems):
    """(tokens, heads) of a tile of `tile_elems` elements of one tensor with H heads of 2 * block_r: all heads of
    a token where they fit (cos / sin read once a token), else a power-of-two block of them."""
    block_h = min(_launch.next_power_of_2(max(H, 1)), max(1, tile_elems // (2 * block_r)))
    return max(1, tile_elems // (2 * block_r * block_h)), block_h


def _plan(Hq, Hk, D, config):
    """(the launches' block constexprs, forward warps, backward warps): the config's where it sets them, else tiles
    of 32 heads (at most 4096 elements), a forward warp per 1024 elements and 2 backward warps. From the H200 sweep
    at Qwen3's shape (8 x 2048 tokens, 32 q / 8 k heads; tune.py --ops qk_norm_rope): fwd+bwd 184.6 us at head_dim
    64 (2048-element tiles; 4096 x 4 warps both ways: 229.4) and 404.5 at 128 (4096; the backward 125 / 289 us with
    2 warps, 167 / 298 with 4). The cap keeps wider heads in the measured envelope: 2 backward warps over 4096
    elements already take 255 registers a thread (sm_90)."""
    tile_elems, fwd_warps, bwd_warps = config or _DEFAULT
    block_r = _launch.next_power_of_2(D // 2)
    tile_elems = tile_elems or min(64 * block_r, 4096)
    fwd_warps, bwd_warps = fwd_warps or max(1, min(8, tile_elems // 1024)), bwd_warps or 2
    (tq, hq), (tk, hk) = _blocks(Hq, block_r, tile_elems), _blocks(Hk, block_r, tile_elems)
    blocks = dict(BLOCK_R=block_r, BLOCK_TQ=tq, BLOCK_HQ=hq, BLOCK_TK=tk, BLOCK_HK=hk)
    return blocks, fwd_warps, bwd_warps


def _n_tiles(n_tok, H, block_t, block_h):
    return _launch.cdiv(n_tok, block_t) * _launch.cdiv(H, block_h)


def _bth(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _cos_sin_strides(cos, sin):
    return ((cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1), cos.stride(2),
            (sin.stride(0) if sin.shape[0] > 1 else 0), sin.stride(1), sin.stride(2))


def _out_dtype(x, w, casting):
    return reference.rms_norm_out_dtype(x.dtype, w.dtype, _CASTING_NAMES[casting])


def _fwd_launch(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, offset: float, casting: int, config: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D], k [B, T, Hk, D] with unit last stride; weights [D] contiguous; cos, sin [1 or B, T, D].
    Returns (q_embed, k_embed), dense [B, T, H, D]. config: None or `QKNormRopeConfig.ints()`."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    qo = torch.empty(q.shape, dtype=_out_dtype(q, q_weight, casting), device=q.device)
    ko = torch.empty(k.shape, dtype=_out_dtype(k, k_weight, casting), device=k.device)
    n_tok = B * T
    if n_tok * (Hq + Hk) == 0 or D == 0:
        return qo, ko
    blocks, fwd_warps, _ = _plan(Hq, Hk, D, config)
    grid = (_n_tiles(n_tok, Hq, blocks["BLOCK_TQ"], blocks["BLOCK_HQ"])
            + _n_tiles(n_tok, Hk, blocks["BLOCK_TK"], blocks["BLOCK_HK"]),)
    _qk_norm_rope_fwd_kernel[grid](
        q, k, q_weight, k_weight, qo, ko, cos, sin, n_tok, Hq, Hk, T, D, *_bth(q), *_bth(k),
        *_cos_sin_strides(cos, sin), eps, offset, CASTING=casting, num_warps=fwd_warps, **blocks,
    )
    return qo, ko


def _bwd_launch(
    dqo: torch.Tensor, dko: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, offset: float, casting: int,
    compute_dw: bool, config: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk dense in q's / k's dtype, dw_q, dw_k in the weights' dtypes, or empty without compute_dw)."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    dq, dk = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n_tok = B * T
    blocks, _, bwd_warps = _plan(Hq, Hk, D, config)
    q_tiles = _n_tiles(n_tok, Hq, blocks["BLOCK_TQ"], blocks["BLOCK_HQ"])
    k_tiles = _n_tiles(n_tok, Hk, blocks["BLOCK_TK"], blocks["BLOCK_HK"])
    dwq_part = torch.empty((q_tiles, D), dtype=torch.float32, device=q.device) if compute_dw else q.new_empty(0)
    dwk_part = torch.empty((k_tiles, D), dtype=torch.float32, device=q.device) if compute_dw else q.new_empty(0)
    if q_tiles + k_tiles > 0:
        _qk_norm_rope_bwd_kernel[(q_tiles + k_tiles,)](
            dqo, dko, q, k, q_weight, k_weight, dq, dk, cos, sin, dwq_part, dwk_part,
            n_tok, Hq, Hk, T, D, *_bth(dqo), *_bth(dko), *_bth(q), *_bth(k), *_cos_sin_strides(cos, sin),
            eps, offset, COMPUTE_DW=compute_dw, CASTING=casting, num_warps=bwd_warps, **blocks,
        )
    if not compute_dw:
        return dq, dk, q.new_empty(0), q.new_empty(0)
    # fixed-order sums of the tiles' rows (an empty sum is zeros); two tensors: a custom op's outputs may not alias
    return dq, dk, dwq_part.sum(0).to(q_weight.dtype), dwk_part.sum(0).to(k_weight.dtype)


def _fwd_fake(q, k, q_weight, k_weight, cos, sin, eps, offset, casting, config=None):
    return (q.new_empty(q.shape, dtype=_out_dtype(q, q_weight, casting)),
            k.new_empty(k.shape, dtype=_out_dtype(k, k_weight, casting)))


def _bwd_fake(dqo, dko, q, k, q_weight, k_weight, cos, sin, eps, offset, casting, compute_dw, config=None):
    if not compute_dw:  # dq, dk dense as the launcher's torch.empty(q.shape): not empty_like (q's strides)
        return q.new_empty(q.shape), k.new_empty(k.shape), q.new_empty(0), q.new_empty(0)
    return (q.new_empty(q.shape), k.new_empty(k.shape), torch.empty_like(q_weight), torch.empty_like(k_weight))


_QK_NORM_ROPE_BWD = _library.Kernel("qk_norm_rope_bwd", _bwd_launch, _bwd_fake)


def _setup(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, eps, offset, casting = inputs[:9]
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
    ctx.eps, ctx.offset, ctx.casting = eps, offset, casting
    ctx.config, ctx.n_inputs = (inputs[9] if len(inputs) > 9 else None), len(inputs)


def _backward(ctx, dqo, dko):
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    needs = ctx.needs_input_grad[:4]
    if _library.double_backward():
        def fn(q, k, wq, wk):
            return reference.qk_norm_rope(q, k, wq, wk, cos, sin, ctx.eps, offset=ctx.offset,
                                          casting_mode=_CASTING_NAMES[ctx.casting])

        grads = _library.reference_grads(fn, (q, k, q_weight, k_weight), needs, (dqo, dko))
        return tuple(grads) + (None,) * (ctx.n_inputs - 4)
    compute_dw = bool(needs[2] or needs[3])
    dq, dk, dwq, dwk = _QK_NORM_ROPE_BWD.on(ctx)(
        _launch.unit_last(dqo), _launch.unit_last(dko), q, k, q_weight, k_weight, cos, sin, ctx.eps, ctx.offset,
        ctx.casting, compute_dw, ctx.config,
    )
    grads = (dq, dk, dwq if compute_dw else None, dwk if compute_dw else None)
    return tuple(g if n else None for g, n in zip(grads, needs)) + (None,) * (ctx.n_inputs - 4)


_QK_NORM_ROPE = _library.Op("qk_norm_rope_fwd", _fwd_launch, _fwd_fake, _setup, _backward)


def _validate(q, k, q_weight, k_weight, cos, sin, eps, offset, casting_mode, config):
    for name, t in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos),
                    ("sin", sin)):
        _launch.check_tensor(_OP, name, t)
    _launch.check_same_device(_OP, "q", q, k=k, q_weight=q_weight, k_weight=k_weight, cos=cos, sin=sin)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be 4-D [batch, tokens, heads, head_dim], got shape {tuple(t.shape)}")
    B, T, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != T or k.shape[3] != D:
        raise ValueError(f"{_OP}: k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, tokens and head_dim")
    if D % 2:
        raise ValueError(f"{_OP}: head_dim must be even (rotate-half RoPE), got {D}")
    _launch.row_block(_OP, D, "head_dim")
    _launch.check_shape(_OP, "q_weight", q_weight, (D,))
    _launch.check_shape(_OP, "k_weight", k_weight, (D,))
    check_cos_sin(_OP, cos, sin, B, T, D)
    if cos.shape[2] != D:
        raise ValueError(f"{_OP}: cos must rotate the whole head (rotary_dim == head_dim {D}), got rotary_dim "
                         f"{cos.shape[2]}; partial rotary: rms_norm then apply_rope")
    if casting_mode not in _CASTING:
        raise ValueError(f"{_OP}: casting_mode must be one of {sorted(_CASTING)}, got {casting_mode!r}")
    if config is not None and not isinstance(config, QKNormRopeConfig):
        raise TypeError(f"{_OP}: config must be a tigon.ops.QKNormRopeConfig or None, got "
                        f"{type(config).__name__}")
    return _launch.check_eps(_OP, eps), _launch.check_number(_OP, "offset", offset)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps=1e-6, *, offset=0.0, casting_mode="llama", config=None):
    """RMSNorm of each head of q and k over head_dim, then rotate-half RoPE, in one kernel:
    `apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos, sin, unsqueeze_dim=2)` (the
    QK-norm of Qwen3's attention and its RoPE).

    q [B, T, Hq, D], k [B, T, Hk, D] (the head-dim views of the projections; any strides), q_weight / k_weight
    [D], cos, sin [1 or B, T, D] (full rotary). offset and casting_mode as `rms_norm`'s. Returns (q_embed,
    k_embed) [B, T, H, D], contiguous, in rms_norm's output dtype. fp32/fp16/bf16. cos and sin get no gradient
    from the kernel: if either requires one, the PyTorch reference runs. config: a `QKNormRopeConfig` (the
    launches; None: the defaults).
    """
    eps, offset = _validate(q, k, q_weight, k_weight, cos, sin, eps, offset, casting_mode, config)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        _library.record("qk_norm_rope", "reference")
        return reference.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, offset=offset,
                                      casting_mode=casting_mode)
    if not _library.use_kernels("qk_norm_rope", q):
        return reference.qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, offset=offset,
                                      casting_mode=casting_mode)
    args = (_launch.unit_last(q), _launch.unit_last(k), q_weight.contiguous(), k_weight.contiguous(), cos, sin, eps,
            offset, _CASTING[casting_mode], None if config is None else config.ints())
    return _QK_NORM_ROPE(*args, grad_from=(q, k, q_weight, k_weight))
