import pytest
import torch
from torch import nn

from tests._grid import DTYPES, assert_bound, fp64_copy, grads, randn
from tigon import modules
from tigon.ops import dispatch_counts, reference
from tigon.ops.glu_mlp import geglu_mlp, swiglu_mlp

FNS = {"swiglu": (swiglu_mlp, reference.swiglu, reference.eager_swiglu),
       "geglu": (geglu_mlp, reference.geglu, reference.eager_geglu)}


def _mlp(glu, x, wg, wu, wd):
    gate, up = (x @ wg.t(), x @ wu.t()) if wu is not None else (x @ wg.t()).chunk(2, dim=-1)
    return glu(gate, up) @ wd.t()


def _inputs(device, dtype, H=24, I=37, packed=False, transposed=False, seed=0):
    torch.manual_seed(seed)
    x = randn(3, 5, H, dtype=dtype, device=device, requires_grad=True, transposed=transposed)
    wg = randn(2 * I if packed else I, H, dtype=dtype, device=device, requires_grad=True, scale=0.5)
    wu = None if packed else randn(I, H, dtype=dtype, device=device, requires_grad=True, scale=0.5)
    wd = randn(H + 3, I, dtype=dtype, device=device, requires_grad=True, scale=0.3)
    return x, wg, wu, wd


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("act", FNS)
def test_forward_and_every_gradient(device, dtype, packed, act):
    fn, ref_glu, eager_glu = FNS[act]
    inputs = _inputs(device, dtype, packed=packed, transposed=dtype == torch.float32)
    out = fn(*inputs)
    ref_in = fp64_copy(*inputs)
    ref = _mlp(ref_glu, *ref_in)
    eager_in = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    eag = _mlp(eager_glu, *eager_in)
    assert out.dtype == dtype and out.shape == (3, 5, 27)
    assert_bound(f"{act} out", out, eag, ref, dtype)
    go = torch.randn(out.shape, device=device).to(dtype)
    for j, (a, b, c) in enumerate(zip(grads(out, inputs, go), grads(eag, eager_in, go),
                                      grads(ref, ref_in, go.double()))):
        if c is None:
            assert a is None
            continue
        assert a.shape == c.shape and a.dtype == dtype
        assert_bound(f"{act} grad{j}", a, b, c, dtype)


def test_keeps_a_quarter_less_than_three_linears(device):
    """Bytes autograd saves (parameters excluded): x, gate, up here; x, gate, up and the product there."""
    x, wg, wu, wd = _inputs(device, torch.float32, H=16, I=64)
    params = {t.data_ptr() for t in (wg, wu, wd)}

    def saved_bytes(run):
        total = [0]

        def pack(t):
            if t.data_ptr() not in params:
                total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
        return total[0]

    fused = saved_bytes(lambda: swiglu_mlp(x, wg, wu, wd))
    plain = saved_bytes(lambda: _mlp(reference.eager_swiglu, x, wg, wu, wd))
    x_bytes, inter_bytes = 15 * 16 * 4, 15 * 64 * 4
    assert fused == x_bytes + 2 * inter_bytes
    assert plain >= x_bytes + 3 * inter_bytes


