"""tigon.ops.lora_linear against the fp64 reference and PEFT's own lora.Linear (the torch-in-dtype baseline).

Error bound (DESIGN.md): err(op) <= 2 * err(PEFT in dtype) + eps against fp64, forward and every gradient, where
eps is one unit of the dtype at the tensor's scale. PEFT's layer in dtype rounds the base output, each adapter
product, its scaled copy and the sum; the op rounds xa, the adapters' part (with the bias; once per adapter added)
and the total, its base GEMM adding into the adapters' part last (dx likewise). Each op rounding has a PEFT
rounding at the same or a larger scale (the op's intermediate one falls on the adapters' part, PEFT's on the base
output), so twice PEFT's error stays the budget for the different rounding order. The dropout tests budget against
the reference's math in dtype instead (one rounding, at the end): the op's extra roundings there (xa, the
adapters' part) are what the eps term pays for.
"""

import pytest
import torch

from tigon import ops
from tigon.ops import reference
from tigon.ops._library import backend_for

peft = pytest.importorskip("peft")

IN, OUT, R, T = 37, 53, 3, 11
DTYPES = [torch.float32, torch.bfloat16]


def _peft_layer(weight, bias, adapters, dropout=0.0):
    """PEFT's lora.Linear around an nn.Linear holding `weight`/`bias`, one adapter per (A, B, alpha)."""
    from peft.tuners.lora.layer import Linear

    base = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        base.weight.copy_(weight)
        if bias is not None:
            base.bias.copy_(bias)
    layer = None
    for i, (a, b, alpha) in enumerate(adapters):
        cfg = peft.LoraConfig(r=a.shape[0], lora_alpha=alpha, lora_dropout=dropout)
        name = f"a{i}"
        if layer is None:
            layer = Linear(base, name, config=cfg, r=a.shape[0], lora_alpha=alpha)
        else:
            layer.update_layer(name, a.shape[0], alpha, config=cfg)
        layer.lora_A[name].weight = torch.nn.Parameter(a.detach().clone())
        layer.lora_B[name].weight = torch.nn.Parameter(b.detach().clone())
    layer.set_adapter([f"a{i}" for i in range(len(adapters))])
    return layer


def _inputs(dtype, layout, *, bias=True, adapter_dtype=None, ranks=(R,), seed=0):
    g = torch.Generator().manual_seed(seed)
    adapter_dtype = adapter_dtype or dtype
    if layout == "3d":
        x = torch.randn(2, 5, IN, generator=g)
    elif layout == "transposed":
        x = torch.randn(IN, T, generator=g).t()  # a [T, in] view with stride (1, T)
    elif layout == "strided":
        x = torch.randn(T, 2 * IN, generator=g)[:, ::2]
    else:
        x = torch.randn(T, IN, generator=g)
    w = torch.randn(OUT, IN, generator=g) / IN**0.5
    b = torch.randn(OUT, generator=g) if bias else None
    adapters = [(torch.randn(r, IN, generator=g) / IN**0.5, torch.randn(OUT, r, generator=g) / r**0.5, 2.0 * r)
                for r in ranks]
    return (x.to(dtype), w.to(dtype), None if b is None else b.to(dtype),
            [(a.to(adapter_dtype), bb.to(adapter_dtype), alpha) for a, bb, alpha in adapters])


def _leaf(t, grad=True):
    return None if t is None else t.detach().clone().requires_grad_(grad)


def _run(fn, x, w, b, adapters, g, train_w):
    """fn's output and the gradients of x, weight (if trainable), bias and every A, B for upstream grad g."""
    xs, ws, bs = _leaf(x), _leaf(w, train_w), _leaf(b)
    ab = [(_leaf(a), _leaf(bb), alpha) for a, bb, alpha in adapters]
    y = fn(xs, ws, bs, ab)
    y.backward(g.to(y.dtype))
    grads = [xs.grad] + ([ws.grad] if train_w else []) + ([bs.grad] if b is not None else [])
    grads += [t.grad for a, bb, _ in ab for t in (a, bb)]
    return [y] + grads


