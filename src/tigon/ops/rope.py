"""Rotary position embedding (rotate-half convention): a drop-in for transformers' apply_rotary_pos_emb.

With x1, x2 the two halves of the first rd dims of a head and c = (c1, c2), s = (s1, s2) the halves of
cos/sin:  y1 = x1 * c1 - x2 * s1,  y2 = x2 * c2 + x1 * s2,  and dims rd..D pass through (partial rotary).
The map is linear in x; its transpose (the backward) is  dx1 = dy1 c1 + dy2 s2,  dx2 = dy2 c2 - dy1 s1:
the same kernel with TRANSPOSE set (rope with -sin when the sin halves are equal, as HF builds them).
One program per token (b, t) rotates every head of q and of k, so cos/sin are read once per token.
q and k are read through their strides (HF hands over transposed views) and written in the same layout.
The math and the byte model are in docs/ops/rope.md.
"""


import torch
import triton
import triton.language as tl

from . import _launch, _library, reference
from .config import RopeConfig

# (tile, num_warps), RopeConfig.ints(): two [heads, rd/2] tiles (x1, x2) plus cos/sin stay in registers; the
# defaults and their H200 measurement are in RopeConfig. A custom op takes the ints; None: these defaults.
_DEFAULT = tuple(RopeConfig().ints())


