"""Bad and edge-case input over the training ops, on both execution paths.

Every case runs twice: on the Triton kernels (CUDA, or the interpreter on CPU) and on the PyTorch reference
(CPU with the interpreter routed off, as a machine without TRITON_INTERPRET runs it). Refused input raises
the same ValueError/TypeError on both, naming the function and the argument; accepted input gives what
PyTorch gives.
"""

import re
import sys

import pytest
import torch
import torch.nn.functional as F

from tigon import ops
from tigon.ops import _launch, _library, reference
from tigon.ops.swiglu import swiglu_packed

ce_mod = sys.modules["tigon.ops.cross_entropy"]  # tigon.ops.cross_entropy is the function


@pytest.fixture(params=["kernel", "reference"])
def path(request, device, monkeypatch):
    """(device, expected dispatch path) for each execution path."""
    if request.param == "reference":
        monkeypatch.setattr(_library, "interpreter_on", lambda: False)
        return torch.device("cpu"), "reference"
    return device, "triton"


def _raises(exc, op, arg, call):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"tigon.ops.{op}: "), msg
    assert re.search(arg, msg), msg


def _ones(d, *shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype, device=d)


def _randn(d, *shape, dtype=torch.float32, requires_grad=False):
    return torch.randn(shape, dtype=dtype, device=d).requires_grad_(requires_grad)


def _long(d, *values):
    return torch.tensor(values, dtype=torch.long, device=d)


def _rope(d, **kw):
    q, k, c, s = _randn(d, 2, 3, 4, 8), _randn(d, 2, 1, 4, 8), _randn(d, 1, 4, 8), _randn(d, 1, 4, 8)
    return lambda: ops.apply_rope(q, k, c, s, **kw)


def _ce(d, logits=None, target=None, **kw):
    logits = _randn(d, 4, 7) if logits is None else logits
    target = _long(d, 1, 2, 3, 6) if target is None else target
    return lambda: ops.cross_entropy(logits, target, **kw)


def _lce(d, hidden=None, weight=None, target=None, **kw):
    hidden = _randn(d, 4, 5) if hidden is None else hidden
    weight = _randn(d, 7, 5) if weight is None else weight
    target = _long(d, 1, 2, 3, 6) if target is None else target
    return lambda: ops.linear_cross_entropy(hidden, weight, target, **kw)


def _mlp(d, op="swiglu_mlp", x=None, gw=None, uw=0, dw=None):
    x = _randn(d, 3, 4) if x is None else x
    gw = _randn(d, 6, 4) if gw is None else gw
    uw = _randn(d, 6, 4) if isinstance(uw, int) else uw
    dw = _randn(d, 4, 6) if dw is None else dw
    return lambda: getattr(ops, op)(x, gw, uw, dw)


def _adamw8bit(d, param=None, grad=None, edit=None, **kw):
    param = _randn(d, 300) if param is None else param
    grad = torch.zeros_like(param) if grad is None else grad
    state = list(ops.new_moments(param))
    if edit is not None:
        edit(state)
    return lambda: ops.adamw8bit_step_(param, grad, *state, **dict(dict(lr=0.1, step=1), **kw))