def _ours(x, w, b, ab):
    return ops.lora_linear(x, w, b, [a for a, _, _ in ab], [bb for _, bb, _ in ab],
                           [alpha / a.shape[0] for a, _, alpha in ab])


def _reference64(x, w, b, ab):
    return reference.lora_linear(x.double(), w.double(), None if b is None else b.double(),
                                 [a.double() for a, _, _ in ab], [bb.double() for _, bb, _ in ab],
                                 [alpha / a.shape[0] for a, _, alpha in ab])


def _peft_run(x, w, b, adapters, g, train_w):
    """PEFT's layer on leaf copies: its output and the same gradients as _run (read off its own parameters)."""
    layer = _peft_layer(w, b, adapters)
    layer.base_layer.weight.requires_grad_(train_w)
    xs = _leaf(x)
    y = layer(xs)
    y.backward(g.to(y.dtype))
    grads = [xs.grad] + ([layer.base_layer.weight.grad] if train_w else [])
    grads += [layer.base_layer.bias.grad] if b is not None else []
    grads += [t.grad for i in range(len(adapters))
              for t in (layer.lora_A[f"a{i}"].weight, layer.lora_B[f"a{i}"].weight)]
    return [y] + grads


def _check(ours, peft_, ref, dtype):
    names = ["out", "dx", "dW/db/dA/dB..."]
    for i, (o, p, r) in enumerate(zip(ours, peft_, ref)):
        r = r.double()
        assert o.shape == r.shape and o.dtype == p.dtype, (i, o.shape, o.dtype, p.dtype)
        eps = torch.finfo(dtype).eps * r.abs().max().item()
        err, budget = (o.double() - r).abs().max().item(), (p.double() - r).abs().max().item()
        assert err <= 2 * budget + eps, f"{names[min(i, 2)]} #{i}: err {err:.3g} > 2 * {budget:.3g} + {eps:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,bias,train_w", [("2d", True, False), ("3d", False, False), ("transposed", True, True),
                                                 ("strided", False, True)])
def test_matches_reference_and_peft(dtype, layout, bias, train_w):
    x, w, b, adapters = _inputs(dtype, layout, bias=bias)
    g = torch.randn(*x.shape[:-1], OUT, generator=torch.Generator().manual_seed(5))
    ours = _run(_ours, x, w, b, adapters, g, train_w)
    ref = _run(_reference64, x, w, b, adapters, g.double(), train_w)
    _check(ours, _peft_run(x, w, b, adapters, g, train_w), ref, dtype)
    assert ops.dispatch_counts[("lora_linear", "triton")] + ops.dispatch_counts[("lora_linear", "reference")] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_adapters_of_different_rank(dtype):
    x, w, b, adapters = _inputs(dtype, "2d", ranks=(3, 5))
    g = torch.randn(T, OUT, generator=torch.Generator().manual_seed(6))
    ours = _run(_ours, x, w, b, adapters, g, False)
    ref = _run(_reference64, x, w, b, adapters, g.double(), False)
    _check(ours, _peft_run(x, w, b, adapters, g, False), ref, dtype)


