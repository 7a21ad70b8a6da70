"""A linear layer with LoRA adapters as one node: out = x W^T + b + sum_i s_i (drop_i(x) A_i^T) B_i^T.

PEFT's lora.Linear computes the base output, then per adapter a [T, out] product, a [T, out] multiply by the
scaling and a [T, out] add (with fp32 adapters, PEFT's default, also an fp32 copy of x and a cast of the sum back):
passes over [T, out] and [T, in] that move more bytes than the adapter GEMMs themselves. Here the adapters go
first: the first adapter's GEMM writes s xa B^T (+ b) into a new `out` (xa = drop(x) A^T [T, r]), the others add
into it (out.addmm_(xa, B^T, alpha=s)), and the base GEMM comes last, out.addmm_(x, W^T): it reads `out` in its
epilogue (beta = 1) while it is compute-bound, so the one exposed [T, out] pass is the small GEMM's write (adding
the adapters after the base GEMM instead read and rewrote all of `out`). Forward keeps x and xa only. Backward,
the same order: gb = g B [T, r]; the adapters' dx s gb A summed into a new [T, in] tensor, then dx.addmm_(g, W);
dA = s gb^T x and dB = s g^T xa (fp32 outputs for fp32 adapters); dW = g^T x only when the base weight wants a
gradient.

All GEMMs run in x's dtype (cuBLAS, fp32 accumulation); adapter weights of another dtype (PEFT's fp32 adapters
on a bf16 base) are cast to it, a [r, in] + [out, r] copy. Rounding: out is one rounding to x's dtype of the fp32
accumulation x W^T + S, S the adapters' part (with the bias) already rounded to x's dtype (once per adapter
added); x W^T is never rounded on its own (adding the adapters last rounded x W^T + b first). dx likewise: one
rounding of g W + the adapters' dx, itself rounded once per adapter. Dropout p > 0: adapter i's input is
torch.native_dropout(x, p_i) (drawn in adapter order, each before its GEMM); the dropped x and its bool mask are
kept for backward (3 bytes a [T, in] element, x itself is then not kept for a frozen base).

lora_add (the second half of this file) is the adapter part alone, over a base output the caller computed (PEFT's
bitsandbytes layers): the same forward and backward helpers; the first adapter's GEMM reads base_out and writes a
new result, base_out is never written (why: docs/ops/lora.md, "lora_add"). Math and byte model: docs/ops/lora.md.
"""

import math
import numbers
from collections.abc import Sequence
from typing import Optional, Union

import torch

from . import _launch, _library, reference

OP = "tigon.ops.lora_linear"
_mm_dtype_ok: dict = {}  # device -> whether cuBLAS writes bf16 x bf16 into an fp32 result (aten.mm.dtype)


def _mm(a, b, dtype):
    """a @ b with fp32 accumulation, the result in `dtype` (an fp32 gradient of an fp32 adapter weight)."""
    if dtype == a.dtype:
        return a @ b
    if a.device.type == "cuda" and _mm_dtype_ok.get(a.device, True):
        try:
            out = torch.ops.aten.mm.dtype(a, b, dtype)
            _mm_dtype_ok[a.device] = True
            return out
        except RuntimeError:
            if _mm_dtype_ok.get(a.device):
                raise
            _mm_dtype_ok[a.device] = False
    if a.device.type == "cuda":  # older torch: round once to a's dtype (the [r, in] / [out, r] result only)
        return (a @ b).to(dtype)
    return a.to(dtype) @ b.to(dtype)  # CPU: no mixed-dtype GEMM; upcast the operands