# (name, exception, function, argument pattern, call(device) -> thunk)
REFUSED = [
    ("rms_0d", ValueError, "rms_norm", "x must have at least 1 dimension",
     lambda d: lambda: ops.rms_norm(torch.tensor(1.0, device=d), _ones(d, 1))),
    ("rms_0d_no_weight", ValueError, "rms_norm", "x must have", lambda d: lambda: ops.rms_norm(_ones(d), None)),
    ("rms_x_list", TypeError, "rms_norm", "x must be a torch.Tensor", lambda d: lambda: ops.rms_norm([1.0], None)),
    ("rms_x_int", TypeError, "rms_norm", "x must be float",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4, dtype=torch.long), None)),
    ("rms_weight_shape", ValueError, "rms_norm", "weight must have shape",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), _ones(d, 1, 4))),
    ("rms_weight_int", TypeError, "rms_norm", "weight must be float",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), _ones(d, 4, dtype=torch.int32))),
    ("rms_weight_device", ValueError, "rms_norm", "weight is on meta",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), _ones("meta", 4))),
    ("rms_eps_negative", ValueError, "rms_norm", "eps", lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), None, -1e-6)),
    ("rms_eps_tensor", ValueError, "rms_norm", "eps",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), None, torch.tensor(1e-6))),
    ("rms_offset_str", TypeError, "rms_norm", "offset",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), _ones(d, 4), offset="1")),
    ("rms_offset_tensor", TypeError, "rms_norm", "offset",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), _ones(d, 4), offset=torch.tensor(1.0))),
    ("rms_offset_nan", ValueError, "rms_norm", "offset",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), _ones(d, 4), offset=float("nan"))),
    ("rms_casting_mode", ValueError, "rms_norm", "casting_mode",
     lambda d: lambda: ops.rms_norm(_ones(d, 2, 4), None, casting_mode="llama3")),
    ("add_rms_residual_none", TypeError, "add_rms_norm", "residual must be a torch.Tensor",
     lambda d: lambda: ops.add_rms_norm(_ones(d, 2, 4), None, None)),
    ("add_rms_0d", ValueError, "add_rms_norm", "x must have",
     lambda d: lambda: ops.add_rms_norm(_ones(d), _ones(d), None)),
    ("add_rms_residual_shape", ValueError, "add_rms_norm", "residual must have shape",
     lambda d: lambda: ops.add_rms_norm(_ones(d, 2, 4), _ones(d, 1, 4), None)),
    ("add_rms_residual_dtype", TypeError, "add_rms_norm", "residual has dtype",
     lambda d: lambda: ops.add_rms_norm(_ones(d, 2, 4), _ones(d, 2, 4, dtype=torch.half), None)),
    ("add_rms_offset", TypeError, "add_rms_norm", "offset",
     lambda d: lambda: ops.add_rms_norm(_ones(d, 2, 4), _ones(d, 2, 4), None, offset=None)),
    ("ln_0d", ValueError, "layer_norm", "x must have", lambda d: lambda: ops.layer_norm(_ones(d), None, None)),
    ("ln_eps_negative", ValueError, "layer_norm", "eps",
     lambda d: lambda: ops.layer_norm(_ones(d, 2, 4), None, None, -1.0)),
    ("ln_bias_shape", ValueError, "layer_norm", "bias must have shape",
     lambda d: lambda: ops.layer_norm(_ones(d, 2, 4), None, _ones(d, 5))),
    ("rope_unsqueeze_bool", ValueError, "apply_rope", "unsqueeze_dim", lambda d: _rope(d, unsqueeze_dim=True)),
    ("rope_q_3d", ValueError, "apply_rope", "q must be 4-D",
     lambda d: lambda: ops.apply_rope(_ones(d, 3, 4, 8), _ones(d, 2, 1, 4, 8), _ones(d, 1, 4, 8),
                                      _ones(d, 1, 4, 8))),
    ("rope_rotary_odd", ValueError, "apply_rope", "rotary_dim 3",
     lambda d: lambda: ops.apply_rope(_ones(d, 2, 3, 4, 8), _ones(d, 2, 1, 4, 8), _ones(d, 1, 4, 3),
                                      _ones(d, 1, 4, 3))),
    ("swiglu_shape", ValueError, "swiglu", "up must have shape",
     lambda d: lambda: ops.swiglu(_ones(d, 2, 3), _ones(d, 3))),
    ("swiglu_0d_vs_1d", ValueError, "swiglu", "up must have shape",
     lambda d: lambda: ops.swiglu(_ones(d), _ones(d, 1))),
    ("geglu_int", TypeError, "geglu", "gate must be float",
     lambda d: lambda: ops.geglu(_ones(d, 2, dtype=torch.int32), _ones(d, 2, dtype=torch.int32))),
    ("geglu_inplace_str", TypeError, "geglu", "inplace_backward",
     lambda d: lambda: ops.geglu(_ones(d, 2), _ones(d, 2), inplace_backward="yes")),
    ("swiglu_packed_odd", ValueError, "swiglu", "gate_up", lambda d: lambda: swiglu_packed(_ones(d, 2, 5))),
    ("mlp_0d", ValueError, "swiglu_mlp", "x must have", lambda d: _mlp(d, x=_ones(d))),
    ("mlp_weight_dtype", TypeError, "geglu_mlp", "up_weight dtype",
     lambda d: _mlp(d, "geglu_mlp", uw=_ones(d, 6, 4, dtype=torch.half))),
    ("mlp_packed_odd", ValueError, "swiglu_mlp", "even first dimension",
     lambda d: _mlp(d, gw=_ones(d, 5, 4), uw=None, dw=_ones(d, 4, 2))),
    ("ce_0d", ValueError, "cross_entropy", "logits must be", lambda d: _ce(d, torch.tensor(1.0, device=d),
                                                                          torch.tensor(0, device=d))),
    ("ce_inplace_str", TypeError, "cross_entropy", "inplace_backward", lambda d: _ce(d, inplace_backward="yes")),
    ("ce_ignore_index_float", TypeError, "cross_entropy", "ignore_index", lambda d: _ce(d, ignore_index=2.0)),
    ("ce_ignore_index_huge", ValueError, "cross_entropy", "ignore_index must fit in int64",
     lambda d: _ce(d, ignore_index=2**70)),
    ("ce_label_smoothing_negative", ValueError, "cross_entropy", "label_smoothing",
     lambda d: _ce(d, label_smoothing=-0.1)),
    ("ce_label_smoothing_over_1", ValueError, "cross_entropy", "label_smoothing",
     lambda d: _ce(d, label_smoothing=1.1)),
    ("ce_label_smoothing_tensor", TypeError, "cross_entropy", "label_smoothing",
     lambda d: _ce(d, label_smoothing=torch.tensor(0.1))),
    ("ce_z_loss_negative", ValueError, "cross_entropy", "z_loss_scale", lambda d: _ce(d, z_loss_scale=-1e-4)),
    ("ce_softcap_zero", ValueError, "cross_entropy", "softcap", lambda d: _ce(d, softcap=0.0)),
    ("ce_reduction_none_object", ValueError, "cross_entropy", "reduction", lambda d: _ce(d, reduction=None)),
    ("ce_num_items_device", ValueError, "cross_entropy", "num_items_in_batch is on meta",
     lambda d: _ce(d, num_items_in_batch=torch.tensor(3.0, device="meta"))),
    ("ce_num_items_shape", TypeError, "cross_entropy", "num_items_in_batch",
     lambda d: _ce(d, num_items_in_batch=torch.tensor([2, 3]))),
    ("ce_target_float", TypeError, "cross_entropy", "target must be an integer",
     lambda d: _ce(d, target=torch.ones(4, device=d))),
    ("lce_0d", ValueError, "linear_cross_entropy", "hidden must have",
     lambda d: _lce(d, hidden=torch.tensor(1.0, device=d), target=torch.tensor(1, device=d))),
    ("lce_weight_1d", ValueError, "linear_cross_entropy", "weight must have shape",
     lambda d: _lce(d, weight=_ones(d, 5))),
    ("lce_ignore_index_huge", ValueError, "linear_cross_entropy", "ignore_index",
     lambda d: _lce(d, ignore_index=-(2**64))),
    ("lce_num_items_device", ValueError, "linear_cross_entropy", "num_items_in_batch is on meta",
     lambda d: _lce(d, num_items_in_batch=torch.tensor(3, device="meta"))),
    ("lce_z_loss_nan", ValueError, "linear_cross_entropy", "z_loss_scale",
     lambda d: _lce(d, z_loss_scale=float("nan"))),
    ("adamw8bit_noncontiguous", ValueError, "adamw8bit_step_", "param must be a dense contiguous tensor",
     lambda d: _adamw8bit(d, _randn(d, 300, 2)[:, 0])),
    ("adamw8bit_grad_shape", ValueError, "adamw8bit_step_", "grad has shape",
     lambda d: _adamw8bit(d, grad=_randn(d, 3, 100))),
    ("adamw8bit_codes_dtype", TypeError, "adamw8bit_step_", "m_codes must be torch.uint8",
     lambda d: _adamw8bit(d, edit=lambda s: s.__setitem__(0, s[0].float()))),
    ("adamw8bit_scales_size", ValueError, "adamw8bit_step_", r"v_scales must be a contiguous 1-D tensor .*\(2,\)",
     lambda d: _adamw8bit(d, edit=lambda s: s.__setitem__(3, s[3][:1]))),
    ("adamw8bit_no_norm", ValueError, "adamw8bit_step_", "max_grad_norm needs norm",
     lambda d: _adamw8bit(d, max_grad_norm=1.0)),
    ("adamw8bit_step0", ValueError, "adamw8bit_step_", "step must be an int >= 1", lambda d: _adamw8bit(d, step=0)),
    ("adamw8bit_lr_tensor", TypeError, "adamw8bit_step_", "lr must be a Python number",
     lambda d: _adamw8bit(d, lr=torch.tensor(0.1))),
    ("quantize_moments_shape", ValueError, "quantize_moments", "exp_avg_sq has shape",
     lambda d: lambda: ops.quantize_moments(_ones(d, 4), _ones(d, 2, 2))),
    ("dequantize_moments_numel", ValueError, "dequantize_moments", "m_codes must be a contiguous 1-D tensor",
     lambda d: lambda: ops.dequantize_moments(*ops.new_moments(_ones(d, 300)), (3, 99))),
]


