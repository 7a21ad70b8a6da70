"""The routed experts' glue around their grouped GEMMs: the permute of tokens into expert order and the weighted
combine back, one Triton pass each, forward and backward.

With T tokens routed to K experts each, the S = T * K (token, expert) pairs are sorted by expert; pos [T, K] is the
inverse permutation (pos[t, k] is the row of pair (t, k) in expert order).

- moe_permute(x, pos): x_g[pos[t, k]] = x[t], the [S, H] input of the up projection's grouped GEMM. Its backward is
  the unweighted combine dx[t] = sum_k dx_g[pos[t, k]]: one pass, deterministic (indexing's backward is an
  atomic index_add).
- moe_combine(y, weights, pos): out[t] = sum_k weights[t, k] * y[pos[t, k]], the tokens' output from the down
  projection's [S, H] output, read once, [T, H] written once (transformers' grouped_mm path takes a multiply, a
  gather and a sum, ~4 passes over [S, H]). Backward, one pass per token: dy[pos[t, k]] = weights[t, k] * dout[t]
  and dweights[t, k] = <y[pos[t, k]], dout[t]> (fp32 sums).

n_rows (a 1-element int tensor on the device, e.g. the grouped GEMM's last offset) marks rows of the expert-sorted
buffer at or past it as not routed (expert parallelism's sentinel experts sort to the tail): combine reads them as
zero, permute and the combine's backward write zeros there. Math in fp32, one cast on store, int64 offsets. The
byte model is in docs/ops/moe.md.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, _library, reference

# The widest row chunk a program holds: 4096 bf16 = 8 KiB (16 per thread at 8 warps); wider rows loop over chunks.
_MAX_BLOCK_H = 4096


@triton.jit
def _moe_combine_kernel(
    Y,  # [S, H] rows in expert order
    W,  # [T, K] routing weights (unused when HAS_W is False)
    POS,  # [T, K] row of y of each (token, expert) pair
    NROWS,  # [1] rows of y that are routed (unused when HAS_N is False)
    OUT,  # [T, H]
    stride_y,  # row strides in elements
    stride_out,
    S,
    H,
    K,
    HAS_W: tl.constexpr,
    HAS_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One token per program: its K rows of y are read once and summed in fp32; the row is written once.
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        m_h = h0 + o_h < H
        b_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in range(0, K):
            p = tl.load(POS + t * K + k).to(tl.int64)
            ok = (p >= 0) & (p < S)
            if HAS_N:
                ok = ok & (p < tl.load(NROWS).to(tl.int64))
            b_y = tl.load(Y + p * stride_y + h0 + o_h, mask=m_h & ok, other=0.0,
                          eviction_policy="evict_first").to(tl.float32)
            if HAS_W:
                b_y = b_y * tl.load(W + t * K + k).to(tl.float32)
            b_acc += b_y
        tl.store(OUT + t * stride_out + h0 + o_h, b_acc.to(OUT.dtype.element_ty), mask=m_h)


@triton.jit
def _moe_scatter_kernel(
    DOUT,  # [T, H] gradient of the combine's output (or the tokens x, for permute)
    Y,  # [S, H] the combine's saved input (unused when NEED_DW is False)
    W,  # [T, K] routing weights (unused when HAS_W is False)
    POS,  # [T, K]
    NROWS,  # [1] (unused when HAS_N is False)
    DY,  # [S, H] out: dy[pos[t, k]] = w[t, k] * dout[t], zero at rows >= n_rows
    DW,  # [T, K] out: <y[pos[t, k]], dout[t]> (unused when NEED_DW is False)
    stride_dout,
    stride_y,
    stride_dy,
    S,
    H,
    K,
    HAS_W: tl.constexpr,
    HAS_N: tl.constexpr,
    NEED_DW: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # pos is a permutation of range(S), so each row of dy is written by exactly one (program, k): no race, and
    # every row is written (zeros at the not-routed ones).
    t = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    for k in range(0, K):
        p = tl.load(POS + t * K + k).to(tl.int64)
        inside = (p >= 0) & (p < S)
        ok = inside
        if HAS_N:
            ok = ok & (p < tl.load(NROWS).to(tl.int64))
        b_dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            m_h = h0 + o_h < H
            b_do = tl.load(DOUT + t * stride_dout + h0 + o_h, mask=m_h, other=0.0).to(tl.float32)
            if NEED_DW:
                b_y = tl.load(Y + p * stride_y + h0 + o_h, mask=m_h & ok, other=0.0,
                              eviction_policy="evict_first").to(tl.float32)
                b_dot += b_y * b_do
            b_dy = b_do
            if HAS_W:
                b_dy = b_dy * tl.load(W + t * K + k).to(tl.float32)
            b_dy = tl.where(ok, b_dy, 0.0)
            tl.store(DY + p * stride_dy + h0 + o_h, b_dy.to(DY.dtype.element_ty), mask=m_h & inside)
        if NEED_DW:
            tl.store(DW + t * K + k, tl.sum(b_dot, axis=0).to(DW.dtype.element_ty))


def _geometry(device, H):
    """(BLOCK_H, num_warps): one program per token; on CPU (the interpreter) one chunk of the whole row."""
    block = min(_launch.next_power_of_2(max(H, 1)), _MAX_BLOCK_H)
    warps = max(1, min(8, block // 256)) if device.type == "cuda" else 1
    return block, warps


def combine_launch(y: torch.Tensor, weights: Optional[torch.Tensor], pos: torch.Tensor,
                   n_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """y [S, H], weights [T, K] or None, pos [T, K] (a permutation of range(S)), n_rows [1] or None -> [T, H]."""
    T, K = pos.shape
    S, H = y.shape
    out = torch.empty((T, H), dtype=y.dtype, device=y.device)
    if T * H == 0:
        return out
    y, pos = _launch.unit_last(y), pos.contiguous()
    w = weights.contiguous() if weights is not None else pos
    block, warps = _geometry(y.device, H)
    _moe_combine_kernel[(T,)](
        y, w, pos, n_rows if n_rows is not None else pos, out, y.stride(0), out.stride(0), S, H, K,
        HAS_W=weights is not None, HAS_N=n_rows is not None, BLOCK_H=block, num_warps=warps)
    return out


def scatter_launch(dout, y, weights, pos, n_rows, need_dw, out_dtype):
    """(dy [S, H] in out_dtype, dw [T, K] in weights.dtype or None)."""
    T, K = pos.shape
    H = dout.shape[1]
    S = T * K
    dy = torch.empty((S, H), dtype=out_dtype, device=dout.device)
    dw = torch.empty((T, K), dtype=weights.dtype, device=dout.device) if need_dw else None
    if T * K == 0:
        return dy, dw
    if H == 0:
        if dw is not None:
            dw.zero_()
        return dy, dw
    dout, pos = _launch.unit_last(dout), pos.contiguous()
    y = _launch.unit_last(y) if need_dw else dout
    w = weights.contiguous() if weights is not None else pos
    block, warps = _geometry(dout.device, H)
    _moe_scatter_kernel[(T,)](
        dout, y, w, pos, n_rows if n_rows is not None else pos, dy, dw if need_dw else dy,
        dout.stride(0), y.stride(0), dy.stride(0), S, H, K,
        HAS_W=weights is not None, HAS_N=n_rows is not None, NEED_DW=need_dw, BLOCK_H=block, num_warps=warps)
    return dy, dw


def _combine_fake(y, weights, pos, n_rows):
    return y.new_empty((pos.shape[0], y.shape[1]))


def _combine_bwd_launch(dout: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor,
                        n_rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy [S, H] in y.dtype, dweights [T, K] in weights.dtype)."""
    return scatter_launch(dout, y, weights, pos, n_rows, True, y.dtype)