def _adapters(x, lora_a, lora_b, scaling, dropout_p, base):
    """base + sum_i s_i drop_i(x) A_i^T B_i^T [T, out] in a new tensor: the first adapter's GEMM writes it (base,
    an [out] bias or the caller's [T, out] output, added in that GEMM's epilogue and never written; None: beta = 0),
    the others add into it in place. Returns (the sum, None without adapters; xa per adapter [T, r]; dropped x per
    adapter (empty where p == 0); mask per adapter (empty where p == 0))."""
    dt = x.dtype
    out, xas, dropped, masks = None, [], [], []
    for a, b, s, p in zip(lora_a, lora_b, scaling, dropout_p):
        if p > 0:  # drawn in adapter order, each right before its use
            xin, mask = torch.native_dropout(x, p, True)
        else:
            xin, mask = x, None
        xa = xin @ a.to(dt).t()
        bt = b.to(dt).t()
        if out is not None:
            out.addmm_(xa, bt, alpha=s)
        elif base is not None:
            out = torch.addmm(base, xa, bt, alpha=s)
        else:  # beta=0: the 0-dim input is never read (no fill kernel); the scale lands in the fp32 epilogue
            out = torch.addmm(x.new_empty(()), xa, bt, beta=0, alpha=s)
        xas.append(xa)
        dropped.append(x.new_empty(0) if mask is None else xin)
        masks.append(x.new_empty(0, dtype=torch.bool) if mask is None else mask)
    return out, xas, dropped, masks


def _forward(x, weight, bias, lora_a, lora_b, scaling, dropout_p):
    """x [T, in] -> (out [T, out], xas, dropped, masks) as _adapters: the adapters' sum (with the bias) first, then
    the base GEMM adds x W^T into it in its epilogue (beta = 1)."""
    out, xas, dropped, masks = _adapters(x, lora_a, lora_b, scaling, dropout_p, bias)
    if out is None:
        out = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
    else:
        out.addmm_(x, weight.t())
    return out, xas, dropped, masks


def _inference(x, weight, bias, lora_a, lora_b, scaling, dropout_p):
    return _forward(x, weight, bias, lora_a, lora_b, scaling, dropout_p)[0]


def _adapter_backward(g, x, lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_x, need_ab):
    """The adapters' part of backward: their dx summed into a new [T, in] tensor (None when not need_x or without
    adapters), and [dA_i], [dB_i] (None where not asked). Returns (dx, das, dbs)."""
    dt = g.dtype
    dx, das, dbs = None, [], []
    for a, b, xa, xd, mask, s, p, need in zip(lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_ab):
        gb = g @ b.to(dt)  # [T, r]
        if need_x:
            c = s / (1 - p) if p > 0 else s  # d drop(x)/dx = mask / (1 - p)
            if dx is None:  # beta=0 as in _adapters: a new [T, in] tensor, the scale in the fp32 epilogue
                dx = torch.addmm(g.new_empty(()), gb, a.to(dt), beta=0, alpha=c)
                if p > 0:
                    dx.mul_(mask)
            elif p > 0:
                dx.addcmul_(gb @ a.to(dt), mask, value=c)
            else:
                dx.addmm_(gb, a.to(dt), alpha=s)
        das.append(_mm(gb.t(), xd if p > 0 else x, a.dtype).mul_(s) if need else None)
        dbs.append(_mm(g.t(), xa, b.dtype).mul_(s) if need else None)
    return dx, das, dbs


def _backward(g, x, weight, lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_x, need_w, need_bias,
              need_ab):
    """Returns (dx, dW, db, [dA_i], [dB_i]); None where not asked. x may be empty when nothing reads it. dx: the
    adapters' part first, then the base GEMM adds g W into it in its epilogue (beta = 1)."""
    dx, das, dbs = _adapter_backward(g, x, lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_x, need_ab)
    if need_x:
        dx = g @ weight if dx is None else dx.addmm_(g, weight)
    dw = _mm(g.t(), x, weight.dtype) if need_w else None
    db = g.sum(0, dtype=torch.float32).to(weight.dtype) if need_bias else None
    return dx, dw, db, das, dbs


def _empty_or(t, like):
    return like.new_empty(0) if t is None else t


@torch.library.custom_op("tigon::lora_linear_fwd", mutates_args=())
def lora_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], lora_a: list[torch.Tensor],
                    lora_b: list[torch.Tensor], scaling: list[float], dropout_p: list[float]
                    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """x [T, in] -> (out [T, out], xa_i [T, r_i], dropped x_i ([T, in] or empty), mask_i ([T, in] bool or empty))."""
    return _forward(x, weight, bias, lora_a, lora_b, scaling, dropout_p)


@lora_linear_fwd.register_fake
def _(x, weight, bias, lora_a, lora_b, scaling, dropout_p):
    T = x.shape[0]
    out = x.new_empty((T, weight.shape[0]))
    xas = [x.new_empty((T, a.shape[0])) for a in lora_a]
    dropped = [x.new_empty(x.shape if p > 0 else (0,)) for p in dropout_p]
    masks = [x.new_empty(x.shape if p > 0 else (0,), dtype=torch.bool) for p in dropout_p]
    return out, xas, dropped, masks