@pytest.mark.parametrize("name,exc,op,arg,call", REFUSED, ids=[c[0] for c in REFUSED])
def test_refused_with_a_clear_error(path, name, exc, op, arg, call):
    _raises(exc, op, arg, call(path[0]))


@pytest.mark.parametrize("ignore_index", [-1, -100])
def test_target_out_of_range_for_a_narrow_dtype(path, monkeypatch, ignore_index):
    # uint8 255 is not -1: torch's own compare would cast -1 to 255 and skip the range check
    monkeypatch.setenv("TIGON_VALIDATE", "1")  # CUDA checks targets only on request (it reads them)
    t = torch.tensor([1, 255, 3, 6], dtype=torch.uint8, device=path[0])
    _raises(ValueError, "cross_entropy", "got 255 at index 1", _ce(path[0], target=t, ignore_index=ignore_index))


def _close(got, want):
    got, want = (got, want) if isinstance(got, (tuple, list)) else ((got,), (want,))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5, equal_nan=True)


def _grads(fn, inputs, seed=0):
    """Outputs of fn(*inputs) and the gradients of a fixed random projection of them."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in outs)
    wanted = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(loss, wanted, allow_unused=True, materialize_grads=True) if wanted else ()
    return tuple(o.detach() for o in outs) + tuple(grads)


def _mlp_torch(act):
    def fn(x, gw, uw, dw):
        if uw is None:
            gate, up = (x @ gw.t()).chunk(2, -1)
        else:
            gate, up = x @ gw.t(), x @ uw.t()
        return (act(gate) * up) @ dw.t()
    return fn


_gelu = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731

# (name, tigon fn, torch fn, inputs(device)): valid edge input, same outputs and gradients as PyTorch
ACCEPTED = [
    ("rms_zero_width", "rms_norm", lambda x, w: ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, (0,), w, 1e-6),
     lambda d: (_randn(d, 3, 0), _ones(d, 0))),
    ("rms_zero_width_3d", "rms_norm", lambda x: ops.rms_norm(x, None), lambda x: F.rms_norm(x, (0,), None, 1e-6),
     lambda d: (_randn(d, 2, 3, 0),)),
    ("rms_zero_rows_and_width", "rms_norm", lambda x, w: ops.rms_norm(x, w),
     lambda x, w: F.rms_norm(x, (0,), w, 1e-6), lambda d: (_randn(d, 0, 0), _ones(d, 0))),
    ("rms_expanded_rows", "rms_norm", lambda x, w: ops.rms_norm(x.expand(4, 6), w),
     lambda x, w: F.rms_norm(x.expand(4, 6), (6,), w, 1e-6), lambda d: (_randn(d, 1, 6), _randn(d, 6))),
    ("add_rms_zero_width", "add_rms_norm", lambda x, r, w: ops.add_rms_norm(x, r, w),
     lambda x, r, w: (F.rms_norm(x + r, (0,), w, 1e-6), x + r), lambda d: (_randn(d, 3, 0), _randn(d, 3, 0),
                                                                           _ones(d, 0))),
    ("add_rms_same_tensor", "add_rms_norm", lambda x, w: ops.add_rms_norm(x, x, w),
     lambda x, w: (F.rms_norm(x + x, (5,), w, 1e-6), x + x), lambda d: (_randn(d, 3, 5), _randn(d, 5))),
    ("ln_zero_width", "layer_norm", lambda x, w, b: ops.layer_norm(x, w, b),
     lambda x, w, b: F.layer_norm(x, (0,), w, b, 1e-5), lambda d: (_randn(d, 3, 0), _ones(d, 0), _ones(d, 0))),
    ("ln_expanded_rows", "layer_norm", lambda x, w: ops.layer_norm(x.expand(3, 5), w, None),
     lambda x, w: F.layer_norm(x.expand(3, 5), (5,), w, None, 1e-5), lambda d: (_randn(d, 1, 5), _randn(d, 5))),
    ("swiglu_0d", "swiglu", ops.swiglu, lambda g, u: F.silu(g) * u, lambda d: (_randn(d), _randn(d))),
    ("geglu_0d", "geglu", ops.geglu, lambda g, u: _gelu(g) * u, lambda d: (_randn(d), _randn(d))),
    ("swiglu_zero_width", "swiglu", ops.swiglu, lambda g, u: F.silu(g) * u,
     lambda d: (_randn(d, 3, 0), _randn(d, 3, 0))),
    ("swiglu_same_tensor", "swiglu", lambda g: ops.swiglu(g, g), lambda g: F.silu(g) * g,
     lambda d: (_randn(d, 3, 4),)),
    ("swiglu_mlp_zero_hidden", "swiglu_mlp", ops.swiglu_mlp, _mlp_torch(F.silu),
     lambda d: (_randn(d, 3, 0), _randn(d, 6, 0), _randn(d, 6, 0), _randn(d, 5, 6))),
    ("geglu_mlp_expanded_x", "geglu_mlp", lambda x, g, u, w: ops.geglu_mlp(x.expand(3, 4), g, u, w),
     lambda x, g, u, w: _mlp_torch(_gelu)(x.expand(3, 4), g, u, w),
     lambda d: (_randn(d, 1, 4), _randn(d, 6, 4), _randn(d, 6, 4), _randn(d, 4, 6))),
    ("lce_zero_hidden", "linear_cross_entropy", lambda h, w, b, t: ops.linear_cross_entropy(h, w, t, b),
     lambda h, w, b, t: F.cross_entropy(F.linear(h, w, b), t),
     lambda d: (_randn(d, 4, 0), _randn(d, 7, 0), _randn(d, 7), _long(d, 1, 2, 3, 6))),
    ("ce_int32_target_ignore_index_past_int32", "cross_entropy",
     lambda x, t: ops.cross_entropy(x, t.int(), ignore_index=2**32 + 2),
     lambda x, t: F.cross_entropy(x, t, ignore_index=2**32 + 2), lambda d: (_randn(d, 4, 7), _long(d, 1, 2, 2, 6))),
    ("ce_uint8_target_ignore_255", "cross_entropy",
     lambda x, t: ops.cross_entropy(x, t.to(torch.uint8), ignore_index=255),
     lambda x, t: F.cross_entropy(x, t, ignore_index=255), lambda d: (_randn(d, 4, 7), _long(d, 1, 255, 2, 6))),
    ("ce_inf_logits", "cross_entropy", lambda x, t: ops.cross_entropy(x, t, reduction="none"),
     lambda x, t: F.cross_entropy(x, t, reduction="none"),
     lambda d: (torch.tensor([[1.0, float("inf"), 0.0], [1.0, float("-inf"), 2.0], [3.0, float("-inf"), 0.5],
                              [float("nan"), 0.0, 1.0]], device=d), _long(d, 0, 0, 1, 2))),
    ("ce_expanded_inplace", "cross_entropy",
     lambda x, t: ops.cross_entropy((x * 1).expand(4, 7), t, inplace_backward=True),
     lambda x, t: F.cross_entropy(x.expand(4, 7), t), lambda d: (_randn(d, 1, 7), _long(d, 1, 2, 3, 6))),
    ("ce_overlapping_rows_inplace", "cross_entropy",
     lambda x, t: ops.cross_entropy((x * 1).as_strided((4, 7), (2, 1)), t, inplace_backward=True),
     lambda x, t: F.cross_entropy(x.as_strided((4, 7), (2, 1)), t), lambda d: (_randn(d, 13), _long(d, 1, 2, 3, 6))),
    ("ce_leaf_inplace", "cross_entropy", lambda x, t: ops.cross_entropy(x, t, inplace_backward=True),
     lambda x, t: F.cross_entropy(x, t), lambda d: (_randn(d, 4, 7), _long(d, 1, 2, 3, 6))),
]


@pytest.mark.parametrize("name,op,fn,torch_fn,inputs", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_accepted_like_torch(path, name, op, fn, torch_fn, inputs):
    device, expected = path
    torch.manual_seed(0)
    args = inputs(device)
    before = _library.dispatch_counts[(op, expected)]
    got = _grads(fn, args)
    assert _library.dispatch_counts[(op, expected)] > before  # the path under test ran
    _close(got, _grads(torch_fn, [a.cpu() for a in args]))


# Mixed dtypes, one rule for every op (tigon.ops._launch's docstring): x, what is combined with it, the weights
# and biases of its products and the caches share x's dtype, else a TypeError naming the op and the argument;
# per-channel parameters read in fp32 (norm weights and biases, cos/sin, LoRA adapters, MoE routing weights) may
# be any float dtype, the output in x's dtype (LlamaRMSNorm's promotion for the "llama" casting). Both paths.
H16 = torch.float16


def _x16(d, *shape):
    return _randn(d, *shape, dtype=H16)


def _llama_rms(x, w):  # transformers' LlamaRMSNorm.forward
    return w * F.rms_norm(x.float(), (x.shape[-1],), None, 1e-6).to(x.dtype)


def _tables(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)  # fixed tables that need no gradient, as a model's rotary output
    return tuple(torch.randn(1, 3, 8, generator=g).to(device=device, dtype=dtype) for _ in range(2))


def _rope_torch(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' formula in fp32, each output rounded once to its input's dtype."""
    qe, ke = reference.eager_apply_rope(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim)
    return qe.to(q.dtype), ke.to(k.dtype)


