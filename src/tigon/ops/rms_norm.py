"""RMSNorm and residual-add + RMSNorm: Triton forward and backward, a row per program, or a tile of rows when
rows are short (the QK-norm of Qwen3 / Gemma-3 / OLMo-2 normalizes each head: rows of 64-256).

y = (offset + w) * x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps),  math in fp32, one cast on store.
add_rms_norm normalizes s = x + residual (rounded to x.dtype, as the HF decoder layer does) and returns
(y, s) from the same kernel. Backward keeps only x (or s) and one fp32 rstd per row, like the HF module.
The math and the byte model are in docs/ops/rms_norm.md.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, _library, _pdl, reference
from .config import RMSNormConfig

_CASTING = {"llama": 0, "gemma": 1, "none": 2}

# The launch settings travel as RMSNormConfig.ints() (a custom op takes ints); None: these defaults.
_DEFAULT = tuple(RMSNormConfig().ints())


# M (rows) is not specialized: a prefill's M is its prompt length, and M % 16 changing would compile the kernel
# again in the middle of a request (measured with tests/decode/test_specializations.py's launch recorder).
@triton.jit(do_not_specialize=["M"])
def _rms_norm_fwd_kernel(
    X,  # [M, H] input rows
    R,  # [M, H] residual rows (read when HAS_RESIDUAL)
    W,  # [H] weight (read when HAS_WEIGHT)
    Y,  # [M, H] normalized output
    S,  # [M, H] x + residual output (written when HAS_RESIDUAL)
    RSTD,  # [M] fp32 1/rms, kept for backward
    stride_x,  # row strides, in elements
    stride_r,
    stride_y,
    stride_s,
    M,  # rows
    H,  # hidden size
    eps,  # runtime float: never constexpr, so new eps values do not recompile
    offset,  # added to the weight (Gemma: 1.0)
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CASTING: tl.constexpr,  # 0 llama (round x*rstd to x.dtype before the weight), 1 gemma, 2 none
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a program normalizes: 1, or a tile of rows (_rows_per_tile)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/_pdl.py): every access after the wait
):
    _pdl.wait(PDL)  # no early start: the next kernel launches when this one exits
    if BLOCK_M > 1:
        _rms_norm_fwd_tile(X, R, W, Y, S, RSTD, stride_x, stride_r, stride_y, stride_s, M, H, eps, offset,
                           HAS_RESIDUAL, HAS_WEIGHT, CASTING, BLOCK_H, BLOCK_M)
    else:
        row = tl.program_id(0).to(tl.int64)
        o_h = tl.arange(0, BLOCK_H)
        m_h = o_h < H
        b_x = tl.load(X + row * stride_x + o_h, mask=m_h, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            b_r = tl.load(R + row * stride_r + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_s = b_x + b_r
            tl.store(S + row * stride_s + o_h, b_s.to(S.dtype.element_ty), mask=m_h)
            b_x = b_s.to(S.dtype.element_ty).to(tl.float32)
        b_rstd = 1.0 / tl.sqrt(tl.math.div_rn(tl.sum(b_x * b_x, axis=0), tl.cast(H, tl.float32)) + eps)
        tl.store(RSTD + row, b_rstd)
        b_n = b_x * b_rstd
        if CASTING == 0:
            b_n = b_n.to(X.dtype.element_ty).to(tl.float32)
        if HAS_WEIGHT:
            b_w = tl.load(W + o_h, mask=m_h, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
            b_n = b_n * b_w
        tl.store(Y + row * stride_y + o_h, b_n.to(Y.dtype.element_ty), mask=m_h)


@triton.jit
def _rms_norm_fwd_tile(X, R, W, Y, S, RSTD, stride_x, stride_r, stride_y, stride_s, M, H, eps, offset,
                       HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, CASTING: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr):
    """The forward over BLOCK_M rows [BLOCK_M, BLOCK_H] at once: the same math per row as the one-row path."""
    o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_h = tl.arange(0, BLOCK_H)
    m_m = o_m < M
    m = m_m[:, None] & (o_h < H)[None, :]
    b_x = tl.load(X + o_m[:, None] * stride_x + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        b_r = tl.load(R + o_m[:, None] * stride_r + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        b_s = b_x + b_r
        tl.store(S + o_m[:, None] * stride_s + o_h[None, :], b_s.to(S.dtype.element_ty), mask=m)
        b_x = b_s.to(S.dtype.element_ty).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.math.div_rn(tl.sum(b_x * b_x, axis=1), tl.cast(H, tl.float32)) + eps)
    tl.store(RSTD + o_m, b_rstd, mask=m_m)
    b_n = b_x * b_rstd[:, None]
    if CASTING == 0:
        b_n = b_n.to(X.dtype.element_ty).to(tl.float32)
    if HAS_WEIGHT:
        b_w = tl.load(W + o_h, mask=o_h < H, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
        b_n = b_n * b_w[None, :]
    tl.store(Y + o_m[:, None] * stride_y + o_h[None, :], b_n.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,  # [M, H] gradient of y
    DS,  # [M, H] gradient of the s output (read when HAS_DS)
    X,  # [M, H] the normalized input (x, or s for add_rms_norm)
    W,  # [H]
    RSTD,  # [M]
    DX,  # [M, H] gradient of x (for add_rms_norm also the residual's)
    DR,  # [M, H] a second copy of dx for the residual (written when HAS_DR: leaf inputs, see _setup)
    DW_PART,  # [n_programs, H] fp32 per-program partial sums of dw (deterministic, no atomics)
    stride_dy,
    stride_ds,
    stride_x,
    stride_dx,
    M,
    H,
    offset,
    HAS_DR: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    CASTING: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows a loop step handles: 1, or a tile of rows (_rows_per_tile)
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    if HAS_WEIGHT:
        b_w = tl.load(W + o_h, mask=m_h, other=0.0).to(tl.float32) + tl.cast(offset, tl.float32)
    else:
        b_w = tl.zeros([BLOCK_H], dtype=tl.float32)  # unread
    inv_h = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.cast(H, tl.float32))  # once, round-to-nearest
    if BLOCK_M > 1:
        b_dw = _rms_norm_bwd_tiles(DY, DS, X, RSTD, DX, DR, stride_dy, stride_ds, stride_x, stride_dx, M, pid,
                                   n_prog, o_h, m_h, b_w, inv_h, HAS_DR, HAS_DS, HAS_WEIGHT, COMPUTE_DW, CASTING,
                                   BLOCK_H, BLOCK_M)
    else:
        b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
        for row in range(pid, M, n_prog):
            row = tl.cast(row, tl.int64)  # loop counters are int32 on GPU (python ints in the interpreter)
            b_x = tl.load(X + row * stride_x + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_dy = tl.load(DY + row * stride_dy + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_rstd = tl.load(RSTD + row)
            b_n = b_x * b_rstd
            if COMPUTE_DW:
                if CASTING == 0:
                    b_dw += b_dy * b_n.to(X.dtype.element_ty).to(tl.float32)
                else:
                    b_dw += b_dy * b_n
            if HAS_WEIGHT:
                b_dn = b_dy * b_w
            else:
                b_dn = b_dy
            # dx = rstd * (dn - n * mean(dn * n))
            b_dx = b_rstd * (b_dn - b_n * (tl.sum(b_dn * b_n, axis=0) * inv_h))
            if HAS_DS:
                b_dx += tl.load(DS + row * stride_ds + o_h, mask=m_h, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dx + o_h, b_dx.to(DX.dtype.element_ty), mask=m_h)
            if HAS_DR:
                tl.store(DR + row * stride_dx + o_h, b_dx.to(DX.dtype.element_ty), mask=m_h)
    if COMPUTE_DW:
        tl.store(DW_PART + pid.to(tl.int64) * H + o_h, b_dw, mask=m_h)


@triton.jit
def _rms_norm_bwd_tiles(DY, DS, X, RSTD, DX, DR, stride_dy, stride_ds, stride_x, stride_dx, M, pid, n_prog, o_h,
                        m_h, b_w, inv_h, HAS_DR: tl.constexpr, HAS_DS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                        COMPUTE_DW: tl.constexpr, CASTING: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """The backward's loop over tiles of BLOCK_M rows (this program's: pid, pid + n_prog, ...), with the setup
    the kernel shares with its one-row loop; returns this program's partial dw row."""
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile in range(pid, tl.cdiv(M, BLOCK_M), n_prog):
        o_m = tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_m = o_m < M
        m = m_m[:, None] & m_h[None, :]
        b_x = tl.load(X + o_m[:, None] * stride_x + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        b_dy = tl.load(DY + o_m[:, None] * stride_dy + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        b_rstd = tl.load(RSTD + o_m, mask=m_m, other=0.0)
        b_n = b_x * b_rstd[:, None]
        if COMPUTE_DW:
            if CASTING == 0:
                b_dw += tl.sum(b_dy * b_n.to(X.dtype.element_ty).to(tl.float32), axis=0)
            else:
                b_dw += tl.sum(b_dy * b_n, axis=0)
        if HAS_WEIGHT:
            b_dn = b_dy * b_w[None, :]
        else:
            b_dn = b_dy
        b_dx = b_rstd[:, None] * (b_dn - b_n * (tl.sum(b_dn * b_n, axis=1) * inv_h)[:, None])
        if HAS_DS:
            b_dx += tl.load(DS + o_m[:, None] * stride_ds + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DX + o_m[:, None] * stride_dx + o_h[None, :], b_dx.to(DX.dtype.element_ty), mask=m)
        if HAS_DR:
            tl.store(DR + o_m[:, None] * stride_dx + o_h[None, :], b_dx.to(DX.dtype.element_ty), mask=m)
    return b_dw


def _rows_per_tile(block_h: int, tile_elems: int = 0) -> int:
    """Rows a program takes at once: a tile of `tile_elems` elements where a config sets it; by default 1 for
    rows of more than 512 (one row fills a program), else a tile of 8192 elements (at most 128 rows). One short
    row a program (or a loop step) moved 128 bytes between dependent loads: Qwen3's QK-norm backward (head 64)
    took 26 of a 272 ms step on the H200, ~27x its bytes at the copy rate. 8192 from the H200 sweep (tune.py
    rms_norm_heads, h200_tune.json): with 4096 the backward at head 256 took 543-691 us against 442-485."""
    if tile_elems:
        return max(1, tile_elems // block_h)
    return 1 if block_h > 512 else min(128, 8192 // block_h)


def _launch_plan(block_h: int, config) -> tuple[int, int, int, int]:
    """(rows a program takes at once, forward warps, backward warps, backward programs per SM) of a launch: the
    config's where it sets them, else from the shape (rows: `_rows_per_tile`). One row a program: warps by the
    row's size, at most 8 in the forward (H 4096: 70 vs 80 us with 16); backward programs per SM for ~8192
    elements of rows in flight an SM, at least 2: 2 from H 4096 (2 x 16 warps beat 4 x 16, 204 vs 216 us fwd+bwd),
    4 at 2048 and 8 at 1024 (H100, tune.py rms_norm_hidden: 65536 x 1024 fwd+bwd 249 us against 365 with 2, 32768
    x 2048 255 against 289; the sweep's best 249 and 248). Tiles of short rows: 4 warps, and 8 programs per SM
    from rows of 128 on (H200, 524288 rows fwd+bwd: 218-239 / 442 us at head 128 / 256 against 264 / 485 with 2
    and 280 / 775 with the first guess, 8 warps and 2 programs; at head 64, 2 programs: 115 us against 125 with
    8)."""
    fwd_warps, bwd_warps, per_sm, tile_elems = config or _DEFAULT
    rows = _rows_per_tile(block_h, tile_elems)
    if rows > 1:
        return rows, fwd_warps or 4, bwd_warps or 4, per_sm or (8 if block_h >= 128 else 2)
    return (rows, fwd_warps or min(8, _launch.row_warps(block_h)), bwd_warps or _launch.row_warps(block_h),
            per_sm or max(2, 8192 // block_h))


def _fwd_launch(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor], eps: float,
    offset: float, casting: int, out_dtype: torch.dtype, config: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: [M, H] with unit last stride. Returns (y, s or empty, rstd[M] fp32). config: None or
    `RMSNormConfig.ints()`."""
    M, H = x.shape
    block = _launch.row_block("rms_norm", H)
    y = torch.empty((M, H), dtype=out_dtype, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    s = torch.empty_like(x) if residual is not None else x.new_empty(0)
    rows, fwd_warps, _, _ = _launch_plan(block, config)
    # PDL for a decode step's few rows (the step's chain of kernels, measured there); a training or prefill launch
    # follows cuBLAS and other libraries' kernels, where it was not measured
    pdl = M <= _launch.DECODE_ROWS and _pdl.enabled(x.device)
    if M > 0 and H > 0:  # zero width: empty outputs, and rstd (0/0) is never read
        _rms_norm_fwd_kernel[(_launch.cdiv(M, rows),)](
            x, residual if residual is not None else x, weight if weight is not None else x, y, s, rstd,
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
            s.stride(0) if residual is not None else 0, M, H, eps, offset,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, CASTING=casting,
            BLOCK_H=block, BLOCK_M=rows, PDL=pdl, num_warps=fwd_warps, **_pdl.launch_options(pdl),
        )
    return y, s, rstd


def _fwd_fake(x, residual, weight, eps, offset, casting, out_dtype, config=None):
    M, H = x.shape
    s = torch.empty_like(x) if residual is not None else x.new_empty(0)
    return x.new_empty((M, H), dtype=out_dtype), s, x.new_empty((M,), dtype=torch.float32)


def _bwd_launch(
    dy: torch.Tensor, ds: Optional[torch.Tensor], x: torch.Tensor, weight: Optional[torch.Tensor],
    rstd: torch.Tensor, offset: float, casting: int, compute_dw: bool, two_dx: bool,
    config: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx [M, H] in x.dtype, a copy of dx or empty, dw [H] in weight.dtype or empty)."""
    M, H = x.shape
    block = _launch.row_block("rms_norm", H)
    dx = torch.empty_like(x)
    dr = torch.empty_like(x) if two_dx else x.new_empty(0)
    compute_dw = compute_dw and weight is not None
    # Each program loops over rows (or tiles of short rows), so dw needs only n_prog partial rows (0.2% of the
    # traffic of x at M=16384, H=4096 with 2 programs per SM).
    rows, _, bwd_warps, bwd_per_sm = _launch_plan(block, config)
    n_prog = _launch.num_programs(x.device, _launch.cdiv(M, rows), per_sm=bwd_per_sm)
    dw_part = torch.empty((n_prog, H), dtype=torch.float32, device=x.device) if compute_dw else rstd
    if M > 0 and H > 0:
        _rms_norm_bwd_kernel[(n_prog,)](
            dy, ds if ds is not None else dy, x, weight if weight is not None else x, rstd, dx,
            dr if two_dx else dx, dw_part,
            dy.stride(0), ds.stride(0) if ds is not None else 0, x.stride(0), dx.stride(0), M, H, offset,
            HAS_DR=two_dx, HAS_DS=ds is not None, HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw,
            CASTING=casting, BLOCK_H=block, BLOCK_M=rows,
            num_warps=bwd_warps,
        )
    if not compute_dw:
        return dx, dr, x.new_empty(0)
    dw = dw_part.sum(0) if M > 0 else torch.zeros(H, dtype=torch.float32, device=x.device)
    return dx, dr, dw.to(weight.dtype)


def _bwd_fake(dy, ds, x, weight, rstd, offset, casting, compute_dw, two_dx, config=None):
    dw = torch.empty_like(weight) if (compute_dw and weight is not None) else x.new_empty(0)
    return torch.empty_like(x), torch.empty_like(x) if two_dx else x.new_empty(0), dw


_RMS_NORM_BWD = _library.Kernel("rms_norm_bwd", _bwd_launch, _bwd_fake)


def _setup(ctx, inputs, output):
    x, residual, weight, eps, offset, casting, out_dtype = inputs[:7]
    _, s, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.config, ctx.n_inputs = (inputs[7] if len(inputs) > 7 else None), len(inputs)
    ctx.save_for_backward(s if residual is not None else x, weight, rstd)
    ctx.offset, ctx.casting, ctx.has_residual, ctx.eps = offset, casting, residual is not None, eps
    # x and residual get the same gradient. Handing one tensor to both is free inside a decoder, but a leaf
    # steals it into .grad, where an in-place hook or optimizer would change the other's too: then the
    # kernel stores a second copy (one extra write, cheaper than a clone's read + write). The op sees the
    # [M, H] view of the user's tensor, so a view of a leaf counts as one.
    ctx.copy_dresidual = residual is not None and (_launch.is_leafish(x) or _launch.is_leafish(residual))


_CASTING_NAMES = {v: k for k, v in _CASTING.items()}


def _reference_backward(ctx, xs, weight, dy, ds):
    """create_graph=True: the gradients from the reference's differentiable ops on the saved input (for
    add_rms_norm the saved sum s, whose own gradient then flows to x and residual through this node)."""
    def fn(xs, w):
        return reference.rms_norm(xs, w, ctx.eps, offset=ctx.offset, casting_mode=_CASTING_NAMES[ctx.casting])

    need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
    dx, dw = _library.reference_grads(fn, (xs, weight), (need_x, ctx.needs_input_grad[2]), (dy,))
    if ds is not None and dx is not None:
        dx = dx + ds  # s is also an output: its gradient passes straight to x and residual
    dres = None
    if ctx.needs_input_grad[1]:
        dres = dx.clone() if ctx.copy_dresidual else dx  # as the kernel path: x and residual never share .grad
    return (dx if ctx.needs_input_grad[0] else None, dres, dw) + (None,) * (ctx.n_inputs - 3)


def _backward(ctx, dy, ds, _drstd):
    xs, weight, rstd = ctx.saved_tensors
    ds = ds if ctx.has_residual else None
    if _library.double_backward():
        return _reference_backward(ctx, xs, weight, dy, ds)
    need_dw = weight is not None and ctx.needs_input_grad[2]
    dx, dr, dw = _RMS_NORM_BWD.on(ctx)(
        dy.contiguous(), None if ds is None else ds.contiguous(), xs, weight, rstd, ctx.offset, ctx.casting, need_dw,
        ctx.copy_dresidual, ctx.config,
    )
    dres = (dr if ctx.copy_dresidual else dx) if ctx.has_residual else None
    return (dx, dres, (dw if need_dw else None)) + (None,) * (ctx.n_inputs - 3)


_RMS_NORM = _library.Op("rms_norm_fwd", _fwd_launch, _fwd_fake, _setup, _backward)
RMSNormFunction = _RMS_NORM.function  # the eager twin (`_library.Op`)


def _config_ints(op, config):
    if config is None:
        return None
    if not isinstance(config, RMSNormConfig):
        raise TypeError(f"{op}: config must be a tigon.ops.RMSNormConfig or None, got "
                        f"{type(config).__name__}")
    return config.ints()


def _validate(op, x, residual, weight, eps, offset, casting_mode, add=False):
    _launch.check_tensor(op, "x", x)
    _launch.check_min_dim(op, "x", x)
    if add:
        _launch.check_tensor(op, "residual", residual)
        _launch.check_shape(op, "residual", residual, x.shape)
        _launch.check_same_dtype(op, "x", x, residual=residual)
        _launch.check_same_device(op, "x", x, residual=residual)
    if weight is not None:
        _launch.check_tensor(op, "weight", weight)
        _launch.check_shape(op, "weight", weight, (x.shape[-1],))
        _launch.check_same_device(op, "x", x, weight=weight)
    if casting_mode not in _CASTING:
        raise ValueError(f"{op}: casting_mode must be one of {sorted(_CASTING)}, got {casting_mode!r}")
    _launch.row_block(op, x.shape[-1])
    return _launch.check_eps(op, eps), _launch.check_number(op, "offset", offset)


def rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting_mode="llama", config=None):
    """RMSNorm over the last dim. x [..., H] fp32/fp16/bf16, weight [H] or None; H <= 65536.

    casting_mode "llama" (LlamaRMSNorm: normalize in fp32, cast to x.dtype, times weight; output dtype is
    promote(x, weight)), "gemma" (all fp32, times offset + weight, cast at the end), "none" (fp32 math,
    a single cast at the end; output x.dtype). config: an `RMSNormConfig` (the launches; None: the measured
    defaults); it changes speed only, never the result.
    """
    eps, offset = _validate("tigon.ops.rms_norm", x, None, weight, eps, offset, casting_mode)
    cfg = _config_ints("tigon.ops.rms_norm", config)
    if not _library.use_kernels("rms_norm", x):
        return reference.rms_norm(x, weight, eps, offset=offset, casting_mode=casting_mode)
    out_dtype = reference.rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype, casting_mode)
    weight = None if weight is None else weight.contiguous()  # the kernel reads it at unit stride
    args = (_launch.as_rows(x), None, weight, eps, offset, _CASTING[casting_mode], out_dtype, cfg)
    y, _, _ = _RMS_NORM(*args, grad_from=(x, weight))
    return y.view(x.shape)


def rms_norm_rows(x, weight, eps, residual=None):
    """`rms_norm(x, weight, eps)` (residual None) or `add_rms_norm(x, residual, weight, eps)` in "llama" casting
    for a caller that built its inputs itself, without argument checks: contiguous [M, H] rows, a [H] weight,
    all of one dtype and device, no autograd (while torch.compile traces: the custom op, one graph node). Returns
    (y, s or None). The fused decode wing's prefill calls it: there the public ops' checks cost more host time
    than their launch (on the H200 machine's host 66 us a call for `rms_norm`, 31 for this; docs/generation.md)."""
    if not _library.use_kernels("add_rms_norm" if residual is not None else "rms_norm", x):
        if residual is None:
            return reference.rms_norm(x, weight, eps), None
        return reference.add_rms_norm(x, residual, weight, eps)
    args = (x, residual, weight, eps, 0.0, _CASTING["llama"], x.dtype)
    y, s, _ = _RMS_NORM(*args)  # no grad_from: the launcher (while traced, the custom op)
    return y, (s if residual is not None else None)


def add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting_mode="llama", config=None):
    """Returns (rms_norm(x + residual), x + residual) from one kernel; both [..., H], sum in x.dtype."""
    eps, offset = _validate("tigon.ops.add_rms_norm", x, residual, weight, eps, offset, casting_mode,
                            add=True)
    cfg = _config_ints("tigon.ops.add_rms_norm", config)
    if not _library.use_kernels("add_rms_norm", x):
        return reference.add_rms_norm(x, residual, weight, eps, offset=offset, casting_mode=casting_mode)
    out_dtype = reference.rms_norm_out_dtype(x.dtype, None if weight is None else weight.dtype, casting_mode)
    weight = None if weight is None else weight.contiguous()
    args = (_launch.as_rows(x), _launch.as_rows(residual), weight, eps, offset, _CASTING[casting_mode],
            out_dtype, cfg)
    y, s, _ = _RMS_NORM(*args, grad_from=(x, residual, weight))
    return y.view(x.shape), s.view(x.shape)