@triton.jit
def _rope_heads(
    X, Y, b_c1, b_c2, b_sa, b_sb, b, t,
    stride_xb, stride_xh, stride_xt, stride_yb, stride_yh, stride_yt,
    n_heads, D, HALF,
    HAS_PASS: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotate the n_heads heads of token (b, t) of X into Y, BLOCK_HEADS heads at a time."""
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < HALF
    o_p = 2 * HALF + tl.arange(0, BLOCK_P)
    m_p = o_p < D
    p_x0 = X + b * stride_xb + t * stride_xt
    p_y0 = Y + b * stride_yb + t * stride_yt
    for h0 in range(0, n_heads, BLOCK_HEADS):
        o_h = tl.cast(h0, tl.int64) + tl.arange(0, BLOCK_HEADS).to(tl.int64)
        m_h = o_h < n_heads
        p_x = p_x0 + o_h[:, None] * stride_xh
        p_y = p_y0 + o_h[:, None] * stride_yh
        m = m_h[:, None] & m_r[None, :]
        b_x1 = tl.load(p_x + o_r[None, :], mask=m, other=0.0).to(tl.float32)
        b_x2 = tl.load(p_x + HALF + o_r[None, :], mask=m, other=0.0).to(tl.float32)
        b_y1 = b_x1 * b_c1[None, :] - b_x2 * b_sa[None, :]
        b_y2 = b_x2 * b_c2[None, :] + b_x1 * b_sb[None, :]
        tl.store(p_y + o_r[None, :], b_y1.to(Y.dtype.element_ty), mask=m)
        tl.store(p_y + HALF + o_r[None, :], b_y2.to(Y.dtype.element_ty), mask=m)
        if HAS_PASS:
            m_pass = m_h[:, None] & m_p[None, :]
            b_p = tl.load(p_x + o_p[None, :], mask=m_pass, other=0.0)
            tl.store(p_y + o_p[None, :], b_p.to(Y.dtype.element_ty), mask=m_pass)


@triton.jit
def _cos_sin_halves(COS, SIN, b, t, stride_cb, stride_ct, stride_cd, stride_sb, stride_st, stride_sd, HALF,
                    BLOCK_R: tl.constexpr):
    """The two halves of cos and sin at (batch b, token t), fp32 [BLOCK_R] each (masked past HALF)."""
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < HALF
    p_c = COS + b * stride_cb + t * stride_ct
    p_s = SIN + b * stride_sb + t * stride_st
    b_c1 = tl.load(p_c + o_r * stride_cd, mask=m_r, other=0.0).to(tl.float32)
    b_c2 = tl.load(p_c + (HALF + o_r) * stride_cd, mask=m_r, other=0.0).to(tl.float32)
    b_s1 = tl.load(p_s + o_r * stride_sd, mask=m_r, other=0.0).to(tl.float32)
    b_s2 = tl.load(p_s + (HALF + o_r) * stride_sd, mask=m_r, other=0.0).to(tl.float32)
    return b_c1, b_c2, b_s1, b_s2


@triton.jit
def _rope_kernel(
    Q,  # [B, Hq, T, D] any strides, unit stride on D
    K,  # [B, Hkv, T, D]
    COS,  # [Bc, T, rd], Bc in (1, B), any strides
    SIN,
    QO,  # outputs, shaped like Q and K, unit stride on D
    KO,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_qob, stride_qoh, stride_qot,
    stride_kob, stride_koh, stride_kot,
    stride_cb, stride_ct, stride_cd,  # cos strides; stride_cb is 0 when cos has batch 1
    stride_sb, stride_st, stride_sd,
    T,
    Hq,  # 0 skips q (its gradient is not needed)
    Hkv,
    D,
    HALF,  # rd / 2
    TRANSPOSE: tl.constexpr,  # the backward: apply the transpose of the rotation
    HAS_PASS: tl.constexpr,  # rd < D
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    b_c1, b_c2, b_s1, b_s2 = _cos_sin_halves(COS, SIN, b, t, stride_cb, stride_ct, stride_cd,
                                             stride_sb, stride_st, stride_sd, HALF, BLOCK_R)
    # forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; transpose: swap the sin halves and negate them.
    if TRANSPOSE:
        b_sa = -b_s2
        b_sb = -b_s1
    else:
        b_sa = b_s1
        b_sb = b_s2
    _rope_heads(
        Q, QO, b_c1, b_c2, b_sa, b_sb, b, t,
        stride_qb, stride_qh, stride_qt, stride_qob, stride_qoh, stride_qot,
        Hq, D, HALF, HAS_PASS, BLOCK_HQ, BLOCK_R, BLOCK_P,
    )
    _rope_heads(
        K, KO, b_c1, b_c2, b_sa, b_sb, b, t,
        stride_kb, stride_kh, stride_kt, stride_kob, stride_koh, stride_kot,
        Hkv, D, HALF, HAS_PASS, BLOCK_HK, BLOCK_R, BLOCK_P,
    )


def _out_like(x: torch.Tensor) -> torch.Tensor:
    """An output in x's memory layout, so reads and writes walk memory in the same order (coalesced).

    empty_like keeps x's strides when x is dense (HF's transposed view of [B, T, H, D]) and otherwise
    lays the output out densely in x's dim order (a slice of a fused qkv gives a dense [B, T, H, D] buffer).
    The fake below calls the same function, so compiled graphs see the same strides.
    """
    return torch.empty_like(x)


def _heads_block(n_heads: int, block_r: int, tile: int = _DEFAULT[0]) -> int:
    return max(1, min(_launch.next_power_of_2(max(n_heads, 1)), tile // block_r))


def rope_launch(
    q: torch.Tensor | None, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, transpose: bool,
    config: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, T, D], k [B, Hkv, T, D] (either may be None), unit stride on D; cos, sin [1 or B, T, rd].

    Returns (q_embed, k_embed), each in its input's dtype and layout (empty for a None input);
    transpose=True applies the transpose of the rotation (the backward). config: None or `RopeConfig.ints()`.
    """
    tile, num_warps = config or _DEFAULT
    ref = q if q is not None else k
    qo = _out_like(q) if q is not None else cos.new_empty(0)
    ko = _out_like(k) if k is not None else cos.new_empty(0)
    if ref is None:
        return qo, ko
    B, _, T, D = ref.shape
    rd = cos.shape[-1]
    Hq = q.shape[1] if q is not None else 0
    Hkv = k.shape[1] if k is not None else 0
    if B * T == 0 or Hq + Hkv == 0:
        return qo, ko
    block_r = _launch.next_power_of_2(rd // 2)
    block_p = _launch.next_power_of_2(max(D - rd, 1))
    qs = q.stride()[:3] if q is not None else (0, 0, 0)
    ks = k.stride()[:3] if k is not None else (0, 0, 0)
    qos = qo.stride()[:3] if q is not None else (0, 0, 0)
    kos = ko.stride()[:3] if k is not None else (0, 0, 0)
    cb = cos.stride(0) if cos.shape[0] > 1 else 0
    sb = sin.stride(0) if sin.shape[0] > 1 else 0
    _rope_kernel[(B * T,)](
        q if q is not None else ref, k if k is not None else ref, cos, sin,
        qo if q is not None else ref, ko if k is not None else ref,
        *qs, *ks, *qos, *kos, cb, cos.stride(1), cos.stride(2), sb, sin.stride(1), sin.stride(2),
        T, Hq, Hkv, D, rd // 2,
        TRANSPOSE=transpose, HAS_PASS=rd < D,
        BLOCK_HQ=_heads_block(Hq, block_r, tile), BLOCK_HK=_heads_block(Hkv, block_r, tile),
        BLOCK_R=block_r, BLOCK_P=block_p, num_warps=num_warps,
    )
    return qo, ko


def _fake(q, k, cos, sin, transpose, config=None):
    return (
        _out_like(q) if q is not None else cos.new_empty(0),
        _out_like(k) if k is not None else cos.new_empty(0),
    )


def _setup(ctx, inputs, output):
    cos, sin, transpose = inputs[2:5]
    ctx.save_for_backward(cos, sin)
    ctx.transpose = transpose
    ctx.config, ctx.n_inputs = (inputs[5] if len(inputs) > 5 else None), len(inputs)


def _backward(ctx, dq_embed, dk_embed):
    cos, sin = ctx.saved_tensors
    need_q, need_k = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # The backward is the same linear map transposed, through the same op: double backward comes free.
    dq, dk = _ROPE.on(ctx)(
        _launch.unit_last(dq_embed) if need_q else None, _launch.unit_last(dk_embed) if need_k else None, cos, sin,
        not ctx.transpose, ctx.config,
    )
    return ((dq if need_q else None), (dk if need_k else None)) + (None,) * (ctx.n_inputs - 2)


_ROPE = _library.Op("rope", rope_launch, _fake, _setup, _backward)


def _validate(q, k, cos, sin, unsqueeze_dim):
    op = "tigon.ops.apply_rope"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _launch.check_tensor(op, name, t)
    _launch.check_same_device(op, "q", q, k=k, cos=cos, sin=sin)
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2):
        raise ValueError(f"{op}: unsqueeze_dim must be 1 (q [B, H, T, D]) or 2 (q [B, T, H, D]), "
                         f"got {unsqueeze_dim!r}")
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be 4-D, got shape {tuple(q.shape)}")
    if k.dim() != 4:
        raise ValueError(f"{op}: k must be 4-D, got shape {tuple(k.shape)}")
    t_dim = 2 if unsqueeze_dim == 1 else 1
    B, T, D = q.shape[0], q.shape[t_dim], q.shape[3]
    if k.shape[0] != B or k.shape[t_dim] != T or k.shape[3] != D:
        raise ValueError(
            f"{op}: k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, sequence and head dim"
        )
    check_cos_sin(op, cos, sin, B, T, D)