def test_frozen_weights_and_no_grad_input(device):
    x, wg, wu, wd = _inputs(device, torch.float32)
    wg.requires_grad_(False), wd.requires_grad_(False)
    x_nograd = x.detach()
    out = swiglu_mlp(x_nograd, wg, wu, wd)
    out.sum().backward()
    assert wg.grad is None and wd.grad is None and wu.grad is not None
    wu_ref = wu.detach().clone().requires_grad_()
    _mlp(reference.swiglu, x_nograd, wg, wu_ref, wd).sum().backward()
    torch.testing.assert_close(wu.grad, wu_ref.grad, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    x, wg, wu, wd = _inputs(device, torch.float32)
    fn = lambda x, wg, wu, wd: swiglu_mlp(x * 1.5, wg, wu, wd).square().sum()
    torch._dynamo.reset()
    loss = torch.compile(fn, fullgraph=True, backend=backend)(x, wg, wu, wd)
    g = torch.autograd.grad(loss, (x, wg, wu, wd))
    loss_e = fn(x, wg, wu, wd)
    g_e = torch.autograd.grad(loss_e, (x, wg, wu, wd))
    torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad,match", [
    (lambda x, wg, wu, wd: (x, wg[:, :5], wu, wd), "gate_weight must be"),
    (lambda x, wg, wu, wd: (x, wg, wu[:3], wd), "up_weight must have shape"),
    (lambda x, wg, wu, wd: (x, wg, wu, wd[:, :4]), "down_weight must be"),
    (lambda x, wg, wu, wd: (x, wg[:7], None, wd), "even first dimension"),
    (lambda x, wg, wu, wd: (x, wg.double(), wu, wd), "gate_weight"),
    (lambda x, wg, wu, wd: (x, wg, wu.half(), wd), "up_weight dtype"),
    (lambda x, wg, wu, wd: (x.long(), wg, wu, wd), "x must be float32"),
])
def test_bad_input_names_the_argument(device, bad, match):
    args = bad(*[t.detach() for t in _inputs(device, torch.float32)])
    with pytest.raises((ValueError, TypeError), match=f"swiglu_mlp: .*{match}|swiglu_mlp: {match}"):
        swiglu_mlp(*args)


@pytest.mark.parametrize("fused_gate_up", [False, True])
def test_module_trains_through_the_one_node_path(device, fused_gate_up):
    torch.manual_seed(0)
    mlp = modules.SwiGLUMLP(hidden_size=24, intermediate_size=40, fused_gate_up=fused_gate_up).to(device)
    x = torch.randn(2, 7, 24, device=device, requires_grad=True)
    dispatch_counts.clear()
    y = mlp(x)
    assert dispatch_counts[("swiglu_mlp", "triton")] == 1 and dispatch_counts[("swiglu", "triton")] == 0
    y.square().sum().backward()
    # the same module with a hook on a projection takes the three-Linear path, same numbers
    ref = modules.SwiGLUMLP(hidden_size=24, intermediate_size=40, fused_gate_up=fused_gate_up).to(device)
    ref.load_state_dict(mlp.state_dict())
    ref.down_proj.register_forward_hook(lambda m, i, o: None)
    x_r = x.detach().clone().requires_grad_()
    dispatch_counts.clear()
    y_r = ref(x_r)
    assert dispatch_counts[("swiglu_mlp", "triton")] == 0 and dispatch_counts[("swiglu", "triton")] == 1
    y_r.square().sum().backward()
    torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_r.grad, rtol=1e-5, atol=1e-5)
    for (n, p), (_, p_r) in zip(mlp.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, p_r.grad, rtol=1e-5, atol=1e-5, msg=n)
    with torch.no_grad():  # inference: the plain path
        dispatch_counts.clear()
        mlp(x)
        assert dispatch_counts[("swiglu_mlp", "triton")] == 0


def test_module_under_autocast_casts_like_linear(device):
    torch.manual_seed(0)
    mlp = modules.SwiGLUMLP(hidden_size=24, intermediate_size=40).to(device)
    x = torch.randn(2, 7, 24, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = mlp(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in mlp.parameters())
    assert isinstance(mlp.gate_proj, nn.Linear)


@pytest.mark.parametrize("reentrant", [False, True])
def test_module_under_activation_checkpointing(device, reentrant):
    """Checkpointed, the MLP takes the three-Linear path (its recompute then skips the down projection), and
    the gradients equal the uncheckpointed module's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    mlp = modules.SwiGLUMLP(hidden_size=24, intermediate_size=40).to(device)
    x = torch.randn(2, 7, 24, device=device, requires_grad=True)
    x_r = x.detach().clone().requires_grad_()
    dispatch_counts.clear()
    checkpoint(mlp, x, use_reentrant=reentrant).square().sum().backward()
    # non-reentrant: forward and recompute both under checkpoint's hooks, through the GLU op; reentrant: the
    # forward runs without grad (GLU op), the recompute with grad and no hooks (one node)
    assert dispatch_counts[("swiglu", "triton")] == (1 if reentrant else 2)
    assert dispatch_counts[("swiglu_mlp", "triton")] == (1 if reentrant else 0)
    grads = [x.grad] + [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp(x_r).square().sum().backward()
    for a, b in zip(grads, [x_r.grad] + [p.grad for p in mlp.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