@torch.library.custom_op("tigon::lora_linear_bwd", mutates_args=())
def lora_linear_bwd(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_a: list[torch.Tensor],
                    lora_b: list[torch.Tensor], xas: list[torch.Tensor], dropped: list[torch.Tensor],
                    masks: list[torch.Tensor], scaling: list[float], dropout_p: list[float], need_x: bool,
                    need_w: bool, need_bias: bool, need_ab: list[bool]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The gradients (dx, dW, db, dA_i, dB_i), each empty where not asked."""
    dx, dw, db, das, dbs = _backward(g, x, weight, lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_x,
                                     need_w, need_bias, need_ab)
    return (_empty_or(dx, g), _empty_or(dw, g), _empty_or(db, g), [_empty_or(d, g) for d in das],
            [_empty_or(d, g) for d in dbs])


@lora_linear_bwd.register_fake
def _(g, x, weight, lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_x, need_w, need_bias, need_ab):
    T, n_out = g.shape
    dx = g.new_empty((T, weight.shape[1])) if need_x else g.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_w else g.new_empty(0)
    db = weight.new_empty((n_out,)) if need_bias else g.new_empty(0)
    das = [a.new_empty(a.shape) if n else g.new_empty(0) for a, n in zip(lora_a, need_ab)]
    dbs = [b.new_empty(b.shape) if n else g.new_empty(0) for b, n in zip(lora_b, need_ab)]
    return dx, dw, db, das, dbs


def _needs(x, weight, bias, lora_a, lora_b):
    need_ab = [a.requires_grad or b.requires_grad for a, b in zip(lora_a, lora_b)]
    return x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad, need_ab


def _kept_x(need_w, dropout_p):
    """x itself is read by backward only for dW and for the dA of an adapter without dropout (kept for those
    even when frozen: double backward recomputes from it). With dropout on every adapter and a frozen base,
    the dropped inputs are kept instead and x is not."""
    return need_w or any(p == 0 for p in dropout_p)


def _reference_grads(x, weight, bias, lora_a, lora_b, scaling, dropout_p, needs, grads):
    """create_graph=True: the reference's differentiable ops (no dropout mask to replay: refused for p > 0)."""
    if any(p > 0 for p in dropout_p):
        _library.refuse_double_backward(f"{OP} with dropout_p > 0")
    n = len(lora_a)

    def fn(x, weight, bias, *ab):
        return reference.lora_linear(x, weight, bias, list(ab[:n]), list(ab[n:]), scaling)

    return _library.reference_grads(fn, (x, weight, bias, *lora_a, *lora_b), needs, grads)


def _setup(ctx, inputs, output):
    x, weight, bias, lora_a, lora_b, scaling, dropout_p = inputs
    _, xas, dropped, masks = output
    need_x, need_w, need_bias, need_ab = _needs(x, weight, bias, lora_a, lora_b)
    ctx.needs = (need_x, need_w, need_bias, need_ab)
    ctx.n, ctx.scaling, ctx.dropout_p, ctx.has_bias = len(lora_a), scaling, dropout_p, bias is not None
    kept = x if _kept_x(need_w, dropout_p) else x.new_empty(0)
    ctx.save_for_backward(kept, weight, bias, *lora_a, *lora_b, *xas, *dropped, *masks)


def _setup_op(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1], *output[2], *output[3])
    _setup(ctx, inputs, output)


def _op_backward(ctx, g, *_):
    x, weight, bias, *rest = ctx.saved_tensors
    n = ctx.n
    lora_a, lora_b, xas, dropped, masks = (rest[i * n:(i + 1) * n] for i in range(5))
    need_x, need_w, need_bias, need_ab = ctx.needs
    if g is None:
        return None, None, None, None, None, None, None
    if _library.double_backward():
        flat = [need_x, need_w, need_bias, *need_ab, *need_ab]
        gr = _reference_grads(x, weight, bias, lora_a, lora_b, ctx.scaling, ctx.dropout_p, flat, (g,))
        return gr[0], gr[1], gr[2], gr[3:3 + n], gr[3 + n:], None, None
    dx, dw, db, das, dbs = torch.ops.tigon.lora_linear_bwd(
        g, x, weight, list(lora_a), list(lora_b), list(xas), list(dropped), list(masks), ctx.scaling, ctx.dropout_p,
        need_x, need_w, need_bias, need_ab)
    return (dx if need_x else None, dw if need_w else None, db if need_bias else None,
            [d if k else None for d, k in zip(das, need_ab)], [d if k else None for d, k in zip(dbs, need_ab)],
            None, None)


