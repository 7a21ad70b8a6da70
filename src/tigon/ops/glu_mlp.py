"""The whole gated MLP, down(act(x W_g^T) * (x W_u^T)) W_d^T, as one autograd node that keeps less.

Autograd over three nn.Linear calls and the GLU op keeps four [tokens, *] tensors per layer: x, gate, up and
the activation product h = act(gate) * up that down_proj saved. This node keeps x, gate and up only. Its
backward computes dh = dy W_d first, then one Triton pass (`tigon::glu_bwd_recompute`) reads dh, gate and up
and writes dgate over gate, dup over up and the recomputed h over dh, so the down projection's weight
gradient dW_d = dy^T h reads h from memory the backward already held: a quarter of the MLP's saved
activations (16 layers x 256 MiB at the 1.5B Llama's [16384, 8192]) for one more store per element. A traced
graph runs the same pass as a functional op (`tigon::glu_bwd_and_y`), never a second glu_fwd, which a compiler
would merge with the forward's and keep.

x @ W^T runs in cuBLAS. The weights are taken as they are (dtype of x; under autocast the caller casts),
and `gate_weight` may be packed [2I, H] = [gate; up] (Phi3's gate_up_proj) with `up_weight` None.
"""

import math
from typing import Optional

import torch

from . import _launch, _library, reference
from .swiglu import _GELU_TANH, _SILU, GLU, GLU_BWD_AND_Y, GLU_BWD_RECOMPUTE

_ACTS = {"swiglu_mlp": _SILU, "geglu_mlp": _GELU_TANH}
_REFERENCE = {_SILU: reference.swiglu_mlp, _GELU_TANH: reference.geglu_mlp}


def _flat(x):
    # explicit row count: reshape(-1, 0) is ambiguous for a zero-width x
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _project(x2, gate_weight, up_weight):
    """(gate, up) by cuBLAS; packed: (gate_up [tokens, 2I], None)."""
    if up_weight is None:
        return x2 @ gate_weight.t(), None
    return x2 @ gate_weight.t(), x2 @ up_weight.t()


def _glu(gate, up, act):
    return GLU(gate, up, act, False)


def _down(h, down_weight, x):
    """h [tokens, I] @ down_weight^T in x's leading shape, as a tensor of its own, not a view: matmul folds the
    leading dims into one mm and returns its result reshaped in place (`_unsafe_view`), so callers may write into
    it (Llama-4's shared expert does `out.add_(...)`), which autograd forbids on a view made inside a Function.
    Same GEMM, same bits, no copy."""
    return torch.matmul(h.view(*x.shape[:-1], h.shape[-1]), down_weight.t())


def _mlp(x, gate_weight, up_weight, down_weight, act):
    """Inference: the same products as _GLUMLP's forward, nothing kept."""
    return _down(_glu(*_project(_flat(x), gate_weight, up_weight), act), down_weight, x)


def _recompute_traced(dh, gate, up, act):
    """The backward's GLU pass for torch.compile: the same one pass as a functional op (no buffer reuse)."""
    h, dgate, dup = GLU_BWD_AND_Y.op(dh, gate, up, act)
    return h, dgate, dup, (dgate if up is None else None)


def _recompute_in_place(dh, gate, up, act):
    """Eager: one pass writes dgate over gate, dup over up and h over dh. Returns (h, dgate, dup, dgate_up)."""
    GLU_BWD_RECOMPUTE.eager(dh, gate, up, act)
    return dh, gate, up, gate


