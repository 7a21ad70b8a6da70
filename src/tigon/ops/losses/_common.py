"""Validation and autograd glue shared by the fused-linear losses."""

import torch

from .. import _launch, _library

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_head(op, hidden, weight, bias, hidden_name="hidden", weight_name="weight", bias_name="bias",
               hidden_dim=2):
    """hidden [..., H] with hidden_dim dims, weight [V, H], bias [V] or None: one float dtype, one device."""
    _launch.check_tensor(op, hidden_name, hidden)
    _launch.check_tensor(op, weight_name, weight)
    if hidden.dim() != hidden_dim:
        raise ValueError(f"{op}: {hidden_name} must have {hidden_dim} dimensions, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{op}: {weight_name} must have shape (V, {hidden.shape[-1]}) with V >= 1, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        _launch.check_tensor(op, bias_name, bias)
        _launch.check_shape(op, bias_name, bias, (weight.shape[0],))
    _launch.check_same_device(op, hidden_name, hidden, **{weight_name: weight, bias_name: bias})
    _launch.check_same_dtype(op, hidden_name, hidden, **{weight_name: weight, bias_name: bias})


def check_ids(op, name, t, shape, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT_DTYPES:
        raise TypeError(f"{op}: {name} must be an integer tensor, got {t.dtype}")
    _launch.check_shape(op, name, t, shape)
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but hidden is on {device}")


def check_float_tensor(op, name, t, shape, device, optional=True):
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating-point torch.Tensor, got "
                        f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but hidden is on {device}")
    return t.detach()


def check_choice(op, name, v, choices):
    if not isinstance(v, str) or v not in choices:
        raise ValueError(f"{op}: {name} must be one of {sorted(choices)}, got {v!r}")
    return v


def check_int(op, name, v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    return v


def needs(t):
    return torch.is_grad_enabled() and t is not None and t.requires_grad


def setup_saved_grads(ctx, inputs, output):
    """The setup of the ops whose last 3 outputs are (dh, dW, db) for grad_output 1: it keeps those alone."""
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[-3:])
    ctx.n_inputs = len(inputs)


def backward_saved_grads(op_name, grad_slots):
    """Backward: scale the saved (dh, dW, db) by grad_output; grad_slots: their input positions."""

    def backward(ctx, dloss, *_):
        _library.refuse_double_backward(op_name)
        grads = [None] * ctx.n_inputs
        if dloss is None:
            return tuple(grads)
        for slot, g in zip(grad_slots, ctx.saved_tensors):
            if ctx.needs_input_grad[slot] and g.numel():
                grads[slot] = g * dloss.to(g.dtype) if g.dtype != torch.float64 else g * dloss
        return tuple(grads)

    return backward


def check_id_range(op, name, t, V, ignore_index=None):
    """ValueError for an id outside [0, V) that is not ignore_index. It reads the ids (a host sync), so only on
    CPU tensors or with TIGON_VALIDATE=1; elsewhere such a token counts as having no target (log-prob 0)."""
    if not (t.device.type == "cpu" or _library.validation_on()) or _library.tracing():
        return
    bad = (t < 0) | (t >= V)
    if ignore_index is not None:
        bad &= t != ignore_index
    if bool(bad.any()):
        v = int(t[bad][0])
        allowed = "" if ignore_index is None else f" or ignore_index={ignore_index}"
        raise ValueError(f"{op}: {name} must be in [0, {V}){allowed}; got {v}")