lora_linear_fwd.register_autograd(_op_backward, setup_context=_setup_op)


class _LoRALinear(torch.autograd.Function):
    """Eager training: the same launchers as the custom op, without its dispatcher's host time."""

    @staticmethod
    def forward(ctx, x, weight, bias, scaling, dropout_p, n, *adapters):
        lora_a, lora_b = list(adapters[:n]), list(adapters[n:])
        out, xas, dropped, masks = _forward(x, weight, bias, lora_a, lora_b, scaling, dropout_p)
        _setup(ctx, (x, weight, bias, lora_a, lora_b, scaling, dropout_p), (out, xas, dropped, masks))
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, bias, *rest = ctx.saved_tensors
        n = ctx.n
        lora_a, lora_b, xas, dropped, masks = (rest[i * n:(i + 1) * n] for i in range(5))
        need_x, need_w, need_bias, need_ab = ctx.needs
        if _library.double_backward():
            flat = [need_x, need_w, need_bias, *need_ab, *need_ab]
            gr = _reference_grads(x, weight, bias, lora_a, lora_b, ctx.scaling, ctx.dropout_p, flat, (g,))
            return (gr[0], gr[1], gr[2], None, None, None, *gr[3:])
        dx, dw, db, das, dbs = _backward(g, x, weight, lora_a, lora_b, xas, dropped, masks, ctx.scaling,
                                         ctx.dropout_p, need_x, need_w, need_bias, need_ab)
        return (dx, dw, db, None, None, None, *das, *dbs)


def _traced(x, weight, bias, scaling, dropout_p, n, *adapters):
    return torch.ops.tigon.lora_linear_fwd(x, weight, bias, list(adapters[:n]), list(adapters[n:]), scaling,
                                           dropout_p)[0]


def _eager(x, weight, bias, scaling, dropout_p, n, *adapters):
    return _inference(x, weight, bias, list(adapters[:n]), list(adapters[n:]), scaling, dropout_p)


def _as_list(op, name, v, n, what):
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise ValueError(f"{op}: {name} has {len(v)} entries for {n} adapters")
        return list(v)
    if n != 1 and not isinstance(v, what):
        raise TypeError(f"{op}: {name} must be one value or a sequence of {n}, got {type(v).__name__}")
    return [v] * n


def _validate_adapters(op, x, n_out, lora_a, lora_b, scaling, dropout_p):
    """The adapter arguments of lora_linear and lora_add: ([A], [B], [scaling], [dropout p]), or a clear error."""
    n_in = x.shape[-1]
    as_, bs = (list(v) if isinstance(v, (list, tuple)) else [v] for v in (lora_a, lora_b))
    if len(as_) != len(bs):
        raise ValueError(f"{op}: lora_a has {len(as_)} adapters but lora_b has {len(bs)}")
    for i, (a, b) in enumerate(zip(as_, bs)):
        tag = f"[{i}]" if len(as_) > 1 else ""
        _launch.check_tensor(op, f"lora_a{tag}", a)
        _launch.check_tensor(op, f"lora_b{tag}", b)
        if a.dim() != 2 or a.shape[1] != n_in or a.shape[0] < 1:
            raise ValueError(f"{op}: lora_a{tag} must be 2-D [r, {n_in}] with r >= 1, got {tuple(a.shape)}")
        if b.dim() != 2 or tuple(b.shape) != (n_out, a.shape[0]):
            raise ValueError(f"{op}: lora_b{tag} must be [{n_out}, {a.shape[0]}] (out, r), got {tuple(b.shape)}")
        _launch.check_same_device(op, "x", x, **{f"lora_a{tag}": a, f"lora_b{tag}": b})
    n = len(as_)
    scales = [_launch.check_number(op, "scaling", s) for s in _as_list(op, "scaling", scaling, n, numbers.Real)]
    ps = [_launch.check_number(op, "dropout_p", p, 0.0, 1.0)
          for p in _as_list(op, "dropout_p", dropout_p, n, numbers.Real)]
    if any(p >= 1 for p in ps):
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p!r}")
    return as_, bs, scales, ps