class _GLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, act):
        x2 = _flat(x)
        gate, up = _project(x2, gate_weight, up_weight)
        h = _glu(gate, up, act)
        y = _down(h, down_weight, x)
        del h  # not saved: the backward recomputes it in the gradient pass
        # x itself, not the view x2 made here: a saved input keeps its graph, which double backward needs
        ctx.save_for_backward(x, gate, up, gate_weight, up_weight, down_weight)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, up, gate_weight, up_weight, down_weight = ctx.saved_tensors
        if _library.double_backward():
            # create_graph=True: the reference's differentiable ops on the saved inputs, for double backward
            grads = _library.reference_grads(_REFERENCE[ctx.act], (x, gate_weight, up_weight, down_weight),
                                             ctx.needs_input_grad[:4], (dy,))
            return (*grads, None)
        x2 = _flat(x)
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        dy2 = _flat(dy)
        dh = dy2 @ down_weight  # [tokens, I], fresh and contiguous: the pass below overwrites it with h
        h, dgate, dup, dgate_up = _library.dispatch(_recompute_traced, None, _recompute_in_place, dh, gate, up,
                                                    ctx.act)
        d_down = dy2.t() @ h if need_d else None
        dx = d_gate_w = d_up_w = None
        if up_weight is None:  # packed: one [tokens, 2I] gradient for the one [2I, H] weight
            if need_x:
                dx = dgate_up @ gate_weight
            if need_g:
                d_gate_w = dgate_up.t() @ x2
        else:
            if need_x:
                dx = torch.addmm(dgate @ gate_weight, dup, up_weight)
            if need_g:
                d_gate_w = dgate.t() @ x2
            if need_u:
                d_up_w = dup.t() @ x2
        if dx is not None:
            dx = dx.view(x.shape)
        return dx, d_gate_w, d_up_w, d_down, None


def _check_weight(op, name, w, dtype, device, shape=None):
    _launch.check_tensor(op, name, w)
    if w.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [out, in], got shape {tuple(w.shape)}")
    if shape is not None and tuple(w.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(w.shape)}")
    if w.dtype != dtype:
        raise TypeError(f"{op}: {name} dtype {w.dtype} differs from x's {dtype}")
    if w.device != device:
        raise ValueError(f"{op}: {name} is on {w.device}, x on {device}")


def _validate(op, x, gate_weight, up_weight, down_weight):
    _launch.check_tensor(op, "x", x)
    _launch.check_min_dim(op, "x", x)
    H = x.shape[-1]
    _check_weight(op, "gate_weight", gate_weight, x.dtype, x.device)
    if gate_weight.shape[1] != H:
        raise ValueError(f"{op}: gate_weight must be [I, {H}] (or packed [2I, {H}]), got {tuple(gate_weight.shape)}")
    if up_weight is None:
        if gate_weight.shape[0] % 2:
            raise ValueError(f"{op}: a packed gate_weight [2I, H] needs an even first dimension, got "
                             f"{gate_weight.shape[0]}")
        inter = gate_weight.shape[0] // 2
    else:
        inter = gate_weight.shape[0]
        _check_weight(op, "up_weight", up_weight, x.dtype, x.device, gate_weight.shape)
    _check_weight(op, "down_weight", down_weight, x.dtype, x.device)
    if down_weight.shape[1] != inter:
        raise ValueError(f"{op}: down_weight must be [out, {inter}], got {tuple(down_weight.shape)}")


def _glu_mlp(op, x, gate_weight, up_weight, down_weight):
    _validate(f"tigon.ops.{op}", x, gate_weight, up_weight, down_weight)
    if not _library.use_kernels(op, x):
        return getattr(reference, op)(x, gate_weight, up_weight, down_weight)
    # torch.compile traces the Function itself (cuBLAS GEMMs around the GLU custom ops)
    return _library.dispatch(_GLUMLP.apply, _GLUMLP, _mlp, x, gate_weight, up_weight, down_weight, _ACTS[op],
                             grad_from=(x, gate_weight, up_weight, down_weight))


def swiglu_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: Optional[torch.Tensor],
               down_weight: torch.Tensor) -> torch.Tensor:
    """(silu(x gate_weight^T) * (x up_weight^T)) down_weight^T, LlamaMLP without biases. x [..., H];
    gate_weight, up_weight [I, H] (or gate_weight packed [2I, H] = [gate; up] and up_weight None);
    down_weight [H_out, I]; all one dtype and device. Keeps x, gate and up for backward, not the product."""
    return _glu_mlp("swiglu_mlp", x, gate_weight, up_weight, down_weight)


def geglu_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: Optional[torch.Tensor],
              down_weight: torch.Tensor) -> torch.Tensor:
    """swiglu_mlp with gelu_tanh (GemmaMLP)."""
    return _glu_mlp("geglu_mlp", x, gate_weight, up_weight, down_weight)