def _combine_bwd_fake(dout, y, weights, pos, n_rows):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


def _scatter_rows_launch(dout: torch.Tensor, weights: Optional[torch.Tensor], pos: torch.Tensor,
                         n_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """out[pos[t, k]] = weights[t, k] * dout[t] (1 for None), zero at rows >= n_rows: [S, H] in dout.dtype.
    moe_permute's forward (weights None) and the combine's dy where dweights is not wanted."""
    return scatter_launch(dout, None, weights, pos, n_rows, False, dout.dtype)[0]


def _scatter_fake(dout, weights, pos, n_rows):
    return dout.new_empty((pos.numel(), dout.shape[1]))


_COMBINE_BWD = _library.Kernel("moe_combine_bwd", _combine_bwd_launch, _combine_bwd_fake)


def _reference_grads(dout, y, weights, pos, n_rows, need_y, need_w):
    """Combine's backward under create_graph=True (both dispatch paths): the reference's differentiable ops."""
    dy, dw = _library.reference_grads(lambda a, b: reference.moe_combine(a, b, pos, n_rows), (y, weights),
                                      (need_y, need_w), (dout,))
    return dy, dw, None, None


def _combine_setup(ctx, inputs, output):
    y, weights, pos, n_rows = inputs
    ctx.save_for_backward(y, weights, pos, n_rows)


def _combine_backward(ctx, dout):
    y, weights, pos, n_rows = ctx.saved_tensors
    need_y, need_w = ctx.needs_input_grad[0], weights is not None and ctx.needs_input_grad[1]
    if _library.double_backward():
        return _reference_grads(dout, y, weights, pos, n_rows, need_y, need_w)
    if need_w:
        dy, dw = _COMBINE_BWD.on(ctx)(dout, y, weights, pos, n_rows)
        return (dy if need_y else None), dw, None, None
    dy = _SCATTER.on(ctx)(dout, weights, pos, n_rows) if need_y else None
    return dy, None, None, None


_COMBINE = _library.Op("moe_combine", combine_launch, _combine_fake, _combine_setup, _combine_backward)


def _scatter_setup(ctx, inputs, output):
    dout, weights, pos, n_rows = inputs
    ctx.save_for_backward(weights, pos, n_rows)


def _scatter_backward(ctx, dx_g):
    weights, pos, n_rows = ctx.saved_tensors
    if weights is not None and ctx.needs_input_grad[1]:
        raise NotImplementedError("tigon::moe_scatter: no gradient for weights (use tigon.ops.moe_combine)")
    # The transpose of the scatter is the combine with the same weights: sum_k w[t, k] * dx_g[pos[t, k]]; the
    # op's own autograd makes it differentiable under create_graph=True.
    dx = _COMBINE.on(ctx)(dx_g, weights, pos, n_rows) if ctx.needs_input_grad[0] else None
    return dx, None, None, None


# moe_permute's op (weights None); its eager twin's backward is the unweighted combine.
_SCATTER = _library.Op("moe_scatter", _scatter_rows_launch, _scatter_fake, _scatter_setup, _scatter_backward)


def _validate(op, rows, rows_name, weights, pos, n_rows, *, combine):
    _launch.check_tensor(op, rows_name, rows)
    if rows.dim() != 2:
        raise ValueError(f"{op}: {rows_name} must be 2-D [{'S' if combine else 'T'}, H], got shape {tuple(rows.shape)}")
    if not isinstance(pos, torch.Tensor) or pos.dtype not in (torch.int32, torch.int64):
        got = pos.dtype if isinstance(pos, torch.Tensor) else type(pos).__name__
        raise TypeError(f"{op}: pos must be an int32 or int64 tensor, got {got}")
    if pos.dim() != 2:
        raise ValueError(f"{op}: pos must be 2-D [T, K], got shape {tuple(pos.shape)}")
    T, K = pos.shape
    if combine and rows.shape[0] != T * K:
        raise ValueError(f"{op}: y must have T * K = {T * K} rows (pos is [{T}, {K}]), got {rows.shape[0]}")
    if not combine and rows.shape[0] != T:
        raise ValueError(f"{op}: x must have T = {T} rows (pos is [{T}, {K}]), got {rows.shape[0]}")
    if weights is not None:
        _launch.check_tensor(op, "weights", weights)
        _launch.check_shape(op, "weights", weights, (T, K))
    if n_rows is not None:
        if not isinstance(n_rows, torch.Tensor) or n_rows.dtype not in (torch.int32, torch.int64) or \
                n_rows.numel() != 1:
            raise TypeError(f"{op}: n_rows must be None or a 1-element int32/int64 tensor, got "
                            f"{n_rows.dtype if isinstance(n_rows, torch.Tensor) else type(n_rows).__name__}"
                            f"{'' if not isinstance(n_rows, torch.Tensor) else f' of {n_rows.numel()} elements'}")
    _launch.check_same_device(op, rows_name, rows, weights=weights, pos=pos, n_rows=n_rows)
    if _library.host_checks(rows.device) and pos.numel():
        flat = pos.reshape(-1).long()
        if flat.min() < 0 or flat.max() >= T * K or not torch.bincount(flat, minlength=T * K).eq(1).all():
            raise ValueError(f"{op}: pos must be a permutation of range(T * K = {T * K}) (each row once)")


def _n_rows_arg(n_rows):
    return None if n_rows is None else n_rows.reshape(1)


def moe_combine(y, weights, pos, n_rows=None):
    """out[t] = sum_k weights[t, k] * y[pos[t, k]]: the routed experts' output of each token.

    y [S, H] fp32/fp16/bf16, the down projection's output in expert order; weights [T, K] float (any of the three;
    None: all ones) or None; pos [T, K] int32/int64, the inverse of the sort by expert (a permutation of range(S),
    S = T * K); n_rows None or a 1-element int tensor: rows of y at or past it are not routed (read as zero, zero
    gradient). Returns [T, H] in y.dtype; sums in fp32. Gradients: y (in y.dtype) and weights (in weights.dtype)."""
    op = "tigon.ops.moe_combine"
    _validate(op, y, "y", weights, pos, n_rows, combine=True)
    n_rows = _n_rows_arg(n_rows)
    if not _library.use_kernels("moe_combine", y):
        return reference.moe_combine(y, weights, pos, n_rows)
    return _COMBINE(y, weights, pos, n_rows, grad_from=(y, weights))


def moe_permute(x, pos, n_rows=None):
    """out[pos[t, k]] = x[t]: the tokens x [T, H] (fp32/fp16/bf16) copied into expert order, [S = T * K, H] in
    x.dtype; rows at or past n_rows zero. pos, n_rows as in `moe_combine`. The gradient of x is the unweighted
    combine of the output's gradient (one pass, deterministic)."""
    op = "tigon.ops.moe_permute"
    _validate(op, x, "x", None, pos, n_rows, combine=False)
    n_rows = _n_rows_arg(n_rows)
    if not _library.use_kernels("moe_permute", x):
        return reference.moe_permute(x, pos, n_rows)
    return _SCATTER(x, None, pos, n_rows, grad_from=(x,))