def _validate(x, weight, bias, lora_a, lora_b, scaling, dropout_p):
    _launch.check_tensor(OP, "x", x)
    _launch.check_min_dim(OP, "x", x)
    _launch.check_tensor(OP, "weight", weight)
    n_in = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != n_in:
        raise ValueError(f"{OP}: weight must be 2-D [out, {n_in}], got shape {tuple(weight.shape)}")
    n_out = weight.shape[0]
    _launch.check_same_dtype(OP, "x", x, weight=weight)
    _launch.check_same_device(OP, "x", x, weight=weight, bias=bias)
    if bias is not None:
        _launch.check_tensor(OP, "bias", bias)
        _launch.check_shape(OP, "bias", bias, (n_out,))
        _launch.check_same_dtype(OP, "x", x, bias=bias)
    return _validate_adapters(OP, x, n_out, lora_a, lora_b, scaling, dropout_p)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                lora_a: Union[torch.Tensor, Sequence[torch.Tensor]],
                lora_b: Union[torch.Tensor, Sequence[torch.Tensor]],
                scaling: Union[float, Sequence[float]], dropout_p: Union[float, Sequence[float]] = 0.0) -> torch.Tensor:
    """x W^T + bias + sum_i scaling_i * dropout(x, dropout_p_i) lora_a_i^T lora_b_i^T: PEFT's lora.Linear forward.

    x [..., in]; weight [out, in] and bias [out] (or None) in x's dtype; lora_a [r, in] and lora_b [out, r], one
    pair or a sequence of pairs (several active adapters, each its own rank), any float dtype (cast to x's for the
    GEMMs; their gradients come back in their own dtype, fp32 accumulated); scaling and dropout_p one number or
    one per adapter (dropout_p in [0, 1), applied as given: pass 0 in eval). Under autocast the GEMMs run in the
    autocast dtype (x and weight cast as F.linear would). Returns [..., out] in x's dtype. A frozen weight
    (requires_grad False) gets no dW GEMM. Double backward only without dropout."""
    dev = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        x, weight = x.to(dt), weight.to(dt) if isinstance(weight, torch.Tensor) else weight
        bias = bias.to(dt) if isinstance(bias, torch.Tensor) else bias
    lora_a, lora_b, scaling, dropout_p = _validate(x, weight, bias, lora_a, lora_b, scaling, dropout_p)
    lead = x.shape[:-1]
    if not _library.use_kernels("lora_linear", x):
        return reference.lora_linear(x, weight, bias, lora_a, lora_b, scaling, dropout_p)
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    with torch.autocast(dev, enabled=False):
        out = _library.dispatch(_traced, _LoRALinear, _eager, x2, weight, bias, scaling, dropout_p, len(lora_a),
                                *lora_a, *lora_b, grad_from=(x2, weight, bias, *lora_a, *lora_b))
    return out.view(*lead, weight.shape[0])


# lora_add: the adapters alone, added into a base output the caller computed (PEFT's bitsandbytes layers: the base
# GEMM dequantizes a 4-bit or 8-bit weight, so there is no dense weight for lora_linear's base GEMM).

ADD_OP = "tigon.ops.lora_add"


def _add_forward(base_out, x, lora_a, lora_b, scaling, dropout_p):
    """(a new out [T, out], xas, dropped, masks): base_out is read by the first adapter's GEMM, never written."""
    out, xas, dropped, masks = _adapters(x, lora_a, lora_b, scaling, dropout_p, base_out)
    return (base_out.clone() if out is None else out), xas, dropped, masks


def _saved_fakes(x, lora_a, dropout_p):
    T = x.shape[0]
    xas = [x.new_empty((T, a.shape[0])) for a in lora_a]
    dropped = [x.new_empty(x.shape if p > 0 else (0,)) for p in dropout_p]
    masks = [x.new_empty(x.shape if p > 0 else (0,), dtype=torch.bool) for p in dropout_p]
    return xas, dropped, masks