def test_fp32_adapters_on_bf16_base_match_peft():
    """PEFT's default for a bf16 model (get_peft_model's autocast_adapter_dtype): fp32 adapters. PEFT then runs the
    adapter in fp32 (an fp32 copy of x); the op runs it in bf16 with fp32 accumulation and returns fp32 gradients.
    Bound from bf16 rounding: gb = g B and xa = x A are rounded once each (2^-8 relative), so dA and dB differ from
    PEFT's by a few 2^-8 of their scale; the output and dx by a few bf16 units of theirs."""
    x, w, b, adapters = _inputs(torch.bfloat16, "3d", adapter_dtype=torch.float32)
    g = torch.randn(2, 5, OUT, generator=torch.Generator().manual_seed(7))
    ours = _run(_ours, x, w, b, adapters, g, False)
    theirs = _peft_run(x, w, b, adapters, g, False)
    for o, p in zip(ours, theirs):
        assert o.dtype == p.dtype and o.shape == p.shape
        scale = p.float().abs().max().item()
        assert (o.float() - p.float()).abs().max().item() <= 4 * 2**-8 * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_replays_the_reference_with_the_same_mask(dtype):
    """Adapter i's input is torch.native_dropout(x, p_i), drawn in adapter order: reseeding and drawing the same
    masks lets the fp64 reference replay them; forward and every gradient must then agree."""
    x, w, b, adapters = _inputs(dtype, "2d", ranks=(3, 4))
    ps = [0.25, 0.0]
    scal = [alpha / a.shape[0] for a, _, alpha in adapters]
    g = torch.randn(T, OUT, generator=torch.Generator().manual_seed(8))
    torch.manual_seed(123)
    ours = _run(lambda x, w, b, ab: ops.lora_linear(x, w, b, [a for a, _, _ in ab], [bb for _, bb, _ in ab], scal, ps),
                x, w, b, adapters, g, False)
    torch.manual_seed(123)
    mask = torch.native_dropout(x, ps[0], True)[1]
    assert 0 < mask.sum() < mask.numel()

    def replay(x, w, b, ab, dt=torch.float64):
        return reference.lora_linear(x.to(dt), w.to(dt), b.to(dt), [a.to(dt) for a, _, _ in ab],
                                     [bb.to(dt) for _, bb, _ in ab], scal, ps, [mask, None])

    ref = _run(replay, x, w, b, adapters, g.double(), False)
    in_dtype = _run(lambda *a: replay(*a, dt=dtype), x, w, b, adapters, g, False)  # the same math in dtype
    _check(ours, in_dtype, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ps", [(0.3, 0.0), (0.0, 0.3)], ids=["dropout_first", "dropout_second"])
def test_adapters_first_leaves_inputs_alone_and_matches_reference(dtype, ps):
    """The adapters' sum (with the bias) is written first and the base GEMM adds x W^T into it; in backward the
    adapters' dx is written first and g W added into it. Two adapters, one with dropout, odd sizes, a bias and a
    trainable weight: the output and every gradient match the fp64 reference replaying the same mask (the error
    model of _check, against the same math in dtype); no input and not the upstream gradient is written; the
    autograd.Function, the custom op's registered autograd and the inference launcher agree bit for bit."""
    n_t, n_in, n_out, ranks = 13, 29, 43, (5, 3)
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(n_t, n_in, generator=gen).to(dtype)
    w = (torch.randn(n_out, n_in, generator=gen) / n_in**0.5).to(dtype)
    b = torch.randn(n_out, generator=gen).to(dtype)
    As = [(torch.randn(r, n_in, generator=gen) / n_in**0.5).to(dtype) for r in ranks]
    Bs = [(torch.randn(n_out, r, generator=gen) / r**0.5).to(dtype) for r in ranks]
    g = torch.randn(n_t, n_out, generator=gen).to(dtype)
    scal, ps = [2.0, 0.5], list(ps)
    torch.manual_seed(123)
    masks = [torch.native_dropout(x, p, True)[1] if p > 0 else None for p in ps]  # the op's draws, in order
    assert 0 < sum(m.sum() for m in masks if m is not None) < x.numel()

    def run(fn, dt=dtype):
        """fn's output and the gradients of x, W, b, A_i, B_i, drawing from seed 123; checks nothing was written."""
        leaves = [t.detach().to(dt).requires_grad_() for t in (x, w, b, *As, *Bs)]
        kept = [t.detach().clone() for t in leaves]
        gd = g.to(dt)
        g_kept = gd.clone()
        torch.manual_seed(123)
        y = fn(leaves[0], leaves[1], leaves[2], leaves[3:5], leaves[5:])
        y.backward(gd)
        for i, (t, k) in enumerate(zip(leaves, kept)):
            assert torch.equal(t.detach(), k), f"input #{i} was written"
        assert torch.equal(gd, g_kept), "the upstream gradient was written"
        return [y] + [t.grad for t in leaves]

    ours = run(lambda x, w, b, a, bb: ops.lora_linear(x, w, b, a, bb, scal, ps))
    op = run(lambda x, w, b, a, bb: torch.ops.tigon.lora_linear_fwd(x, w, b, a, bb, scal, ps)[0])
    if backend_for(x.device) == "triton":  # CPU tensors take the kernels' path only under the interpreter
        for o, c in zip(ours, op):
            assert torch.equal(o, c)
    kept = [t.clone() for t in (x, w, b, *As, *Bs)]
    torch.manual_seed(123)
    with torch.no_grad():
        y = ops.lora_linear(x, w, b, As, Bs, scal, ps)
    assert torch.equal(y, ours[0]) and all(torch.equal(t, k) for t, k in zip((x, w, b, *As, *Bs), kept))

    def replay(x, w, b, a, bb):
        return reference.lora_linear(x, w, b, a, bb, scal, ps, masks)

    want, in_dtype = run(replay, torch.float64), run(replay)
    _check(ours, in_dtype, want, dtype)
    _check(op, in_dtype, want, dtype)


def test_frozen_weight_gets_no_gradient_and_zero_tokens():
    x, w, b, adapters = _inputs(torch.float32, "2d")
    a, bb, _ = adapters[0]
    a, bb = a.requires_grad_(), bb.requires_grad_()
    x0 = torch.zeros(0, IN, requires_grad=True)
    y = ops.lora_linear(x0, w, None, a, bb, 1.0)
    y.sum().backward()
    assert y.shape == (0, OUT) and w.grad is None and torch.equal(a.grad, torch.zeros_like(a))


def test_double_backward_without_dropout():
    x, w, b, adapters = _inputs(torch.float32, "2d")
    a, bb, alpha = adapters[0]
    leaves = [t.clone().requires_grad_() for t in (x, a, bb)]

    def gradnorm(fn):
        y = fn(*leaves)
        ga, = torch.autograd.grad((y * y).sum(), leaves[1], create_graph=True)
        return torch.autograd.grad(ga.square().sum(), leaves)

    ours = gradnorm(lambda x, a, bb: ops.lora_linear(x, w, b, a, bb, 2.0))
    ref = gradnorm(lambda x, a, bb: reference.lora_linear(x, w, b, [a], [bb], [2.0]))
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def test_double_backward_with_dropout_is_refused():
    x, w, b, adapters = _inputs(torch.float32, "2d")
    a, bb, _ = adapters[0]
    # the op's own path (its autograd.Function): CPU tensors on a CUDA machine would take the reference ops
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, w, b, bb = (t.detach().to(dev).requires_grad_(t.requires_grad) for t in (x, w, b, bb))
    a = a.detach().to(dev).requires_grad_()
    y = ops.lora_linear(x, w, b, a, bb, 2.0, 0.5)
    with pytest.raises(NotImplementedError, match="lora_linear"):
        torch.autograd.grad(y.sum(), a, create_graph=True)


@pytest.mark.parametrize("case,exc,match", [
    ("weight_shape", ValueError, r"weight must be 2-D \[out, 37\]"),
    ("weight_dtype", TypeError, "weight has dtype"),
    ("a_shape", ValueError, r"lora_a must be 2-D \[r, 37\]"),
    ("b_shape", ValueError, r"lora_b must be \[53, 3\]"),
    ("count", ValueError, "lora_a has 2 adapters but lora_b has 1"),
    ("scaling", ValueError, "scaling has 1 entries for 2 adapters"),
    ("dropout", ValueError, r"dropout_p must be in \[0, 1\)"),
    ("x_int", TypeError, "x must be float32"),
])
def test_bad_input(case, exc, match):
    x, w, b, adapters = _inputs(torch.float32, "2d")
    a, bb, _ = adapters[0]
    args = dict(x=x, weight=w, bias=b, lora_a=a, lora_b=bb, scaling=2.0, dropout_p=0.0)
    if case == "weight_shape":
        args["weight"] = w[:, :5]
    elif case == "weight_dtype":
        args["weight"] = w.bfloat16()
    elif case == "a_shape":
        args["lora_a"] = a[:, :5]
    elif case == "b_shape":
        args["lora_b"] = bb[:5]
    elif case == "count":
        args["lora_a"] = [a, a]
    elif case == "scaling":
        args.update(lora_a=[a, a], lora_b=[bb, bb], scaling=[2.0])
    elif case == "dropout":
        args["dropout_p"] = 1.0
    elif case == "x_int":
        args["x"] = x.long()
    with pytest.raises(exc, match=f"tigon.ops.lora_linear: {match}"):
        ops.lora_linear(**args)


def test_opcheck_custom_ops():
    x, w, b, adapters = _inputs(torch.float32, "2d", ranks=(3, 2))
    As = [a.clone().requires_grad_() for a, _, _ in adapters]
    Bs = [bb.clone().requires_grad_() for _, bb, _ in adapters]
    torch.library.opcheck(torch.ops.tigon.lora_linear_fwd, (x.requires_grad_(), w, b, As, Bs, [2.0, 0.5], [0.0, 0.0]))
    out, xas, dropped, masks = torch.ops.tigon.lora_linear_fwd(x.detach(), w, b, As, Bs, [2.0, 0.5], [0.0, 0.0])
    g = torch.randn_like(out)
    torch.library.opcheck(torch.ops.tigon.lora_linear_bwd,
                          (g, x.detach(), w, [a.detach() for a in As], [bb.detach() for bb in Bs], xas, dropped, masks,
                           [2.0, 0.5], [0.0, 0.0], True, False, True, [True, True]))


def test_compile_fullgraph_is_one_node():
    """torch.compile(fullgraph=True) of the op: no graph break, the same output and gradients as eager."""
    x, w, b, adapters = _inputs(torch.float32, "3d")
    a, bb, _ = adapters[0]

    def f(x, a, bb):
        return ops.lora_linear(x, w, b, a, bb, 2.0)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (x, a, bb)]
    y = compiled(*leaves)
    y.square().sum().backward()
    eager = [t.clone().requires_grad_() for t in (x, a, bb)]
    ye = f(*eager)
    ye.square().sum().backward()
    torch.testing.assert_close(y, ye)
    for c, e in zip(leaves, eager):
        torch.testing.assert_close(c.grad, e.grad)
    explanation = torch._dynamo.explain(f)(*leaves)
    assert explanation.graph_break_count == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpu_bf16_inductor_and_bitwise_repeatable(dropout):
    dev = torch.device("cuda")
    x, w, b, adapters = _inputs(torch.bfloat16, "3d", adapter_dtype=torch.float32)
    x, w, b = x.to(dev), w.to(dev), b.to(dev)
    a, bb, _ = (t.to(dev) if isinstance(t, torch.Tensor) else t for t in adapters[0])

    def step(fn):
        torch.manual_seed(0)
        leaves = [t.clone().requires_grad_() for t in (x, a, bb)]
        y = fn(leaves[0], leaves[1], leaves[2])
        y.float().square().sum().backward()
        return [y] + [t.grad for t in leaves]

    def f(x, a, bb):
        return ops.lora_linear(x, w, b, a, bb, 2.0, dropout)

    first, second = step(f), step(f)
    for p, q in zip(first, second):
        assert torch.equal(p, q)
    assert first[2].dtype == torch.float32
    if dropout == 0.0:
        compiled = step(torch.compile(f, fullgraph=True))
        for p, q in zip(first, compiled):
            torch.testing.assert_close(p.float(), q.float(), rtol=2e-2, atol=2e-2 * p.float().abs().max().item())


