"""Cross-entropy with label smoothing, z-loss and tanh softcap: one Triton program per row, forward and
gradient in the same pass over the row.

loss_i = lse_i - x_{i,t}  (smoothed: (1 - ls) (lse - x_t) + ls (lse - mean x)),  plus z * lse^2,
with x = softcap * tanh(logits / softcap) when softcap is set; math in fp32 over V in BLOCK_V tiles (online
max and sum-exp), so V has no upper limit. When a gradient is needed the same program walks the row again
right away (it is still in L2) and writes the gradient for grad_output == 1; backward then only rescales it,
and skips even that (without touching memory or syncing) when grad_output is 1. The math, the byte model
and the out-of-range target rule are in docs/ops/cross_entropy.md.
"""

import math
import numbers
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, _library, reference
from .config import CrossEntropyConfig

REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}
_NONE, _MEAN, _SUM = 0, 1, 2
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# (block_v, num_warps, scale_per_sm, l2_hints) = CrossEntropyConfig.ints(), the form a custom op takes; None:
# these defaults (block_v, num_warps 0: picked from V by block_config).
_DEFAULT = tuple(CrossEntropyConfig().ints())


@triton.jit
def _softcap(b_x, softcap):
    """(softcap * tanh(x / softcap), tanh(x / softcap)); tanh(u) = 2 sigmoid(2u) - 1 (no libdevice)."""
    b_th = 2.0 * tl.sigmoid(2.0 * b_x / softcap) - 1.0
    return softcap * b_th, b_th