def check_cos_sin(op, cos, sin, B, T, D):
    """cos, sin `[1 or B, T, rd]` with rd even, > 0 and <= the head dim D (the rotate-half tables)."""
    if cos.dim() != 3 or cos.shape[0] not in (1, B) or cos.shape[1] != T:
        raise ValueError(f"{op}: cos must have shape [1 or {B}, {T}, rotary_dim], got {tuple(cos.shape)}")
    _launch.check_shape(op, "sin", sin, cos.shape)
    rd = cos.shape[2]
    if rd % 2 or rd == 0 or rd > D:
        raise ValueError(f"{op}: cos rotary_dim {rd} must be even, > 0 and <= the head dim {D}")


def apply_rope(q, k, cos, sin, unsqueeze_dim=1, *, config=None):
    """transformers' apply_rotary_pos_emb (rotate-half), out of place; returns (q_embed, k_embed).

    unsqueeze_dim=1: q [B, Hq, T, D], k [B, Hkv, T, D]; unsqueeze_dim=2: q [B, T, Hq, D], k [B, T, Hkv, D].
    Any strides (HF's transposed views are read in place). cos, sin [1 or B, T, rd], rd even <= D: the
    first rd dims rotate, the rest pass through. fp32/fp16/bf16; outputs in the dtypes of q and k with
    their memory layout. cos and sin get no gradient from the kernel: if either requires one, the
    PyTorch reference runs instead. config: a `RopeConfig` (the launch; None: the measured defaults).
    """
    _validate(q, k, cos, sin, unsqueeze_dim)
    if config is not None and not isinstance(config, RopeConfig):
        raise TypeError(f"tigon.ops.apply_rope: config must be a tigon.ops.RopeConfig or None, got "
                        f"{type(config).__name__}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        _library.record("apply_rope", "reference")
        return reference.apply_rope(q, k, cos, sin, unsqueeze_dim)
    if not _library.use_kernels("apply_rope", q):
        return reference.apply_rope(q, k, cos, sin, unsqueeze_dim)
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q_embed, k_embed = _ROPE(_launch.unit_last(q), _launch.unit_last(k), cos, sin, False,
                             None if config is None else config.ints(), grad_from=(q, k))
    if unsqueeze_dim == 2:
        q_embed, k_embed = q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    return q_embed, k_embed