@torch.library.custom_op("tigon::lora_add_fwd", mutates_args=())
def lora_add_fwd(base_out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                 scaling: list[float], dropout_p: list[float]
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """base_out [T, out], x [T, in] -> (a new out [T, out], xa_i, dropped x_i, mask_i) as lora_linear_fwd."""
    return _add_forward(base_out, x, lora_a, lora_b, scaling, dropout_p)


@lora_add_fwd.register_fake
def _(base_out, x, lora_a, lora_b, scaling, dropout_p):
    return (base_out.new_empty(base_out.shape), *_saved_fakes(x, lora_a, dropout_p))


@torch.library.custom_op("tigon::lora_add_bwd", mutates_args=())
def lora_add_bwd(g: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                 xas: list[torch.Tensor], dropped: list[torch.Tensor], masks: list[torch.Tensor], scaling: list[float],
                 dropout_p: list[float], need_x: bool, need_ab: list[bool]
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The adapters' gradients (dx, dA_i, dB_i), each empty where not asked; base_out's is g itself."""
    dx, das, dbs = _adapter_backward(g, x, lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_x, need_ab)
    return _empty_or(dx, g), [_empty_or(d, g) for d in das], [_empty_or(d, g) for d in dbs]


@lora_add_bwd.register_fake
def _(g, x, lora_a, lora_b, xas, dropped, masks, scaling, dropout_p, need_x, need_ab):
    dx = g.new_empty((g.shape[0], lora_a[0].shape[1])) if need_x and lora_a else g.new_empty(0)
    das = [a.new_empty(a.shape) if n else g.new_empty(0) for a, n in zip(lora_a, need_ab)]
    dbs = [b.new_empty(b.shape) if n else g.new_empty(0) for b, n in zip(lora_b, need_ab)]
    return dx, das, dbs


def _add_setup(ctx, inputs, output):
    base_out, x, lora_a, lora_b, scaling, dropout_p = inputs
    _, xas, dropped, masks = output
    need_ab = [a.requires_grad or b.requires_grad for a, b in zip(lora_a, lora_b)]
    ctx.needs = (base_out.requires_grad, x.requires_grad, need_ab)
    ctx.n, ctx.scaling, ctx.dropout_p = len(lora_a), scaling, dropout_p
    kept = x if _kept_x(False, dropout_p) else x.new_empty(0)  # x: for dA without dropout (and double backward)
    ctx.save_for_backward(kept, *lora_a, *lora_b, *xas, *dropped, *masks)


def _add_saved(ctx):
    x, *rest = ctx.saved_tensors
    n = ctx.n
    return (x, *(list(rest[i * n:(i + 1) * n]) for i in range(5)))


def _add_grads(ctx, g, op_path):
    """(d base_out, dx, [dA], [dB]) for upstream g; op_path: through the lora_add_bwd custom op."""
    x, lora_a, lora_b, xas, dropped, masks = _add_saved(ctx)
    need_base, need_x, need_ab = ctx.needs
    if _library.double_backward():
        if any(p > 0 for p in ctx.dropout_p):
            _library.refuse_double_backward(f"{ADD_OP} with dropout_p > 0")
        n = ctx.n

        def delta(x, *ab):  # the adapters' sum alone: base_out's gradient is g, whatever its value
            return reference.lora_add(torch.zeros((), dtype=x.dtype, device=x.device), x, list(ab[:n]),
                                      list(ab[n:]), ctx.scaling)

        gr = _library.reference_grads(delta, (x, *lora_a, *lora_b), [need_x, *need_ab, *need_ab], (g,))
        return g if need_base else None, gr[0], gr[1:1 + n], gr[1 + n:]
    if op_path:
        dx, das, dbs = torch.ops.tigon.lora_add_bwd(g, x, lora_a, lora_b, xas, dropped, masks, ctx.scaling,
                                                    ctx.dropout_p, need_x, need_ab)
    else:
        dx, das, dbs = _adapter_backward(g, x, lora_a, lora_b, xas, dropped, masks, ctx.scaling, ctx.dropout_p,
                                         need_x, need_ab)
    return (g if need_base else None, dx if need_x else None, [d if k else None for d, k in zip(das, need_ab)],
            [d if k else None for d, k in zip(dbs, need_ab)])


def _add_setup_op(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[1], *output[2], *output[3])
    _add_setup(ctx, inputs, output)


def _add_op_backward(ctx, g, *_):
    if g is None:
        return None, None, None, None, None, None
    return (*_add_grads(ctx, g, True), None, None)


lora_add_fwd.register_autograd(_add_op_backward, setup_context=_add_setup_op)


class _LoRAAdd(torch.autograd.Function):
    """Eager training: the same launchers as the custom op, without its dispatcher's host time."""

    @staticmethod
    def forward(ctx, base_out, x, scaling, dropout_p, n, *adapters):
        lora_a, lora_b = list(adapters[:n]), list(adapters[n:])
        out, xas, dropped, masks = _add_forward(base_out, x, lora_a, lora_b, scaling, dropout_p)
        _add_setup(ctx, (base_out, x, lora_a, lora_b, scaling, dropout_p), (out, xas, dropped, masks))
        return out

    @staticmethod
    def backward(ctx, g):
        d_base, dx, das, dbs = _add_grads(ctx, g, False)
        return (d_base, dx, None, None, None, *das, *dbs)


def _add_traced(base_out, x, scaling, dropout_p, n, *adapters):
    return torch.ops.tigon.lora_add_fwd(base_out, x, list(adapters[:n]), list(adapters[n:]), scaling, dropout_p)[0]


def _add_eager(base_out, x, scaling, dropout_p, n, *adapters):
    return _add_forward(base_out, x, list(adapters[:n]), list(adapters[n:]), scaling, dropout_p)[0]


def lora_add(base_out: torch.Tensor, x: torch.Tensor, lora_a: Union[torch.Tensor, Sequence[torch.Tensor]],
             lora_b: Union[torch.Tensor, Sequence[torch.Tensor]], scaling: Union[float, Sequence[float]],
             dropout_p: Union[float, Sequence[float]] = 0.0) -> torch.Tensor:
    """base_out + sum_i scaling_i * dropout(x, dropout_p_i) lora_a_i^T lora_b_i^T: the adapter half of PEFT's LoRA
    forward, for a base layer whose output the caller computed (bitsandbytes' 4-bit and 8-bit layers).

    base_out [..., out] and x [..., in], the same leading shape and float dtype; lora_a, lora_b, scaling and
    dropout_p as lora_linear's (one or more adapters; at least one). Returns a new [..., out] tensor in x's dtype;
    base_out is not written. The adapter GEMMs run in x's dtype with fp32 accumulation, autocast or not (the sum
    keeps base_out's dtype). Gradients: base_out's is the upstream gradient itself; x gets the adapters' part only
    (the base layer's autograd adds its own). Double backward only without dropout."""
    _launch.check_tensor(ADD_OP, "base_out", base_out)
    _launch.check_tensor(ADD_OP, "x", x)
    _launch.check_min_dim(ADD_OP, "x", x)
    if base_out.dim() != x.dim() or base_out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{ADD_OP}: base_out must be [{', '.join(map(str, x.shape[:-1]))}, out] (x's leading "
                         f"shape), got {tuple(base_out.shape)}")
    _launch.check_same_dtype(ADD_OP, "x", x, base_out=base_out)
    _launch.check_same_device(ADD_OP, "x", x, base_out=base_out)
    n_out = base_out.shape[-1]
    lora_a, lora_b, scaling, dropout_p = _validate_adapters(ADD_OP, x, n_out, lora_a, lora_b, scaling, dropout_p)
    if not lora_a:
        raise ValueError(f"{ADD_OP}: needs at least one adapter (lora_a and lora_b are empty)")
    lead, dev = x.shape[:-1], x.device.type
    with torch.autocast(dev, enabled=False):
        if not _library.use_kernels("lora_add", x):
            return reference.lora_add(base_out, x, lora_a, lora_b, scaling, dropout_p)
        T = math.prod(lead)
        x2, b2 = x.reshape(T, x.shape[-1]), base_out.reshape(T, n_out)
        out = _library.dispatch(_add_traced, _LoRAAdd, _add_eager, b2, x2, scaling, dropout_p, len(lora_a),
                                *lora_a, *lora_b, grad_from=(b2, x2, *lora_a, *lora_b))
    return out.view(*lead, n_out)