def _kv_write(k, v, q, cos, sin):
    """rope_kv_write into fresh zero caches at slot 2: (rotated query, k_cache, v_cache)."""
    kc, vc = torch.zeros(1, 2, 4, 8, device=k.device), torch.zeros(1, 2, 4, 8, device=k.device)
    q_embed = ops.rope_kv_write(k, v, cos, sin, kc, vc, _long(k.device, 2), query=q)
    return q_embed, kc, vc


def _kv_write_torch(k, v, q, cos, sin):
    qe, ke = _rope_torch(q, k, cos, sin)
    kc, vc = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
    kc[:, :, 2:3], vc[:, :, 2:3] = ke, v
    return qe, kc, vc


_MOE_POS = ((2, 0), (3, 1))


def _moe_torch(y, w):
    pos = torch.tensor(_MOE_POS)
    return (y.float()[pos] * w.float()[..., None]).sum(1).to(y.dtype)


def _lora_torch(x, a, b, s=0.5):
    return s * (x @ a.to(x.dtype).t() @ b.to(x.dtype).t())


# (name, op, inputs(device), tigon fn, what happens: a pattern of the TypeError, or the torch function it equals)
MIXED = [
    ("swiglu_up", "swiglu", lambda d: (_randn(d, 3, 4), _x16(d, 3, 4)), ops.swiglu,
     "up has dtype torch.float16 but gate has dtype torch.float32"),
    ("add_rms_residual", "add_rms_norm", lambda d: (_randn(d, 3, 8), _x16(d, 3, 8), _randn(d, 8)),
     ops.add_rms_norm, "residual has dtype torch.float16"),
    ("swiglu_mlp_weights", "swiglu_mlp", lambda d: (_randn(d, 3, 4), _x16(d, 6, 4), _x16(d, 6, 4), _x16(d, 4, 6)),
     ops.swiglu_mlp, "gate_weight dtype torch.float16 differs from x's torch.float32"),
    ("geglu_mlp_down", "geglu_mlp", lambda d: (_randn(d, 3, 4), _randn(d, 6, 4), _randn(d, 6, 4), _x16(d, 4, 6)),
     ops.geglu_mlp, "down_weight dtype torch.float16"),
    ("lce_weight", "linear_cross_entropy", lambda d: (_randn(d, 4, 5), _x16(d, 7, 5), _long(d, 1, 2, 3, 6)),
     ops.linear_cross_entropy, "weight has dtype torch.float16 but hidden has dtype torch.float32"),
    ("lce_fp16_hidden", "linear_cross_entropy", lambda d: (_x16(d, 4, 5), _randn(d, 7, 5), _long(d, 1, 2, 3, 6)),
     ops.linear_cross_entropy, "weight has dtype torch.float32 but hidden has dtype torch.float16"),
    ("lce_bias", "linear_cross_entropy",
     lambda d: (_randn(d, 4, 5), _randn(d, 7, 5), _long(d, 1, 2, 3, 6), _x16(d, 7)), ops.linear_cross_entropy,
     "bias has dtype torch.float16"),
    ("logprobs_weight", "fused_linear_logprobs",
     lambda d: (_randn(d, 2, 3, 5), _x16(d, 7, 5), torch.ones(2, 3, dtype=torch.long, device=d)),
     ops.fused_linear_logprobs, "weight has dtype torch.float16"),
    ("jsd_student_weight", "fused_linear_jsd",
     lambda d: (_randn(d, 4, 5), _x16(d, 7, 5), _randn(d, 4, 5), _randn(d, 7, 5), _long(d, 1, 2, 3, 6)),
     ops.fused_linear_jsd, "student_weight has dtype torch.float16"),
    ("lora_base_weight", "lora_linear", lambda d: (_randn(d, 3, 8), _x16(d, 6, 8), _randn(d, 2, 8), _randn(d, 6, 2)),
     lambda x, w, a, b: ops.lora_linear(x, w, None, a, b, 0.5), "weight has dtype torch.float16"),
    ("lora_add_base_out", "lora_add", lambda d: (_x16(d, 3, 6), _randn(d, 3, 8), _randn(d, 2, 8), _randn(d, 6, 2)),
     lambda base, x, a, b: ops.lora_add(base, x, a, b, 0.5), "base_out has dtype torch.float16"),
    ("decode_linear_weight", "decode_linear", lambda d: (_randn(d, 2, 8), _x16(d, 6, 8)),
     lambda x, w: ops.decode_linear(x, [w]), r"weights\[0\] has dtype torch.float16"),
    ("decode_linear_norm_weight", "decode_linear", lambda d: (_randn(d, 2, 8), _randn(d, 6, 8), _x16(d, 8)),
     lambda x, w, n: ops.decode_linear(x, [w], norm_weight=n), "norm_weight has dtype torch.float16"),
    ("decode_attention_cache", "decode_attention", lambda d: (_randn(d, 1, 2, 1, 8), _x16(d, 1, 2, 4, 8)),
     lambda q, kc: ops.decode_attention(q, kc, kc, torch.arange(4, device=q.device), _long(q.device, 3)),
     "k_cache has dtype torch.float16"),
    ("rope_kv_write_query", "rope_kv_write", lambda d: (_randn(d, 1, 2, 3, 8), _randn(d, 1, 2, 3, 8),
                                                        _x16(d, 1, 2, 3, 8)),
     lambda k, v, q: ops.rope_kv_write(k, v, *_tables(k.device), _randn(k.device, 1, 2, 4, 8),
                                       _randn(k.device, 1, 2, 4, 8), _long(k.device, 0, 1, 2), query=q),
     "query has dtype torch.float16 but key has dtype torch.float32"),
    ("adamw_grads", "adamw_step_", lambda d: (_randn(d, 4), _x16(d, 4)),
     lambda p, g: ops.adamw_step_([p], [g], [torch.zeros_like(p)], [torch.zeros_like(p)], lr=0.1, step=1),
     r"grads\[0\] has dtype torch.float16"),
    ("adamw8bit_grad", "adamw8bit_step_", lambda d: (_randn(d, 4), _x16(d, 4)),
     lambda p, g: ops.adamw8bit_step_(p, g, *ops.new_moments(p), lr=0.1, step=1),
     "grad has dtype torch.float16 but param has dtype torch.float32"),
    # accepted: per-channel parameters
    ("rms_norm_weight16", "rms_norm", lambda d: (_randn(d, 3, 8), _x16(d, 8)), ops.rms_norm, _llama_rms),
    ("rms_norm_x16_weight32", "rms_norm", lambda d: (_x16(d, 3, 8), _randn(d, 8)), ops.rms_norm, _llama_rms),
    ("rms_norm_gemma_weight16", "rms_norm", lambda d: (_randn(d, 3, 8), _x16(d, 8)),
     lambda x, w: ops.rms_norm(x, w, offset=1.0, casting_mode="gemma"),
     lambda x, w: F.rms_norm(x.float(), (8,), 1.0 + w.float(), 1e-6).to(x.dtype)),
    ("add_rms_weight16", "add_rms_norm", lambda d: (_randn(d, 3, 8), _randn(d, 3, 8), _x16(d, 8)), ops.add_rms_norm,
     lambda x, r, w: (_llama_rms(x + r, w), x + r)),
    ("layer_norm_params16", "layer_norm", lambda d: (_randn(d, 3, 8), _x16(d, 8), _x16(d, 8)), ops.layer_norm,
     lambda x, w, b: F.layer_norm(x.float(), (8,), w.float(), b.float()).to(x.dtype)),
    ("layer_norm_x16_params32", "layer_norm", lambda d: (_x16(d, 3, 8), _randn(d, 8), _randn(d, 8)), ops.layer_norm,
     lambda x, w, b: F.layer_norm(x.float(), (8,), w, b).to(x.dtype)),
    ("qk_norm_rope_weights16", "qk_norm_rope", lambda d: (_randn(d, 1, 3, 2, 8), _randn(d, 1, 3, 1, 8), _x16(d, 8),
                                                          _x16(d, 8)),
     lambda q, k, wq, wk: ops.qk_norm_rope(q, k, wq, wk, *_tables(q.device)),
     lambda q, k, wq, wk: _rope_torch(_llama_rms(q, wq), _llama_rms(k, wk), *_tables(q.device), unsqueeze_dim=2)),
    ("qk_norm_rope_cos16", "qk_norm_rope", lambda d: (_randn(d, 1, 3, 2, 8), _randn(d, 1, 3, 1, 8), _randn(d, 8),
                                                      _randn(d, 8)),
     lambda q, k, wq, wk: ops.qk_norm_rope(q, k, wq, wk, *_tables(q.device, H16)),
     lambda q, k, wq, wk: _rope_torch(_llama_rms(q, wq), _llama_rms(k, wk), *_tables(q.device, H16),
                                      unsqueeze_dim=2)),
    ("apply_rope_cos16", "apply_rope", lambda d: (_randn(d, 1, 2, 3, 8), _randn(d, 1, 1, 3, 8)),
     lambda q, k: ops.apply_rope(q, k, *_tables(q.device, H16)), lambda q, k: _rope_torch(q, k, *_tables("cpu", H16))),
    ("apply_rope_q32_k16", "apply_rope", lambda d: (_randn(d, 1, 2, 3, 8), _x16(d, 1, 1, 3, 8)),
     lambda q, k: ops.apply_rope(q, k, *_tables(q.device)), lambda q, k: _rope_torch(q, k, *_tables("cpu"))),
    ("lora_adapters16", "lora_linear", lambda d: (_randn(d, 3, 8), _randn(d, 6, 8), _x16(d, 2, 8), _x16(d, 6, 2)),
     lambda x, w, a, b: ops.lora_linear(x, w, None, a, b, 0.5),
     lambda x, w, a, b: F.linear(x, w) + _lora_torch(x, a, b)),
    ("lora_add_adapters16", "lora_add", lambda d: (_randn(d, 3, 6), _randn(d, 3, 8), _x16(d, 2, 8), _x16(d, 6, 2)),
     lambda base, x, a, b: ops.lora_add(base, x, a, b, 0.5), lambda base, x, a, b: base + _lora_torch(x, a, b)),
    ("moe_combine_weights16", "moe_combine", lambda d: (_randn(d, 4, 8), _x16(d, 2, 2)),
     lambda y, w: ops.moe_combine(y, w, torch.tensor(_MOE_POS, device=y.device)), _moe_torch),
    ("rope_kv_write_cos16", "rope_kv_write", lambda d: (_randn(d, 1, 2, 1, 8), _randn(d, 1, 2, 1, 8),
                                                        _randn(d, 1, 2, 1, 8)),
     lambda k, v, q: _kv_write(k, v, q, *(t[:, :1] for t in _tables(k.device, H16))),
     lambda k, v, q: _kv_write_torch(k, v, q, *(t[:, :1] for t in _tables("cpu", H16)))),
]
_INFERENCE_ONLY = {"rope_kv_write"}


