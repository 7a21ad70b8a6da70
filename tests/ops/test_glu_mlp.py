import pytest
import torch
from torch import nn

from tests._grid import DTYPES, U32, assert_bound, assert_tol, fp64_copy, grads, matmul_tol, randn, sum_ulps
from tigon import modules
from tigon.ops import dispatch_counts, reference
from tigon.ops.glu_mlp import geglu_mlp, swiglu_mlp

FNS = {"swiglu": (swiglu_mlp, reference.swiglu, reference.eager_swiglu),
       "geglu": (geglu_mlp, reference.geglu, reference.eager_geglu)}


def _mlp(glu, x, wg, wu, wd):
    gate, up = (x @ wg.t(), x @ wu.t()) if wu is not None else (x @ wg.t()).chunk(2, dim=-1)
    return glu(gate, up) @ wd.t()


def _fp32_tols(ref_glu, x, wg, wu, wd, go, go_tol=None):
    """fp32 error model (tests/_grid.py) of the MLP's output and of the gradients of (x, wg, wu, wd) for the
    output gradient go (within go_tol of exact), from the exact fp64 intermediates: gate, up = x W^T (K = H),
    h = act(gate) up, y = h W_d^T (K = I); backward dh = dy W_d (K = H_out), dgate = dh up act'(gate),
    dup = dh act(gate), dx = [dgate, dup] [W_g; W_u] (K = 2I), dW_g, dW_u, dW_d over the tokens. Each
    elementwise step carries its inputs' errors through |d/d input| and adds 8 u of its terms (act, act' in
    fp32: a sigmoid, its products, and |act(g)| <= |g|; act' = s (1 + g (1 - s)) is a cancelling sum of terms
    <= 1 + |g|)."""
    x2 = x.detach().double().reshape(-1, x.shape[-1])
    wg, wd = wg.detach().double(), wd.detach().double()
    dy = go.double().reshape(-1, wd.shape[0])
    w_gu = wg if wu is None else torch.cat([wg, wu.detach().double()])
    gate, up = (x2 @ w_gu.t()).chunk(2, dim=-1)
    gate_tol, up_tol = matmul_tol(x2, w_gu.t()).chunk(2, dim=-1)
    g = gate.clone().requires_grad_()
    a = ref_glu(g, torch.ones_like(g))
    (a1,) = torch.autograd.grad(a.sum(), g, create_graph=True)
    (a2,) = torch.autograd.grad(a1.sum(), g)
    a, a1 = a.detach(), a1.detach()
    h = a * up
    h_tol = (a1 * up).abs() * gate_tol + a.abs() * up_tol + 8 * U32 * gate.abs() * up.abs()
    dh = dy @ wd
    go_tol = None if go_tol is None else go_tol.reshape(dy.shape)
    dh_tol = matmul_tol(dy, wd, go_tol)
    dgate, dup = dh * up * a1, dh * a
    dgate_tol = ((up * a1).abs() * dh_tol + (dh * a1).abs() * up_tol + (dh * up * a2).abs() * gate_tol
                 + 8 * U32 * (dh * up).abs() * (1 + gate.abs()))
    dup_tol = a.abs() * dh_tol + (dh * a1).abs() * gate_tol + 8 * U32 * (dh * gate).abs()
    d_gu, d_gu_tol = torch.cat([dgate, dup], -1), torch.cat([dgate_tol, dup_tol], -1)
    d_w_gu = matmul_tol(d_gu.t(), x2, d_gu_tol.t())
    out = matmul_tol(h, wd.t(), h_tol).reshape(go.shape)
    dx = matmul_tol(d_gu, w_gu, d_gu_tol).reshape(x.shape)
    d_wd = matmul_tol(dy.t(), h, None if go_tol is None else go_tol.t(), h_tol)
    if wu is None:
        return out, [dx, d_w_gu, None, d_wd]
    return out, [dx, d_w_gu[: wg.shape[0]], d_w_gu[wg.shape[0]:], d_wd]


def _module_tols(mlp, x):
    """Tolerances of the module's output and of the gradients of (x, *parameters) of y.square().sum() in fp32
    (`_fp32_tols`; dy = 2y is off by twice y's tolerance): two fp32 paths agree within twice these."""
    ws = [p.detach() for p in mlp.parameters()]
    wg, wu, wd = ws if len(ws) == 3 else (ws[0], None, ws[1])
    y = _mlp(reference.swiglu, *fp64_copy(x.detach(), wg, wu, wd))
    y_tol, _ = _fp32_tols(reference.swiglu, x, wg, wu, wd, y)
    _, g_tols = _fp32_tols(reference.swiglu, x, wg, wu, wd, 2 * y, 2 * y_tol)
    return y_tol, [t for t in g_tols if t is not None]


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
    go = torch.randn(out.shape, device=device).to(dtype)
    if dtype == torch.float32:  # ours and torch's, each within the fp32 model of the fp64 math
        out_tol, grad_tols = _fp32_tols(ref_glu, *inputs, go)
        assert_tol(f"{act} out", out, ref, out_tol)
        assert_tol(f"{act} torch out", eag, ref, out_tol)
    else:
        assert_bound(f"{act} out", out, eag, ref, dtype)
    for j, (a, b, c) in enumerate(zip(grads(out, inputs, go), grads(eag, eager_in, go),
                                      grads(ref, ref_in, go.double()))):
        if c is None:
            assert a is None
            continue
        assert a.shape == c.shape and a.dtype == dtype
        if dtype == torch.float32:
            assert_tol(f"{act} grad{j}", a, c, grad_tols[j])
            assert_tol(f"{act} torch grad{j}", b, c, grad_tols[j])
        else:
            assert_bound(f"{act} grad{j}", a, b, c, dtype)


