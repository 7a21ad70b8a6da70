"""Fused linear cross-entropy: the LM head's loss without the [N, V] logits.

Tokens go through in chunks of C rows: logits_c = hidden_c @ weight.T (+ bias) by cuBLAS into a
RollingBuffer scratch [C, V], the cross-entropy row kernel writes the loss and, in place over the chunk,
the logits gradient (for grad_output == 1), then dh_c = grad_c @ weight and dW += grad_c.T @ hidden_c. All
gradients are made in the forward, like Liger; backward only rescales them by grad_output (nothing to do
when it is 1). reduction="none" cannot know its per-token grad_output in the forward: its backward redoes
the chunks with grad_output folded into the row kernel. Math and cost model: docs/ops/cross_entropy.md.
"""

import contextlib
import math
from typing import Optional

import torch

from . import _launch, _library, reference
from ._rolling_buffer import workspace
from .config import LINEAR_CROSS_ENTROPY, LinearCrossEntropyConfig

# named imports: `tigon.ops.cross_entropy` is the function once ops/__init__ has run
from .cross_entropy import (
    REDUCTIONS,
    SCALE_GRAD,
    apply_grad_output,
    check_target,
    denominator,
    num_items_tensor,
    reduce,
    saved_grads,
    validate_loss_args,
)
from .cross_entropy import launch as ce_launch

# device -> whether cuBLAS adds bf16 x bf16 into an fp32 C here (torch's addmm out_dtype); else a fallback.
_fp32_addmm_ok: dict = {}