@pytest.mark.parametrize("name,op,inputs,fn,want", MIXED, ids=[c[0] for c in MIXED])
def test_mixed_dtypes(path, name, op, inputs, fn, want):
    device, expected = path
    torch.manual_seed(0)
    args = inputs(device)
    if isinstance(want, str):
        _raises(TypeError, op, want, lambda: fn(*args))
        return
    before = _library.dispatch_counts[(op, expected)]
    if op in _INFERENCE_ONLY:
        with torch.no_grad():
            got, ref = fn(*args), want(*[a.cpu() for a in args])
    else:
        got, ref = _grads(fn, args), _grads(want, [a.cpu() for a in args])
    assert _library.dispatch_counts[(op, expected)] > before  # the path under test ran
    # fp16 inputs: one fp16 rounding may land on the other side (1 ulp = 1e-3); the output dtypes are exact
    tol = 2e-3 if any(a.dtype == H16 for a in args) else 1e-5
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol)


@pytest.mark.parametrize("interpreter", [True, False])
def test_backend_for_takes_a_device_or_its_name(monkeypatch, interpreter):
    monkeypatch.setattr(_library, "interpreter_on", lambda: interpreter)
    cpu = "triton" if interpreter else "reference"
    for device, want in (("cuda", "triton"), ("cuda:1", "triton"), (torch.device("cuda"), "triton"), ("cpu", cpu),
                         (torch.device("cpu"), cpu), ("meta", "reference")):
        assert ops.backend_for(device) == want, device
    _raises(ValueError, "backend_for", r"device 'gpu' is not a device string", lambda: ops.backend_for("gpu"))
    _raises(TypeError, "backend_for", r"device must be a torch.device or a device string .*, got int$",
            lambda: ops.backend_for(0))
    _raises(TypeError, "backend_for", r"got Tensor \(pass t.device\)", lambda: ops.backend_for(torch.zeros(1)))