# lora_add: the adapters over a base output the caller computed (PEFT's bitsandbytes layers). The base here is
# F.linear in dtype, so x's gradient is the base's plus the op's and every check above applies unchanged.


def _ours_add(x, w, b, ab):
    return ops.lora_add(torch.nn.functional.linear(x, w, b), x, [a for a, _, _ in ab], [bb for _, bb, _ in ab],
                        [alpha / a.shape[0] for a, _, alpha in ab])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,bias,train_w,ranks", [("3d", True, False, (R,)), ("strided", False, True, (3, 5))])
def test_lora_add_matches_reference_and_peft(dtype, layout, bias, train_w, ranks):
    x, w, b, adapters = _inputs(dtype, layout, bias=bias, ranks=ranks)
    g = torch.randn(*x.shape[:-1], OUT, generator=torch.Generator().manual_seed(5))
    before = ops.dispatch_counts[("lora_add", "triton")] + ops.dispatch_counts[("lora_add", "reference")]
    ours = _run(_ours_add, x, w, b, adapters, g, train_w)
    ref = _run(_reference64, x, w, b, adapters, g.double(), train_w)
    _check(ours, _peft_run(x, w, b, adapters, g, train_w), ref, dtype)
    assert ops.dispatch_counts[("lora_add", "triton")] + ops.dispatch_counts[("lora_add", "reference")] == before + 1