def chunk_rows(N: int, V: int, itemsize: int, override: int = 0,
               chunk_bytes: int = LINEAR_CROSS_ENTROPY.chunk_bytes,
               min_rows: int = LINEAR_CROSS_ENTROPY.min_rows) -> int:
    """Rows per chunk: chunk_bytes of logits but at least min_rows, a multiple of 64 (GEMM tiles), balanced over
    the chunks; or `override` rows when > 0."""
    if override:
        return max(1, min(N, override))
    rows = max(1, chunk_bytes // max(1, V * itemsize), min_rows)
    if rows >= N:
        return max(1, N)
    step = 64 if rows >= 64 else 1
    rows = rows // step * step
    per_chunk = _launch.cdiv(N, _launch.cdiv(N, rows))  # same rows in every chunk, rounded up to the step
    return min(rows, _launch.cdiv(per_chunk, step) * step)


def _add_dw(dw, g_t, h_c, first: bool) -> None:
    """dw (+)= g_t @ h_c. dw is weight.dtype (cuBLAS adds into it, like Liger) or fp32 (accum_dtype)."""
    if dw.dtype == g_t.dtype:
        if first:
            torch.mm(g_t, h_c, out=dw)
        else:
            dw.addmm_(g_t, h_c)
        return
    if dw.device.type != "cuda":
        if first:
            torch.mm(g_t.float(), h_c.float(), out=dw)
        else:
            dw.addmm_(g_t.float(), h_c.float())
        return
    # bf16/fp16 inputs, fp32 C and accumulation in one cuBLAS call (torch's addmm out_dtype).
    key = dw.device
    if _fp32_addmm_ok.get(key, True):
        try:
            if first:
                torch.ops.aten.mm.dtype_out(g_t, h_c, torch.float32, out=dw)
            else:
                torch.ops.aten.addmm.dtype_out(dw, g_t, h_c, torch.float32, out=dw)
            _fp32_addmm_ok[key] = True
            return
        except RuntimeError:
            if _fp32_addmm_ok.get(key):  # it worked before: a real error
                raise
            _fp32_addmm_ok[key] = False
    # older torch: fp32 GEMM output for a block of dW rows into scratch, then add (one extra pass over dW)

    V, H = dw.shape
    step = max(1, min(V, LINEAR_CROSS_ENTROPY.chunk_bytes // (4 * H)))
    with workspace(dw.device).borrow(((step, H), torch.float32)) as (tmp,):
        for v0 in range(0, V, step):
            v1 = min(V, v0 + step)
            if first:
                torch.ops.aten.mm.dtype_out(g_t[v0:v1], h_c, torch.float32, out=dw[v0:v1])
            else:
                torch.ops.aten.mm.dtype_out(g_t[v0:v1], h_c, torch.float32, out=tmp[: v1 - v0])
                dw[v0:v1] += tmp[: v1 - v0]


@contextlib.contextmanager
def _fresh(shape, dtype, device):
    """A scratch tensor from PyTorch's allocator, as `workspace(...).borrow` lends one from the arena."""
    yield (torch.empty(shape, dtype=dtype, device=device),)


def _chunked(hidden, weight, target, bias, denom, row_scale, ignore_index, label_smoothing, z_loss_scale,
             softcap, need_dh, need_dw, need_db, accum_fp32, rows_override, arena=True):
    """The chunk loop. Returns (loss rows [N] fp32, dh or None, dw or None, db or None); the gradients are
    of sum(loss rows * row_scale) / denom (row_scale, denom None: 1). The chunk of logits is borrowed from the
    workspace arena (arena True: eager calls), or allocated for the call (inside a compiled graph: inductor
    plans the graph's memory, and CUDA-graph trees refuse a block that outlives the graph in their pool)."""

    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    need_grad = need_dh or need_dw or need_db
    loss_rows = torch.empty(N, dtype=torch.float32, device=dev)
    dh = torch.empty((N, H), dtype=hidden.dtype, device=dev) if need_dh else None
    dw = None
    if need_dw:  # fp32 when asked, or when the weight is an fp32 master copy (autocast)
        dw_dtype = torch.float32 if accum_fp32 else weight.dtype
        dw = (torch.empty if N else torch.zeros)((V, H), dtype=dw_dtype, device=dev)  # chunk 0 writes it all
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_db else None
    # autocast: GEMMs in hidden's dtype, like F.linear under autocast (a transient low-precision weight copy)
    weight_c = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
    bias_c = bias if bias is None or bias.dtype == hidden.dtype else bias.to(hidden.dtype)
    rows = chunk_rows(N, V, hidden.element_size(), rows_override)
    w_t = weight_c.t()
    scratch = workspace(dev).borrow(((rows, V), hidden.dtype)) if arena else _fresh((rows, V), hidden.dtype, dev)
    with scratch as (buf,):
        for i, s in enumerate(range(0, N, rows)):
            e = min(N, s + rows)
            logits, h_c = buf[: e - s], hidden[s:e]
            if bias_c is None:
                torch.mm(h_c, w_t, out=logits)
            else:
                torch.addmm(bias_c, h_c, w_t, out=logits)
            ce_launch(
                logits, target[s:e], loss_rows[s:e], logits if need_grad else None, denom,
                None if row_scale is None else row_scale[s:e], ignore_index=ignore_index,
                label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
            )
            # the chunk now holds d loss / d logits
            if need_dh:
                torch.mm(logits, weight_c, out=dh[s:e])
            if need_dw:
                _add_dw(dw, logits.t(), h_c, first=i == 0)
            if need_db:
                db += logits.sum(0, dtype=torch.float32)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return loss_rows, dh, dw, db


def _empty(t):
    return t.new_empty(0)


def _fwd_launch(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
    num_items: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, z_loss_scale: float,
    softcap: float, reduction: int, need_dh: bool, need_dw: bool, need_db: bool, accum_fp32: bool,
    rows_override: int, arena: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H], target [N], bias [V] or None. Returns (loss: [] or [N] fp32, and for
    mean/sum the gradients dh [N, H], dW [V, H], db [V] for grad_output == 1, each empty when not asked)."""
    rows_only = reduction == REDUCTIONS["none"] and num_items is None
    denom = denominator(target, ignore_index, reduction, num_items)
    if rows_only:
        need_dh = need_dw = need_db = False  # per-token grad_output comes in backward
    loss_rows, dh, dw, db = _chunked(
        hidden, weight, target, bias, denom, None, ignore_index, label_smoothing, z_loss_scale, softcap,
        need_dh, need_dw, need_db and bias is not None, accum_fp32, rows_override, arena,
    )
    loss = reduce(loss_rows, denom, reduction)
    return (loss, _empty(hidden) if dh is None else dh, _empty(weight) if dw is None else dw,
            _empty(weight) if db is None else db)


def _fwd_fake(hidden, weight, target, bias, num_items, ignore_index, label_smoothing, z_loss_scale, softcap,
              reduction, need_dh, need_dw, need_db, accum_fp32, rows_override, arena=True):
    rows_only = reduction == REDUCTIONS["none"] and num_items is None
    loss = hidden.new_empty((hidden.shape[0],) if rows_only else (), dtype=torch.float32)
    if rows_only:
        return loss, _empty(hidden), _empty(weight), _empty(weight)
    return (loss, torch.empty_like(hidden) if need_dh else _empty(hidden),
            torch.empty_like(weight) if need_dw else _empty(weight),
            torch.empty_like(bias) if (need_db and bias is not None) else _empty(weight))


def _bwd_launch(
    grad_rows: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, z_loss_scale: float, softcap: float,
    need_dh: bool, need_dw: bool, need_db: bool, accum_fp32: bool, rows_override: int, arena: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": recompute each chunk's logits and fold the per-token grad_output [N] into the row
    kernel. Returns (dh, dW, db), each empty when not asked."""
    _, dh, dw, db = _chunked(
        hidden, weight, target, bias, None, grad_rows, ignore_index, label_smoothing, z_loss_scale, softcap,
        need_dh, need_dw, need_db and bias is not None, accum_fp32, rows_override, arena,
    )
    return (_empty(hidden) if dh is None else dh, _empty(weight) if dw is None else dw,
            _empty(weight) if db is None else db)


def _bwd_fake(grad_rows, hidden, weight, target, bias, ignore_index, label_smoothing, z_loss_scale, softcap, need_dh,
              need_dw, need_db, accum_fp32, rows_override, arena=True):
    return (torch.empty_like(hidden) if need_dh else _empty(hidden),
            torch.empty_like(weight) if need_dw else _empty(weight),
            torch.empty_like(bias) if (need_db and bias is not None) else _empty(weight))


_LINEAR_CROSS_ENTROPY_BWD = _library.Kernel("linear_cross_entropy_bwd", _bwd_launch, _bwd_fake)


def _setup(ctx, inputs, output):
    (hidden, weight, target, bias, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction,
     need_dh, need_dw, need_db, accum_fp32, rows_override, arena) = inputs
    ctx.mark_non_differentiable(*output[1:])
    # The gradient outputs get no gradient: without this, autograd would fill a zero tensor of their size
    # for each (measured on the H200: +1 GiB and +300 us for CE at [4096, 128256]).
    ctx.set_materialize_grads(False)
    ctx.rows_only = reduction == REDUCTIONS["none"] and num_items is None
    if ctx.rows_only:
        ctx.save_for_backward(hidden, weight, target, bias)
        ctx.args = (ignore_index, label_smoothing, z_loss_scale, softcap)
        ctx.accum_fp32, ctx.rows_override, ctx.arena = accum_fp32, rows_override, arena
    else:
        ctx.save_for_backward(*(g if n else None for g, n in zip(output[1:], (need_dh, need_dw, need_db))))


def _backward(ctx, dloss, _ddh, _ddw, _ddb):
    _library.refuse_double_backward("tigon.ops.linear_cross_entropy")
    need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
    if ctx.rows_only:
        hidden, weight, target, bias = ctx.saved_tensors
        dh, dw, db = _LINEAR_CROSS_ENTROPY_BWD.on(ctx)(
            dloss, hidden, weight, target, bias, *ctx.args, *need, ctx.accum_fp32, ctx.rows_override, ctx.arena
        )
    else:
        dh, dw, db = saved_grads(ctx, "tigon.ops.linear_cross_entropy")
        apply_grad_output([dh, dw, db], dloss, SCALE_GRAD.on(ctx))
    dh, dw, db = (g if n else None for g, n in zip((dh, dw, db), need))
    return (dh, dw, None, db) + (None,) * (len(ctx.needs_input_grad) - 4)


_LINEAR_CROSS_ENTROPY = _library.Op("linear_cross_entropy_fwd", _fwd_launch, _fwd_fake, _setup, _backward)


def _validate(op, hidden, weight, target, bias, accum_dtype):
    _launch.check_tensor(op, "hidden", hidden)
    _launch.check_tensor(op, "weight", weight)
    _launch.check_min_dim(op, "hidden", hidden)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{op}: weight must have shape (V, {hidden.shape[-1]}) with V >= 1, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        _launch.check_tensor(op, "bias", bias)
        _launch.check_shape(op, "bias", bias, (weight.shape[0],))
    _launch.check_same_device(op, "hidden", hidden, weight=weight, bias=bias)
    if accum_dtype not in (None, torch.float32, weight.dtype):
        raise ValueError(f"{op}: accum_dtype must be None, torch.float32 or weight.dtype, got {accum_dtype!r}")


def _autocast(op, hidden, weight, bias):
    """Under autocast the lm_head GEMM runs in the autocast dtype: cast hidden (differentiably) and keep an
    fp32 weight and bias as they are (master copies): their gradients then accumulate and return in fp32."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        hidden = hidden.to(torch.get_autocast_dtype(dev))
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.dtype not in (hidden.dtype, torch.float32):
                raise TypeError(f"{op}: under autocast {name} must be {hidden.dtype} or float32, got {t.dtype}")
        return hidden
    _launch.check_same_dtype(op, "hidden", hidden, weight=weight, bias=bias)
    return hidden


def _kept_rows(target, ignore_index):
    """Indices of the rows whose target is not ignore_index, when dropping the others pays; else None.

    One host sync (the count sets the GEMM shapes), so never while tracing or capturing a CUDA graph, where a
    shape must not depend on data. Dropping pays when at least 1/64 of the rows go: each dropped row saves its
    share of three [rows, V] x [V, H] GEMMs; the gather of the kept rows and the scatter of their gradient cost
    a pass over [N, H] (at V = 128256 on an H200 the break-even is ~0.1% of the rows dropped)."""
    if _library.tracing() or (target.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    t = target.reshape(-1)
    keep = (t != ignore_index).nonzero().squeeze(1)
    dropped = t.numel() - keep.numel()
    if keep.numel() == 0 or dropped * 64 < t.numel():
        return None
    return keep


def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss_scale=0.0, softcap=None, num_items_in_batch=None,
                         accum_dtype=None, skip_ignored=False, config=None, _chunk_rows=0):
    """cross_entropy(hidden @ weight.T + bias, target) without materializing the logits.

    hidden [..., H], weight [V, H] (the lm_head), bias [V] or None, all one float dtype (under autocast the
    GEMMs run in the autocast dtype and an fp32 weight gets an fp32 gradient accumulated in fp32); target
    [...] integer class indices. Options as `cross_entropy`. The loss is fp32; exact
    gradients for hidden, weight and bias. dW accumulates over token chunks in weight.dtype (cuBLAS addmm,
    like Liger) or in fp32 with accum_dtype=torch.float32 (a transient fp32 [V, H]). Extra memory: the
    gradients plus one chunk of logits (config: a `LinearCrossEntropyConfig`, the chunking; None: 192 MiB of
    logits, at least 768 rows). A frozen weight or bias (requires_grad False: LoRA, QLoRA) gets no gradient and
    costs no GEMM or buffer. Rows whose target is ignore_index go through the GEMMs (their gradient rows are
    zeros) unless skip_ignored=True, which drops them first when at least 1/64 of the rows are ignored
    (completion-only SFT, padding): the GEMMs then run on the kept rows only, at the cost of one host sync to
    count them. skip_ignored is inert while tracing or capturing a CUDA graph. Otherwise never syncs the host on
    CUDA. No double backward: a backward with create_graph=True raises NotImplementedError.
    """
    op, name = "linear_cross_entropy", "tigon.ops.linear_cross_entropy"
    _validate(name, hidden, weight, target, bias, accum_dtype)
    if config is not None and not isinstance(config, LinearCrossEntropyConfig):
        raise TypeError(f"{name}: config must be a tigon.ops.LinearCrossEntropyConfig or None, got "
                        f"{type(config).__name__}")
    ls, z, cap = validate_loss_args(name, target, hidden.shape[:-1], hidden.device, ignore_index, reduction,
                                    label_smoothing, z_loss_scale, softcap, num_items_in_batch)
    hidden = _autocast(name, hidden, weight, bias)
    V = weight.shape[0]
    check_target(name, target, V, ignore_index)
    if not isinstance(skip_ignored, bool):
        raise TypeError(f"{name}: skip_ignored must be a bool, got {type(skip_ignored).__name__}")
    keep = _kept_rows(target, ignore_index) if skip_ignored else None
    if keep is not None:  # the same op on the kept rows; an ignored row's loss is 0 and its gradient zeros
        loss = linear_cross_entropy(
            _launch.as_rows(hidden).index_select(0, keep), weight, target.reshape(-1).index_select(0, keep),
            bias, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale, softcap=softcap, num_items_in_batch=num_items_in_batch,
            accum_dtype=accum_dtype, config=config, _chunk_rows=_chunk_rows)
        if loss.dim() == 0:
            return loss
        return loss.new_zeros(target.numel()).index_copy(0, keep, loss).view(target.shape)
    if not _library.use_kernels(op, hidden):
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.detach()  # a count: no gradient, as on the kernel path
        return _library.first_order_only(name, reference.linear_cross_entropy(
            hidden, weight, target.long(), bias, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=ls, z_loss_scale=z, softcap=softcap, num_items_in_batch=num_items_in_batch,
        ))
    # A frozen lm_head (LoRA, QLoRA: weight.requires_grad False) or bias asks for no gradient: no dW / db GEMM
    # runs and no [V, H] buffer is allocated (need_dw / need_db False all the way into the chunk loop).
    need = [_library.needs_grad(t) for t in (hidden, weight, bias)]
    rows = int(_chunk_rows)
    if not rows and config is not None:  # the rows on the host, from shapes: the op takes them as one int
        rows = config.chunk_rows or chunk_rows(math.prod(hidden.shape[:-1]), V, hidden.element_size(),
                                               chunk_bytes=config.chunk_bytes, min_rows=config.min_rows)
    loss, *_ = _LINEAR_CROSS_ENTROPY(
        _launch.as_rows(hidden), weight, target.reshape(-1), bias,
        num_items_tensor(num_items_in_batch, hidden.device), ignore_index, ls, z, cap,
        REDUCTIONS[reduction], *need, accum_dtype == torch.float32, rows, not _library.tracing(),
        grad_from=(hidden, weight, bias),
    )
    return loss.view(target.shape) if loss.dim() else loss