def test_inplace_backward_leaves_a_leaf_alone(path):
    x = _randn(path[0], 4, 7, requires_grad=True)
    before = x.detach().clone()
    ops.cross_entropy(x, _long(path[0], 1, 2, 3, 6), inplace_backward=True).backward()
    assert torch.equal(x.detach(), before)
    assert x.grad.data_ptr() != x.data_ptr()


def test_inplace_backward_over_logits_another_op_saved(path):
    # tanh saves its output for backward: overwriting it must fail loudly, never feed tanh a gradient
    h = _randn(path[0], 4, 7, requires_grad=True)
    loss = ops.cross_entropy(torch.tanh(h), _long(path[0], 1, 2, 3, 6), inplace_backward=True)
    if path[1] == "reference":
        (g,) = torch.autograd.grad(loss, h)
        (want,) = torch.autograd.grad(F.cross_entropy(torch.tanh(h), _long(path[0], 1, 2, 3, 6)), h)
        torch.testing.assert_close(g, want)
        return
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_ignored_rows_with_nan_logits_get_a_zero_gradient(path):
    # padding rows may hold anything; their NaN must not reach the gradient (and lm_head's dW through it)
    x = torch.tensor([[float("nan"), 1.0, 2.0], [float("inf"), float("-inf"), 0.0], [0.5, 1.0, 2.0]],
                     device=path[0], requires_grad=True)
    t = _long(path[0], -100, -100, 2)
    loss = ops.cross_entropy(x, t, label_smoothing=0.1, z_loss_scale=1e-3)
    (g,) = torch.autograd.grad(loss, x)
    assert torch.equal(g[:2], torch.zeros_like(g[:2]))
    want = F.cross_entropy(x.detach()[2:].cpu(), t[2:].cpu(), label_smoothing=0.1)
    assert torch.isfinite(loss) and torch.isfinite(g).all() and float(loss) > float(want)