def test_lora_add_fp32_adapters_on_bf16_match_peft():
    """PEFT's fp32 adapters on a bf16 base: the bound of test_fp32_adapters_on_bf16_base_match_peft (the same
    roundings: xa and gb once each in bf16)."""
    x, w, b, adapters = _inputs(torch.bfloat16, "3d", adapter_dtype=torch.float32, ranks=(3, 2))
    g = torch.randn(2, 5, OUT, generator=torch.Generator().manual_seed(7))
    ours = _run(_ours_add, x, w, b, adapters, g, False)
    theirs = _peft_run(x, w, b, adapters, g, False)
    for o, p in zip(ours, theirs):
        assert o.dtype == p.dtype and o.shape == p.shape
        scale = p.float().abs().max().item()
        assert (o.float() - p.float()).abs().max().item() <= 4 * 2**-8 * scale


def test_lora_add_passes_base_gradient_and_leaves_base_out_alone():
    """d base_out is the upstream gradient bit for bit; base_out is read, never written (the result is new)."""
    x, _, _, adapters = _inputs(torch.float32, "3d")
    a, bb, _ = adapters[0]
    base = torch.randn(2, 5, OUT, generator=torch.Generator().manual_seed(9)).requires_grad_()
    kept = base.detach().clone()
    y = ops.lora_add(base, x, a.requires_grad_(), bb.requires_grad_(), 2.0)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(10))
    y.backward(g)
    assert torch.equal(base.grad, g) and torch.equal(base.detach(), kept)
    assert y.data_ptr() != base.data_ptr() and x.grad is None  # x needs no gradient: no dx GEMM
    with torch.no_grad():  # the bare launcher (inference) allocates too
        y2 = ops.lora_add(base, x, a, bb, 2.0)
    assert torch.equal(base.detach(), kept) and y2.data_ptr() != base.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_add_dropout_replays_the_reference_with_the_same_mask(dtype):
    x, w, b, adapters = _inputs(dtype, "2d", ranks=(3, 4))
    ps = [0.25, 0.0]
    scal = [alpha / a.shape[0] for a, _, alpha in adapters]
    g = torch.randn(T, OUT, generator=torch.Generator().manual_seed(8))

    def ours_fn(x, w, b, ab):
        return ops.lora_add(torch.nn.functional.linear(x, w, b), x, [a for a, _, _ in ab], [bb for _, bb, _ in ab],
                            scal, ps)

    torch.manual_seed(123)
    ours = _run(ours_fn, x, w, b, adapters, g, False)
    torch.manual_seed(123)
    mask = torch.native_dropout(x, ps[0], True)[1]
    assert 0 < mask.sum() < mask.numel()

    def replay(x, w, b, ab, dt=torch.float64):
        base = torch.nn.functional.linear(x.to(dt), w.to(dt), b.to(dt))
        return reference.lora_add(base, x.to(dt), [a.to(dt) for a, _, _ in ab], [bb.to(dt) for _, bb, _ in ab], scal,
                                  ps, [mask, None])

    ref = _run(replay, x, w, b, adapters, g.double(), False)
    _check(ours, _run(lambda *a: replay(*a, dt=dtype), x, w, b, adapters, g, False), ref, dtype)


