"""LayerNorm: Triton forward (one row per program) and backward (persistent over rows).

y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var(x) + eps) (biased variance), math in fp32, one cast on
store, output in x.dtype. Backward keeps only x and one fp32 (mean, rstd) pair per row, like torch's own
kernel. dw and db are summed per program then across programs: deterministic, no float atomics.
The math and the byte model are in docs/ops/layer_norm.md.
"""


import torch
import triton
import triton.language as tl

from . import _launch, _library, reference


@triton.jit
def _layer_norm_fwd_kernel(
    X,  # [M, H] input rows
    W,  # [H] weight (read when HAS_WEIGHT)
    B,  # [H] bias (read when HAS_BIAS)
    Y,  # [M, H] output, x.dtype
    MEAN,  # [M] fp32 row mean, kept for backward
    RSTD,  # [M] fp32 1/std, kept for backward
    stride_x,  # row strides, in elements
    stride_y,
    H,  # hidden size
    eps,  # runtime float: never constexpr, so new eps values do not recompile
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_x = tl.load(X + row * stride_x + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_mean = tl.math.div_rn(tl.sum(b_x, axis=0), tl.cast(H, tl.float32))
    # Two passes over registers (mean, then centred squares): no E[x^2] - E[x]^2 cancellation when
    # |mean| >> std, which one pass would turn into a negative variance in fp32.
    b_xc = tl.where(m_h, b_x - b_mean, 0.0)
    b_var = tl.math.div_rn(tl.sum(b_xc * b_xc, axis=0), tl.cast(H, tl.float32))
    b_rstd = 1.0 / tl.sqrt(b_var + tl.cast(eps, tl.float32))
    tl.store(MEAN + row, b_mean)
    tl.store(RSTD + row, b_rstd)
    b_y = b_xc * b_rstd
    if HAS_WEIGHT:
        b_y = b_y * tl.load(W + o_h, mask=m_h, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_y = b_y + tl.load(B + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + o_h, b_y.to(Y.dtype.element_ty), mask=m_h)


@triton.jit
def _layer_norm_bwd_kernel(
    DY,  # [M, H] gradient of y
    X,  # [M, H] input rows
    W,  # [H] weight (read when HAS_WEIGHT)
    MEAN,  # [M] fp32
    RSTD,  # [M] fp32
    DX,  # [M, H] gradient of x, x.dtype
    DW_PART,  # [n_programs, H] fp32 per-program partial sums of dw (written when COMPUTE_DW)
    DB_PART,  # [n_programs, H] fp32 per-program partial sums of db (written when COMPUTE_DB)
    stride_dy,
    stride_x,
    stride_dx,
    M,
    H,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < H
    if HAS_WEIGHT:
        b_w = tl.load(W + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_H], dtype=tl.float32)
    # 1/H rounded to nearest once, outside the row loop (exact at H = 1, where the GPU's approximate
    # division left dx = rstd * (g - g') != 0)
    inv_h = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.cast(H, tl.float32))
    for row in range(pid, M, n_prog):
        row = tl.cast(row, tl.int64)  # loop counters are int32 on GPU (python ints in the interpreter)
        b_x = tl.load(X + row * stride_x + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_dy = tl.load(DY + row * stride_dy + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_mean = tl.load(MEAN + row)
        b_rstd = tl.load(RSTD + row)
        b_xhat = tl.where(m_h, (b_x - b_mean) * b_rstd, 0.0)
        if COMPUTE_DW:
            b_dw += b_dy * b_xhat
        if COMPUTE_DB:
            b_db += b_dy
        if HAS_WEIGHT:
            b_g = b_dy * b_w
        else:
            b_g = b_dy
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w
        b_c1 = tl.sum(b_g * b_xhat, axis=0) * inv_h
        b_c2 = tl.sum(b_g, axis=0) * inv_h
        b_dx = b_rstd * (b_g - b_c2 - b_xhat * b_c1)
        tl.store(DX + row * stride_dx + o_h, b_dx.to(DX.dtype.element_ty), mask=m_h)
    if COMPUTE_DW:
        tl.store(DW_PART + pid.to(tl.int64) * H + o_h, b_dw, mask=m_h)
    if COMPUTE_DB:
        tl.store(DB_PART + pid.to(tl.int64) * H + o_h, b_db, mask=m_h)


def _fwd_launch(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [M, H] with unit last stride; weight, bias: [H] contiguous or None.

    Returns (y [M, H] in x.dtype, mean [M] fp32, rstd [M] fp32).
    """
    M, H = x.shape
    block = _launch.row_block("layer_norm", H)
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    mean = torch.empty((M,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M > 0 and H > 0:  # zero width: empty outputs, and mean/rstd (0/0) are never read
        _layer_norm_fwd_kernel[(M,)](
            x, weight if weight is not None else x, bias if bias is not None else x, y, mean, rstd,
            x.stride(0), y.stride(0), H, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_H=block, num_warps=_launch.row_warps(block, x.element_size()),
        )
    return y, mean, rstd


def _fwd_fake(x, weight, bias, eps):
    M, H = x.shape
    return x.new_empty((M, H)), x.new_empty((M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32)


def _bwd_launch(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
    mean: torch.Tensor, rstd: torch.Tensor, compute_dw: bool, compute_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx [M, H] in x.dtype, dw [H] in weight.dtype or empty, db [H] in bias.dtype or empty)."""
    M, H = x.shape
    block = _launch.row_block("layer_norm", H)
    compute_dw = compute_dw and weight is not None
    compute_db = compute_db and bias is not None
    dx = torch.empty_like(x)
    # 4 programs per SM, as rms_norm's backward (measured best there at H=4096 on an H200); each program
    # loops over rows, so dw and db cost n_prog fp32 partial rows each, written once and summed once:
    # 4 x 528 x H x 4 B = 8% of the backward's bytes at M=16384, H=4096 bf16 (fewer programs: less).
    n_prog = _launch.num_programs(x.device, M, per_sm=4)
    dw_part = torch.empty((n_prog, H), dtype=torch.float32, device=x.device) if compute_dw else rstd
    db_part = torch.empty((n_prog, H), dtype=torch.float32, device=x.device) if compute_db else rstd
    if M > 0 and H > 0:
        _layer_norm_bwd_kernel[(n_prog,)](
            dy, x, weight if weight is not None else x, mean, rstd, dx, dw_part, db_part,
            dy.stride(0), x.stride(0), dx.stride(0), M, H,
            HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_H=block, num_warps=_launch.row_warps(block, x.element_size()),
        )

    def _reduce(part, compute, param):
        if not compute:
            return x.new_empty(0)
        total = part.sum(0) if M > 0 else torch.zeros(H, dtype=torch.float32, device=x.device)
        return total.to(param.dtype)

    return dx, _reduce(dw_part, compute_dw, weight), _reduce(db_part, compute_db, bias)


def _bwd_fake(dy, x, weight, bias, mean, rstd, compute_dw, compute_db):
    dw = torch.empty_like(weight) if (compute_dw and weight is not None) else x.new_empty(0)
    db = torch.empty_like(bias) if (compute_db and bias is not None) else x.new_empty(0)
    return torch.empty_like(x), dw, db


_LAYER_NORM_BWD = _library.Kernel("layer_norm_bwd", _bwd_launch, _bwd_fake)


def _setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps = eps


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if _library.double_backward():
        # create_graph=True: the reference's differentiable ops on the saved input, for double backward
        dx, dw, db = _library.reference_grads(lambda x, w, b: reference.layer_norm(x, w, b, ctx.eps),
                                              (x, weight, bias), ctx.needs_input_grad[:3], (dy,))
        return dx, dw, db, None
    need_dw = weight is not None and ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db = _LAYER_NORM_BWD.on(ctx)(dy.contiguous(), x, weight, bias, mean, rstd, need_dw, need_db)
    return dx, (dw if need_dw else None), (db if need_db else None), None


_LAYER_NORM = _library.Op("layer_norm_fwd", _fwd_launch, _fwd_fake, _setup, _backward)


def _validate(x, weight, bias, eps):
    op = "tigon.ops.layer_norm"
    _launch.check_tensor(op, "x", x)
    _launch.check_min_dim(op, "x", x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            _launch.check_tensor(op, name, t)
            _launch.check_shape(op, name, t, (x.shape[-1],))
            _launch.check_same_device(op, "x", x, **{name: t})
    _launch.row_block(op, x.shape[-1])
    return _launch.check_eps(op, eps)


def layer_norm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim, as F.layer_norm(x, (H,), weight, bias, eps) computed in fp32.

    x [..., H] fp32/fp16/bf16; weight, bias [H] (any float dtype) or None each; H <= 65536.
    Returns y [..., H] in x.dtype; dw and db come back in the dtypes of weight and bias.
    """
    eps = _validate(x, weight, bias, eps)
    if not _library.use_kernels("layer_norm", x):
        return reference.layer_norm(x, weight, bias, eps)
    # The kernels read weight and bias at unit stride; for the usual parameter these are no-ops.
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    args = (_launch.as_rows(x), weight, bias, eps)
    y, _, _ = _LAYER_NORM(*args, grad_from=(x, weight, bias))
    return y.view(x.shape)