def test_may_overlap_reads_the_layout():
    base = torch.zeros(6, 8)
    assert not _launch.may_overlap(base)
    assert not _launch.may_overlap(base.t())
    assert not _launch.may_overlap(base[:, :4])  # a chunk of a fused gate_up
    assert not _launch.may_overlap(base[:1].expand(0, 8))
    assert _launch.may_overlap(base[:1].expand(3, 8))
    assert _launch.may_overlap(base.view(-1).as_strided((4, 8), (2, 1)))


# Double backward (create_graph=True): a gradient penalty through the op.


def _penalty_grads(fn, inputs, n_grad):
    """d/d(inputs) of |d loss / d(first n_grad inputs)|^2 with loss = <y, r> + |y|^2 / 2: the second
    derivative through fn (the square keeps it nonzero for a linear op such as rope)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device) + o.float().square() / 2).sum()
               for o in outs)
    first = torch.autograd.grad(loss, leaves[:n_grad], create_graph=True)
    penalty = sum(f.float().pow(2).sum() for f in first)
    second = torch.autograd.grad(penalty, leaves, allow_unused=True, materialize_grads=True)
    return tuple(f.detach() for f in first) + second


# (name, tigon fn, torch fn, inputs(device), how many inputs get the first-order gradient)
DOUBLE_BACKWARD = [
    ("rms_norm", lambda x, w: ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, (6,), w, 1e-6),
     lambda d: (_randn(d, 3, 6), _randn(d, 6)), 2),
    ("rms_norm_gemma", lambda x, w: ops.rms_norm(x, w, offset=1.0, casting_mode="gemma"),
     lambda x, w: F.rms_norm(x, (6,), 1.0 + w, 1e-6), lambda d: (_randn(d, 3, 6), _randn(d, 6)), 2),
    ("add_rms_norm", lambda x, r, w: ops.add_rms_norm(x, r, w),
     lambda x, r, w: (F.rms_norm(x + r, (6,), w, 1e-6), x + r), lambda d: (_randn(d, 3, 6),) * 2 + (_randn(d, 6),),
     3),
    ("layer_norm", lambda x, w, b: ops.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (6,), w, b),
     lambda d: (_randn(d, 3, 6), _randn(d, 6), _randn(d, 6)), 2),
    ("swiglu", ops.swiglu, lambda g, u: F.silu(g) * u, lambda d: (_randn(d, 3, 5), _randn(d, 3, 5)), 2),
    ("geglu_inplace", lambda g, u: ops.geglu(g * 1, u * 1, inplace_backward=True), lambda g, u: _gelu(g) * u,
     lambda d: (_randn(d, 3, 5), _randn(d, 3, 5)), 1),
    ("swiglu_packed", lambda gu: swiglu_packed(gu * 1, inplace_backward=True),
     lambda gu: F.silu(gu[:, :4]) * gu[:, 4:], lambda d: (_randn(d, 3, 8),), 1),
    ("swiglu_mlp", ops.swiglu_mlp, _mlp_torch(F.silu),
     lambda d: (_randn(d, 2, 3, 4), _randn(d, 6, 4), _randn(d, 6, 4), _randn(d, 4, 6)), 1),
    ("geglu_mlp_packed", lambda x, g, w: ops.geglu_mlp(x, g, None, w),
     lambda x, g, w: _mlp_torch(_gelu)(x, g, None, w), lambda d: (_randn(d, 3, 4), _randn(d, 12, 4),
                                                                 _randn(d, 4, 6)), 3),
    ("apply_rope", lambda q, k: ops.apply_rope(q, k, *_cos_sin(q.device)),
     lambda q, k: reference.eager_apply_rope(q, k, *_cos_sin(q.device)),
     lambda d: (_randn(d, 1, 2, 3, 4), _randn(d, 1, 1, 3, 4)), 2),
]


def _cos_sin(device):
    g = torch.Generator().manual_seed(2)  # tables that need no gradient: the kernel path runs
    return tuple(torch.randn(1, 3, 4, generator=g).to(device) for _ in range(2))


@pytest.mark.parametrize("name,fn,torch_fn,inputs,n_grad", DOUBLE_BACKWARD, ids=[c[0] for c in DOUBLE_BACKWARD])
def test_double_backward_matches_torch(path, name, fn, torch_fn, inputs, n_grad):
    torch.manual_seed(0)
    args = inputs(path[0])
    got = _penalty_grads(fn, args, n_grad)
    want = _penalty_grads(torch_fn, [a.cpu() for a in args], n_grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


# cross_entropy and linear_cross_entropy make their gradients in the forward and keep nothing else (that is
# their memory saving): both paths refuse double backward loudly (the reference path as the kernel path does).
NO_DOUBLE_BACKWARD = [
    ("cross_entropy", lambda x: ops.cross_entropy(x, _long(x.device, 1, 2, 3, -100)),
     lambda x: F.cross_entropy(x, _long(x.device, 1, 2, 3, -100)), lambda d: (_randn(d, 4, 7),)),
    ("cross_entropy", lambda x: ops.cross_entropy(x * 1, _long(x.device, 1, 2, 3, 4), reduction="none",
                                                  inplace_backward=True),
     lambda x: F.cross_entropy(x, _long(x.device, 1, 2, 3, 4), reduction="none"), lambda d: (_randn(d, 4, 7),)),
    ("linear_cross_entropy", lambda h, w: ops.linear_cross_entropy(h, w, _long(h.device, 1, 2, 3, 6)),
     lambda h, w: F.cross_entropy(h @ w.t(), _long(h.device, 1, 2, 3, 6)),
     lambda d: (_randn(d, 4, 5), _randn(d, 7, 5))),
    ("linear_cross_entropy", lambda h, w: ops.linear_cross_entropy(h, w, _long(h.device, 1, 2, 3, 6),
                                                                   reduction="none"),
     lambda h, w: F.cross_entropy(h @ w.t(), _long(h.device, 1, 2, 3, 6), reduction="none"),
     lambda d: (_randn(d, 4, 5), _randn(d, 7, 5))),
]


@pytest.mark.parametrize("op,fn,torch_fn,inputs", NO_DOUBLE_BACKWARD,
                         ids=["ce_mean", "ce_none_inplace", "lce_mean", "lce_none"])
def test_double_backward_of_the_losses(path, op, fn, torch_fn, inputs):
    torch.manual_seed(0)
    args = inputs(path[0])
    _penalty_grads(torch_fn, args, 1)  # the same penalty is fine through PyTorch's own ops
    with pytest.raises(NotImplementedError, match=f"^tigon.ops.{op}: double backward"):
        _penalty_grads(fn, args, 1)


@pytest.mark.parametrize("op,call", [
    ("cross_entropy", lambda x, w, t: ops.cross_entropy(x @ w.t(), t)),
    ("cross_entropy", lambda x, w, t: ops.cross_entropy(x @ w.t(), t, inplace_backward=True)),
    ("linear_cross_entropy", lambda x, w, t: ops.linear_cross_entropy(x, w, t)),
], ids=["ce", "ce_inplace", "lce"])
def test_second_backward_through_a_retained_graph(path, op, call):
    x, w, t = _randn(path[0], 4, 5, requires_grad=True), _randn(path[0], 7, 5), _long(path[0], 1, 2, 3, 6)
    loss = call(x, w, t)
    loss.backward(retain_graph=True)
    if path[1] == "reference":
        loss.backward()
        (want,) = torch.autograd.grad(2 * F.cross_entropy(x @ w.t(), t), x)
        torch.testing.assert_close(x.grad, want)
        return
    with pytest.raises(RuntimeError, match=f"^tigon.ops.{op}: a second backward.*modified by an inplace"):
        loss.backward()


def test_compile_fullgraph_through_the_fallbacks(device):
    """The overlap and leaf checks read layouts only: fullgraph compiles, and the results match eager."""
    x = _randn(device, 4, 9, requires_grad=True)
    t = _long(device, 1, 2, -100, 4)

    def fn(x, t):
        logits = x * 2
        return (ops.cross_entropy(logits, t, inplace_backward=True)
                + ops.cross_entropy(logits[:1].expand(4, 9) * 1, t, inplace_backward=True, num_items_in_batch=3)
                + ops.cross_entropy(x, t, inplace_backward=True)
                + ops.rms_norm(x, None, offset=1.0).sum() + ops.swiglu(x[0, 0], x[0, 1]))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    (got,) = torch.autograd.grad(compiled(x, t), x)
    (want,) = torch.autograd.grad(fn(x, t), x)
    torch.testing.assert_close(got, want)