def test_lora_add_double_backward_without_dropout_and_refused_with_dropout():
    x, _, _, adapters = _inputs(torch.float32, "2d")
    a, bb, _ = adapters[0]
    base = torch.randn(T, OUT, generator=torch.Generator().manual_seed(9))
    leaves = [t.clone().requires_grad_() for t in (x, a, bb)]

    def gradnorm(fn):
        y = fn(*leaves)
        ga, = torch.autograd.grad((y * y).sum(), leaves[1], create_graph=True)
        return torch.autograd.grad(ga.square().sum(), leaves)

    ours = gradnorm(lambda x, a, bb: ops.lora_add(base, x, a, bb, 2.0))
    ref = gradnorm(lambda x, a, bb: reference.lora_add(base, x, [a], [bb], [2.0]))
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the op's own path, as in the lora_linear test
    a_dev = a.detach().to(dev).requires_grad_()
    y = ops.lora_add(base.to(dev), x.to(dev), a_dev, bb.to(dev), 2.0, 0.5)
    with pytest.raises(NotImplementedError, match="lora_add"):
        torch.autograd.grad(y.sum(), a_dev, create_graph=True)


@pytest.mark.parametrize("case,exc,match", [
    ("base_shape", ValueError, r"base_out must be \[11, out\]"),
    ("base_dtype", TypeError, "base_out has dtype torch.bfloat16 but x has dtype torch.float32"),
    ("b_shape", ValueError, r"lora_b must be \[53, 3\]"),
    ("none", ValueError, "needs at least one adapter"),
    ("scaling", ValueError, "scaling must be a finite number"),
    ("dropout", ValueError, r"dropout_p must be in \[0, 1\)"),
    ("base_int", TypeError, "base_out must be float32"),
])
@pytest.mark.parametrize("kernels", ["1", "0"], ids=["kernel_path", "reference_path"])
def test_lora_add_bad_input(monkeypatch, case, exc, match, kernels):
    """The same error on both paths (TRITON_INTERPRET=0 on a CPU runs the reference): the checks come first."""
    monkeypatch.setenv("TRITON_INTERPRET", kernels)
    x, _, _, adapters = _inputs(torch.float32, "2d")
    a, bb, _ = adapters[0]
    args = dict(base_out=torch.zeros(T, OUT), x=x, lora_a=a, lora_b=bb, scaling=2.0, dropout_p=0.0)
    if case == "base_shape":
        args["base_out"] = torch.zeros(T + 1, OUT)
    elif case == "base_dtype":
        args["base_out"] = torch.zeros(T, OUT, dtype=torch.bfloat16)
    elif case == "b_shape":
        args["lora_b"] = bb[:5]
    elif case == "none":
        args.update(lora_a=[], lora_b=[])
    elif case == "scaling":
        args["scaling"] = float("nan")
    elif case == "dropout":
        args["dropout_p"] = 1.0
    elif case == "base_int":
        args["base_out"] = torch.zeros(T, OUT, dtype=torch.long)
    with pytest.raises(exc, match=f"tigon.ops.lora_add: {match}"):
        ops.lora_add(**args)