@triton.jit
def _cross_entropy_kernel(
    X,  # [N, V] logits rows, unit last stride
    T,  # [N] integer targets
    LOSS,  # [N] fp32 per-row loss (0 for ignored rows, NaN for an out-of-range target)
    DX,  # [N, V] gradient, logits' dtype (written when HAS_GRAD; may be X itself: in place)
    DENOM,  # [1] fp32 mean denominator: the gradient is divided by it (read when HAS_DENOM)
    ROW_SCALE,  # [N] per-row grad_output folded into the gradient (read when HAS_ROW_SCALE)
    stride_x,  # row strides, in elements
    stride_t,
    stride_dx,
    stride_rs,
    V,  # vocabulary size
    ignore_index,
    label_smoothing,  # runtime floats: new values never recompile
    z_loss_scale,
    softcap,
    HAS_GRAD: tl.constexpr,
    HAS_DENOM: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    L2_HINTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_x = X + row * stride_x
    t = tl.load(T + row * stride_t).to(tl.int64)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    ls = tl.cast(label_smoothing, tl.float32)
    z = tl.cast(z_loss_scale, tl.float32)
    cap = tl.cast(softcap, tl.float32)
    o_v = tl.arange(0, BLOCK_V)
    b_m = tl.full([], float("-inf"), tl.float32)
    b_d = tl.zeros([], dtype=tl.float32)
    b_s = tl.zeros([], dtype=tl.float32)
    b_xt = tl.zeros([], dtype=tl.float32)
    # Ignored rows (often a third of a fine-tuning batch) read nothing: loss 0, gradient written as zeros.
    if valid:
        for v0 in range(0, V, BLOCK_V):
            o = v0 + o_v
            m_v = o < V
            # evict_last: keep the row in L2 for the gradient pass that follows
            if L2_HINTS:
                b_x = tl.load(p_x + o, mask=m_v, other=0.0, eviction_policy="evict_last").to(tl.float32)
            else:
                b_x = tl.load(p_x + o, mask=m_v, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                b_x, _ = _softcap(b_x, cap)
            if HAS_SMOOTHING:
                b_s += tl.sum(tl.where(m_v, b_x, 0.0), axis=0)
            b_x = tl.where(m_v, b_x, float("-inf"))
            # one exp per element: rescale the running sum by a scalar when the max moves
            b_m_new = tl.maximum(b_m, tl.max(b_x, axis=0))
            b_d = b_d * tl.exp(b_m - b_m_new) + tl.sum(tl.exp(b_x - b_m_new), axis=0)
            b_m = b_m_new
        # an out-of-range target is never read: the address is clamped and the value made NaN
        b_xt = tl.load(p_x + tl.where(in_range, t, 0)).to(tl.float32)
        if HAS_SOFTCAP:
            b_xt, _ = _softcap(b_xt, cap)
        b_xt = tl.where(in_range, b_xt, float("nan"))
    else:
        # lse 0 (not -inf) for an ignored row: no inf - inf on the way to its loss of 0
        b_m, b_d = tl.zeros([], dtype=tl.float32), tl.full([], 1.0, tl.float32)
    b_lse = b_m + tl.log(b_d)
    b_loss = b_lse - b_xt
    if HAS_SMOOTHING:
        b_loss = (1.0 - ls) * b_loss + ls * (b_lse - b_s / V)
    if HAS_Z:
        b_loss += z * b_lse * b_lse
    tl.store(LOSS + row, tl.where(valid, b_loss, 0.0))
    if HAS_GRAD:
        p_dx = DX + row * stride_dx
        if valid:
            b_scale = tl.full([], 1.0, tl.float32)
            if HAS_DENOM:
                b_scale = b_scale / tl.load(DENOM).to(tl.float32)
            if HAS_ROW_SCALE:
                b_scale = b_scale * tl.load(ROW_SCALE + row * stride_rs).to(tl.float32)
            b_scale = tl.where(in_range, b_scale, float("nan"))
            # d/dx = scale * (softmax * (1 + 2 z lse) - ls / V - (1 - ls) onehot(t)) * dcap/dx
            b_cp = b_scale * (1.0 + 2.0 * z * b_lse)
            b_call = b_scale * ls / V
            b_ct = b_scale * (1.0 - ls)
            # Backwards over the row: the tiles read last are the likeliest to be still in L2. The gradient
            # is streamed out (evict_first) so it does not push the other rows out of L2.
            n_tiles = tl.cdiv(V, BLOCK_V)
            for i in range(0, n_tiles):
                o = (n_tiles - 1 - i) * BLOCK_V + o_v
                m_v = o < V
                if L2_HINTS:
                    b_x = tl.load(p_x + o, mask=m_v, other=0.0, eviction_policy="evict_first").to(tl.float32)
                else:
                    b_x = tl.load(p_x + o, mask=m_v, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    b_x, b_th = _softcap(b_x, cap)
                b_g = tl.exp(b_x - b_lse) * b_cp - b_call
                b_g = tl.where(o == t, b_g - b_ct, b_g)
                if HAS_SOFTCAP:
                    b_g = b_g * (1.0 - b_th * b_th)
                if L2_HINTS:
                    tl.store(p_dx + o, b_g.to(DX.dtype.element_ty), mask=m_v, eviction_policy="evict_first")
                else:
                    tl.store(p_dx + o, b_g.to(DX.dtype.element_ty), mask=m_v)
        else:
            b_zero = tl.zeros([BLOCK_V], dtype=DX.dtype.element_ty)
            for v0 in range(0, V, BLOCK_V):
                o = v0 + o_v
                tl.store(p_dx + o, b_zero, mask=o < V)


@triton.jit
def _scale_grad_kernel(
    G,  # [M, C] gradient, scaled in place
    GO,  # [1] or [M] grad_output
    stride_g,
    stride_go,
    M,
    C,
    PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grad_output is 1.0 after a plain loss.backward(): each program loads it, sees 1 and exits, so the
    # common backward costs a launch and no memory traffic, and the host never reads the value.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    o_c = tl.arange(0, BLOCK)
    if PER_ROW:
        for row in range(pid, M, n_prog):
            row = tl.cast(row, tl.int64)
            b_go = tl.load(GO + row * stride_go).to(tl.float32)
            if b_go != 1.0:
                for c0 in range(0, C, BLOCK):
                    p = G + row * stride_g + c0 + o_c
                    m_c = c0 + o_c < C
                    b_g = tl.load(p, mask=m_c, other=0.0).to(tl.float32)
                    tl.store(p, (b_g * b_go).to(G.dtype.element_ty), mask=m_c)
    else:
        b_go = tl.load(GO).to(tl.float32)
        if b_go != 1.0:
            n_col = tl.cdiv(C, BLOCK)
            for tile in range(pid, M * n_col, n_prog):
                tile = tl.cast(tile, tl.int64)
                c0 = (tile % n_col) * BLOCK
                p = G + (tile // n_col) * stride_g + c0 + o_c
                m_c = c0 + o_c < C
                b_g = tl.load(p, mask=m_c, other=0.0).to(tl.float32)
                tl.store(p, (b_g * b_go).to(G.dtype.element_ty), mask=m_c)


def block_config(V: int, device: torch.device, config=None) -> tuple:
    """(BLOCK_V, num_warps) for the row kernel. GPU: 8192-wide tiles, 16 warps (16 fp32 values a thread);
    one resident program per SM keeps 132 rows (33 MB at V=128256 bf16) in flight, under the 50 MB L2, so the
    gradient pass re-reads the row from L2. The interpreter uses 512 so that small test vocabularies
    still loop over several tiles. config: CrossEntropyConfig.ints() or None."""
    if device.type != "cuda":
        return min(_launch.next_power_of_2(max(V, 1)), 512), 1
    # H200 sweep at [4096, 128256] bf16 (benchmarks/results/h200_tune.json): 8192 x 16 warps 883 us
    # fwd+bwd, 16384 x 16 warps 970 us, 32768 x 32 warps 885 us.
    block_v, num_warps = (config or _DEFAULT)[:2]
    block = min(_launch.next_power_of_2(max(V, 1)), block_v or 8192)
    return block, num_warps or max(1, min(16, block // 512))


def launch(x, target, loss, dx, denom=None, row_scale=None, *, ignore_index, label_smoothing, z_loss_scale,
           softcap, config=None):
    """Run the row kernel: x [N, V] (unit last stride), target [N], loss [N] fp32; the gradient goes to dx
    (None: forward only; x itself: in place). softcap 0 means none. config: CrossEntropyConfig.ints() or
    None. Used by linear_cross_entropy too."""
    N, V = x.shape
    if N == 0:
        return
    block, warps = block_config(V, x.device, config)
    _cross_entropy_kernel[(N,)](
        x, target, loss, x if dx is None else dx, loss if denom is None else denom,
        loss if row_scale is None else row_scale, x.stride(0), target.stride(0),
        0 if dx is None else dx.stride(0), 0 if row_scale is None else row_scale.stride(0), V, ignore_index,
        label_smoothing, z_loss_scale, softcap if softcap else 1.0,
        HAS_GRAD=dx is not None, HAS_DENOM=denom is not None, HAS_ROW_SCALE=row_scale is not None,
        HAS_SMOOTHING=label_smoothing > 0, HAS_Z=z_loss_scale > 0, HAS_SOFTCAP=softcap > 0,
        L2_HINTS=bool((config or _DEFAULT)[3]), BLOCK_V=block, num_warps=warps,
    )


def not_ignored(target, ignore_index):
    """target != ignore_index, as the kernel compares (in int64). torch would cast an ignore_index that the
    target's dtype cannot hold (-1 for uint8, 2**32 for int32) and wrap it onto a real class."""
    info = torch.iinfo(target.dtype)
    if not info.min <= ignore_index <= info.max:
        return torch.ones_like(target, dtype=torch.bool)
    return target != ignore_index


def denominator(target, ignore_index, reduction, num_items):
    """[1] fp32 device tensor the loss (and gradient) is divided by, or None (sum, none)."""
    if num_items is not None:
        return num_items.to(torch.float32).reshape(1)
    if reduction == _MEAN:
        return not_ignored(target, ignore_index).sum().to(torch.float32).reshape(1)  # stays on the device
    return None


def reduce(loss_rows, denom, reduction):
    if denom is not None:
        return loss_rows.sum() / denom[0]
    return loss_rows if reduction == _NONE else loss_rows.sum()


def _fwd(logits, target, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction, dx,
         config=None):
    denom = denominator(target, ignore_index, reduction, num_items)
    loss_rows = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    launch(logits, target, loss_rows, dx, denom, ignore_index=ignore_index, label_smoothing=label_smoothing,
           z_loss_scale=z_loss_scale, softcap=softcap, config=config)
    return reduce(loss_rows, denom, reduction)


def _loss_fake(logits, num_items, reduction):
    rows = reduction == _NONE and num_items is None
    return logits.new_empty((logits.shape[0],) if rows else (), dtype=torch.float32)


def _fwd_launch(
    logits: torch.Tensor, target: torch.Tensor, num_items: Optional[torch.Tensor], ignore_index: int,
    label_smoothing: float, z_loss_scale: float, softcap: float, reduction: int, compute_grad: bool,
    config: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (unit last stride), target [N]. Returns (loss: [] or [N] fp32, dlogits for
    grad_output == 1 in logits' dtype, or empty when compute_grad is False). config: None or
    `CrossEntropyConfig.ints()`."""
    dx = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
    loss = _fwd(logits, target, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction, dx,
                config)
    return loss, (dx if compute_grad else logits.new_empty(0))


def _fwd_fake(logits, target, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction,
              compute_grad, config=None):
    dx = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0)
    return _loss_fake(logits, num_items, reduction), dx


def _fwd_inplace_launch(
    logits: torch.Tensor, target: torch.Tensor, num_items: Optional[torch.Tensor], ignore_index: int,
    label_smoothing: float, z_loss_scale: float, softcap: float, reduction: int, config: Optional[list[int]] = None,
) -> torch.Tensor:
    """As cross_entropy_fwd with compute_grad, but the gradient overwrites the logits: no [N, V] allocation."""
    return _fwd(logits, target, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction,
                logits, config)


def _fwd_inplace_fake(logits, target, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction,
                      config=None):
    return _loss_fake(logits, num_items, reduction)


# An eager call bumps the logits' version: another op that saved them for its backward then fails loudly
# ("modified by an inplace operation") instead of reading the gradient.
_FWD_INPLACE = _library.Kernel("cross_entropy_fwd_inplace", _fwd_inplace_launch, _fwd_inplace_fake,
                               mutates_args=("logits",))


def _scale_grad_launch(grad: torch.Tensor, grad_output: torch.Tensor, per_sm: int = _DEFAULT[2]) -> None:
    """grad [M, C] (or [C]) *= grad_output ([] / [1]: one scale; [M]: one per row), in place; a no-op on the
    device when the scale is 1. per_sm: programs per SM (CrossEntropyConfig.scale_per_sm)."""
    per_row = grad_output.numel() != 1
    # one scale: a contiguous gradient is one long row cut into BLOCK tiles (dW [V, 16] is not 16-wide tiles)
    g = grad.view(1, -1) if (not per_row and grad.is_contiguous()) or grad.dim() == 1 else grad
    M, C = g.shape
    go = grad_output.reshape(-1)
    if M == 0 or C == 0:
        return
    block = min(_launch.next_power_of_2(C), 4096 if g.device.type == "cuda" else 1024)
    tiles = M * _launch.cdiv(C, block) if not per_row else M
    n_prog = _launch.num_programs(g.device, tiles, per_sm=per_sm)
    _scale_grad_kernel[(n_prog,)](
        g, go, g.stride(0), go.stride(0) if per_row else 0, M, C, PER_ROW=per_row, BLOCK=block,
        num_warps=max(1, min(8, block // 512)),
    )


def _scale_grad_fake(grad, grad_output, per_sm=_DEFAULT[2]):
    return None


# An eager call bumps grad's version as the custom op's mutation would: see apply_grad_output.
SCALE_GRAD = _library.Kernel("scale_grad_", _scale_grad_launch, _scale_grad_fake, mutates_args=("grad",))


def _scaler(scale, config):
    """`scale` (a scale_grad_ form) with the programs per SM of `config` (CrossEntropyConfig.ints() or None)."""
    if config is None:
        return scale
    return lambda g, go: scale(g, go, config[2])


def apply_grad_output(grads, grad_output, scale):
    """Scale the gradients computed in the forward by grad_output, in place, without a host sync; scale: a form
    of `SCALE_GRAD` (`SCALE_GRAD.on(ctx)` in a backward). The in-place write bumps their version, so a second
    backward through a retained graph raises autograd's "modified by an inplace operation" error instead of
    returning a twice-scaled gradient."""
    for g in grads:
        if g is not None:
            scale(g, grad_output)


def saved_grads(ctx, op):
    """ctx.saved_tensors of a node whose forward made the gradients: the first backward scales them in place,
    so a second one through a retained graph raises here, naming the op, instead of returning a twice-scaled
    gradient (autograd's own version check would raise too, but without saying which op or why)."""
    if getattr(ctx, "grads_scaled", False):
        raise RuntimeError(
            f"{op}: a second backward through the same graph (retain_graph=True) is not supported: the "
            "gradient this op made in the forward was modified by an inplace operation (scaled by grad_output) "
            "in the first backward; run the forward again instead"
        )
    saved = ctx.saved_tensors
    ctx.grads_scaled = True
    return saved


def _setup(ctx, inputs, output):
    compute_grad = inputs[8]
    ctx.config, ctx.n_inputs = (inputs[9] if len(inputs) > 9 else None), len(inputs)
    ctx.mark_non_differentiable(output[1])
    # The gradient outputs get no gradient: without this, autograd would fill a zero tensor of their size
    # for each (measured on the H200: +1 GiB and +300 us for CE at [4096, 128256]).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[1] if compute_grad else None)


def _backward(ctx, dloss, _ddx):
    _library.refuse_double_backward("tigon.ops.cross_entropy")
    (dx,) = saved_grads(ctx, "tigon.ops.cross_entropy")
    apply_grad_output([dx], dloss, _scaler(SCALE_GRAD.on(ctx), ctx.config))
    return (dx,) + (None,) * (ctx.n_inputs - 1)


_CROSS_ENTROPY = _library.Op("cross_entropy_fwd", _fwd_launch, _fwd_fake, _setup, _backward)


class _CrossEntropyInplace(torch.autograd.Function):
    """inplace_backward: the logits buffer holds the gradient after the forward (a mutable op has no
    register_autograd, hence a Function)."""

    @staticmethod
    def forward(ctx, logits, target, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction,
                config=None):
        args = (logits, target, num_items, ignore_index, label_smoothing, z_loss_scale, softcap, reduction, config)
        loss = _FWD_INPLACE(*args)
        ctx.save_for_backward(logits)
        ctx.config = config
        return loss

    @staticmethod
    def backward(ctx, dloss):
        _library.refuse_double_backward("tigon.ops.cross_entropy")
        (dx,) = saved_grads(ctx, "tigon.ops.cross_entropy")
        apply_grad_output([dx], dloss, _scaler(SCALE_GRAD, ctx.config))
        return dx, None, None, None, None, None, None, None, None


def validate_loss_args(op, target, lead_shape, device, ignore_index, reduction, label_smoothing, z_loss_scale,
                       softcap, num_items_in_batch):
    """Checks shared by cross_entropy and linear_cross_entropy; returns (ls, z, softcap or 0.0). Shapes,
    dtypes and Python values only: no tensor data is read (no host sync, nothing for torch.compile to break on)."""
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in _INT_DTYPES:
        raise TypeError(f"{op}: target must be an integer tensor of class indices, got {target.dtype}")
    if tuple(target.shape) != tuple(lead_shape):
        raise ValueError(f"{op}: target must have shape {tuple(lead_shape)}, got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"{op}: target is on {target.device} but the input is on {device}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if not -(2**63) <= ignore_index < 2**63:  # the kernel compares in int64
        raise ValueError(f"{op}: ignore_index must fit in int64, got {ignore_index}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    n = num_items_in_batch
    if isinstance(n, torch.Tensor):
        if n.numel() != 1 or n.dtype == torch.bool or n.is_complex():
            raise TypeError(f"{op}: num_items_in_batch must be a number or a one-element real tensor, got "
                            f"shape {tuple(n.shape)} {n.dtype}")
        if n.device != device and n.device.type != "cpu":
            raise ValueError(f"{op}: num_items_in_batch is on {n.device} but the input is on {device}")
    elif n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Real)):
        raise TypeError(f"{op}: num_items_in_batch must be a number or a one-element tensor, got {n!r}")
    return (_launch.check_number(op, "label_smoothing", label_smoothing, 0.0, 1.0),
            _launch.check_number(op, "z_loss_scale", z_loss_scale, 0.0),
            _softcap_value(op, softcap))


def _softcap_value(op, softcap):
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not 0 < softcap < math.inf:
        raise ValueError(f"{op}: softcap must be None or a finite number > 0, got {softcap!r}")
    return float(softcap)


def num_items_tensor(num_items_in_batch, device):
    """num_items_in_batch as a 0-d fp32 tensor on `device` (a fill, or an async copy: never a host sync)."""
    n = num_items_in_batch
    if n is None:
        return None
    if isinstance(n, torch.Tensor):
        return n.detach().reshape(()).to(device=device, dtype=torch.float32, non_blocking=True)
    return torch.full((), float(n), dtype=torch.float32, device=device)


def _validating(device) -> bool:
    return _library.host_checks(device)


def check_target(op, target, V, ignore_index):
    """ValueError for a target outside [0, V) that is not ignore_index (when validating; else NaN loss)."""
    if not _validating(target.device):
        return
    bad = not_ignored(target, ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{op}: target must be in [0, {V}) or ignore_index={ignore_index}; got {int(target[idx])} at "
            f"index {idx if len(idx) != 1 else idx[0]}"
        )


def cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss_scale=0.0,
                  softcap=None, inplace_backward=False, num_items_in_batch=None, config=None):
    """F.cross_entropy(logits.float(), target) with z-loss and softcap; fp32 loss.

    logits [..., V] fp32/fp16/bf16 (any V), target [...] integer class indices. reduction "mean" divides by
    the non-ignored tokens (NaN when there are none); num_items_in_batch (number or one-element tensor)
    makes the loss sum / num_items_in_batch whatever the reduction. z_loss_scale adds z * lse^2 per token;
    softcap maps logits to softcap * tanh(logits / softcap) first. inplace_backward=True writes the gradient
    into the logits buffer (saves one [N, V] tensor; the logits are garbage afterwards); it is honoured only
    for logits that autograd made (not a leaf, nor a view of one) with no two elements in the same memory
    (an expanded row), and anything else silently takes the out-of-place path. A target outside
    [0, V) that is not ignore_index raises ValueError when validating (CPU, or TIGON_VALIDATE=1), else
    gives a NaN loss and NaN gradient row. Never syncs the host on CUDA. No double backward: a backward
    with create_graph=True raises NotImplementedError. config: a `CrossEntropyConfig` (the GPU launches; None:
    the measured defaults).
    """
    op, name = "cross_entropy", "tigon.ops.cross_entropy"
    _launch.check_tensor(name, "logits", logits)
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"{name}: logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    ls, z, cap = validate_loss_args(name, target, logits.shape[:-1], logits.device, ignore_index, reduction,
                                    label_smoothing, z_loss_scale, softcap, num_items_in_batch)
    _launch.check_bool(name, "inplace_backward", inplace_backward)
    if config is not None and not isinstance(config, CrossEntropyConfig):
        raise TypeError(f"{name}: config must be a tigon.ops.CrossEntropyConfig or None, got "
                        f"{type(config).__name__}")
    cfg = None if config is None else config.ints()
    V = logits.shape[-1]
    if not _library.use_kernels(op, logits):
        check_target(name, target, V, ignore_index)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.detach()  # a count: no gradient, as on the kernel path
        return _library.first_order_only(name, reference.cross_entropy(
            logits, target.long(), ignore_index=ignore_index, reduction=reduction, label_smoothing=ls,
            z_loss_scale=z, softcap=softcap, num_items_in_batch=num_items_in_batch,
        ))
    check_target(name, target, V, ignore_index)
    x, t = _launch.as_rows(logits), target.reshape(-1)
    num_items = num_items_tensor(num_items_in_batch, logits.device)
    red = REDUCTIONS[reduction]
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    # Writing the gradient over rows that share memory (logits.expand(N, V)) would overwrite a row while
    # another program reads it; over a leaf it would hand the caller's tensor back as its own .grad.
    if inplace_backward and need_grad and not _launch.is_leafish(x) and not _launch.may_overlap(x):
        loss = _CrossEntropyInplace.apply(x, t, num_items, ignore_index, ls, z, cap, red, cfg)
    else:
        loss, _ = _CROSS_ENTROPY(x, t, num_items, ignore_index, ls, z, cap, red, need_grad, cfg, grad_from=(x,))
    return loss.view(target.shape) if loss.dim() else loss