def test_fp32_model_rejects_an_output_or_gradient_1e3_off(device):
    """The right ones use at most 0.03 of the fp32 model's tolerance here, any of them 1e-3 off 31x or more."""
    inputs = _inputs(device, torch.float32)
    out = swiglu_mlp(*inputs)
    go = torch.randn(out.shape, device=device)
    out_tol, tols = _fp32_tols(reference.swiglu, *inputs, go)
    ref_in = fp64_copy(*inputs)
    ref = _mlp(reference.swiglu, *ref_in)
    got, exact = [out, *grads(out, inputs, go)], [ref, *grads(ref, ref_in, go.double())]
    for name, a, c, tol in zip(("out", "dx", "dW_g", "dW_u", "dW_d"), got, exact, [out_tol, *tols], strict=True):
        assert_tol(name, a, c, tol)
        with pytest.raises(AssertionError, match=f"{name}: err"):
            assert_tol(name, a * (1 + 1e-3), c, tol)


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
    ref_in = fp64_copy(x_nograd, wg, wu, wd)
    _mlp(reference.swiglu, *ref_in).sum().backward()
    _, tols = _fp32_tols(reference.swiglu, x_nograd, wg, wu, wd, torch.ones(3, 5, 27, device=device))
    assert_tol("dW_u", wu.grad, ref_in[2].grad, tols[2])


def test_compile_fullgraph(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    x, wg, wu, wd = _inputs(device, torch.float32)
    fn = lambda x, wg, wu, wd: swiglu_mlp(x * 1.5, wg, wu, wd).square().sum()
    torch._dynamo.reset()
    loss = torch.compile(fn, fullgraph=True, backend=backend)(x, wg, wu, wd)
    g = torch.autograd.grad(loss, (x, wg, wu, wd))
    loss_e = fn(x, wg, wu, wd)
    g_e = torch.autograd.grad(loss_e, (x, wg, wu, wd))
    # the same kernels on both sides; inductor may order the final sum of 405 positive terms its own way
    n_terms = x.shape[:-1].numel() * wd.shape[0]
    torch.testing.assert_close(loss, loss_e, rtol=2 * U32 * (sum_ulps(n_terms) + 4), atol=0)
    # each gradient is two GEMM levels (K <= 37, 27) from the loss; the two sides' incoming gradients may differ
    # by inductor's rounding of 2 y, so allow each level its fp32 sum error, relative to the gradient's scale
    # (an H200 run differed by 9.2e-5 on a gradient of magnitude ~7: 1.3e-5 relative)
    levels = sum_ulps(wd.shape[1]) + sum_ulps(wd.shape[0]) + 8
    for a, b in zip(g, g_e):
        torch.testing.assert_close(a, b, rtol=0, atol=2 * U32 * levels * b.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("act", [0, 1])  # silu, gelu_tanh
def test_traced_recompute_pass_is_the_in_place_one(device, dtype, packed, act):
    """The backward's one GLU pass in a traced graph (tigon::glu_bwd_and_y, new tensors) writes the same bits as
    the eager in-place pass (tigon::glu_bwd_recompute), and as glu_fwd + glu_bwd, and leaves its inputs alone."""
    torch.manual_seed(0)
    M, I = 7, 37
    gate = randn(M, 2 * I if packed else I, dtype=dtype, device=device)
    up = None if packed else randn(M, I, dtype=dtype, device=device)
    dh = randn(M, I, dtype=dtype, device=device)
    before = [t.clone() for t in (dh, gate, up) if t is not None]
    y, dgate, dup = torch.ops.tigon.glu_bwd_and_y(dh, gate, up, act)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in (dh, gate, up) if t is not None]))
    dh_i, gate_i, up_i = dh.clone(), gate.clone(), None if packed else up.clone()
    torch.ops.tigon.glu_bwd_recompute(dh_i, gate_i, up_i, act)
    assert torch.equal(y, dh_i) and torch.equal(dgate, gate_i)
    assert torch.equal(y, torch.ops.tigon.glu_fwd(gate, up, act, False))
    dgate_s, dup_s = torch.ops.tigon.glu_bwd(dh, gate, up, act)
    assert torch.equal(dgate, dgate_s)
    if packed:
        assert dup.numel() == 0
    else:
        assert torch.equal(dup, up_i) and torch.equal(dup, dup_s)


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
    # two fp32 paths (one GEMM per projection and dx by addmm here, nn.Linear's autograd there): each within
    # the fp32 model of the exact values, so within twice it of each other
    y_tol, g_tols = _module_tols(mlp, x)
    assert_tol("y", y, y_r, 2 * y_tol)
    assert_tol("dx", x.grad, x_r.grad, 2 * g_tols[0])
    for (n, p), (_, p_r), tol in zip(mlp.named_parameters(), ref.named_parameters(), g_tols[1:], strict=True):
        assert_tol(n, p.grad, p_r.grad, 2 * tol)
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
    _, tols = _module_tols(mlp, x)  # two fp32 paths: within twice the model of each other
    for j, (a, b, tol) in enumerate(zip(grads, [x_r.grad] + [p.grad for p in mlp.parameters()], tols, strict=True)):
        assert_tol(f"grad{j}", a, b, 2 * tol)