def test_lora_add_opcheck_and_compile_fullgraph():
    x, _, _, adapters = _inputs(torch.float32, "3d", ranks=(3, 2))
    As = [a.clone().requires_grad_() for a, _, _ in adapters]
    Bs = [bb.clone().requires_grad_() for _, bb, _ in adapters]
    base = torch.randn(2, 5, OUT, generator=torch.Generator().manual_seed(9))
    x2, base2 = x.reshape(-1, IN), base.reshape(-1, OUT)
    torch.library.opcheck(torch.ops.tigon.lora_add_fwd, (base2.requires_grad_(), x2, As, Bs, [2.0, 0.5], [0.0, 0.0]))
    out, xas, dropped, masks = torch.ops.tigon.lora_add_fwd(base2.detach(), x2, As, Bs, [2.0, 0.5], [0.0, 0.0])
    torch.library.opcheck(torch.ops.tigon.lora_add_bwd,
                          (torch.randn_like(out), x2, [a.detach() for a in As], [bb.detach() for bb in Bs], xas,
                           dropped, masks, [2.0, 0.5], [0.0, 0.0], True, [True, True]))

    def f(base, x, a, bb):
        return ops.lora_add(base, x, a, bb, 2.0)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [t.detach().clone().requires_grad_() for t in (base, x, As[0], Bs[0])]
    eager = [t.detach().clone().requires_grad_() for t in (base, x, As[0], Bs[0])]
    y, ye = compiled(*leaves), f(*eager)
    y.square().sum().backward()
    ye.square().sum().backward()
    torch.testing.assert_close(y, ye)
    for c, e in zip(leaves, eager):
        torch.testing.assert_close(c.grad, e.grad)
    assert torch._dynamo.explain(f)(*leaves).graph_break_count == 0
