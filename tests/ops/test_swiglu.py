import sys

import pytest
import torch

from tests._grid import DTYPES, assert_bound, fp64_copy, grads, randn
from tigon import ops
from tigon.ops import _launch, reference
from tigon.ops.config import GLUConfig
from tigon.ops.swiglu import geglu_packed, swiglu_packed

glu_mod = sys.modules["tigon.ops.swiglu"]  # `tigon.ops.swiglu` the attribute is the function

SIZES = [1, 7, 200, 1000, 4097]
ACTS = {
    "swiglu": (ops.swiglu, swiglu_packed, reference.swiglu, reference.eager_swiglu),
    "geglu": (ops.geglu, geglu_packed, reference.geglu, reference.eager_geglu),
}


def _check(name, kernel_fn, ref_fn, eager_fn, inputs, dtype):
    """Forward and every gradient: kernel vs fp64 reference vs the HF formula in dtype."""
    out = kernel_fn(*inputs)
    ref_in = fp64_copy(*inputs)
    ref = ref_fn(*ref_in)
    eager_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eag = eager_fn(*eager_in)
    assert out.dtype == eag.dtype
    assert_bound(f"{name} out", out, eag, ref, dtype)
    go = torch.randn(out.shape, device=out.device).to(out.dtype)
    g_k = grads(out, inputs, go)
    g_r = grads(ref, ref_in, go.double())
    g_e = grads(eag, eager_in, go)
    for j, (a, b, c) in enumerate(zip(g_k, g_e, g_r)):
        assert_bound(f"{name} grad{j}", a, b, c, dtype)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("act", ACTS)
def test_glu(device, dtype, size, act):
    torch.manual_seed(size)
    fn, _, ref_fn, eager_fn = ACTS[act]
    # scale 4 reaches both tails of the activations (|gate| up to ~16 over 3 * 4097 draws)
    gate = randn(3, size, dtype=dtype, device=device, requires_grad=True, scale=4.0)
    up = randn(3, size, dtype=dtype, device=device, requires_grad=True)
    _check(act, fn, ref_fn, eager_fn, (gate, up), dtype)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("inplace", [False, True])
def test_chunked_halves_of_a_fused_projection(device, act, inplace):
    # Phi3MLP: gate, up = gate_up.chunk(2, -1); each half is a [.., I] view with row stride 2I.
    fn, packed_fn, ref_fn, eager_fn = ACTS[act]
    torch.manual_seed(0)
    dtype = torch.bfloat16
    gate_up_leaf = randn(2, 3, 2 * 37, dtype=dtype, device=device, requires_grad=True, scale=3.0)
    gate_up = gate_up_leaf * 1.0  # not a leaf: inplace_backward may take effect
    gate, up = gate_up.chunk(2, dim=-1)
    assert gate.stride() == (3 * 74, 74, 1) and _launch.as_rows(gate).data_ptr() == gate.data_ptr()
    _check(act, lambda g, u: fn(g, u, inplace_backward=inplace), ref_fn, eager_fn, (gate, up), dtype)
    # the packed form: one [.., 2I] input and one [.., 2I] gradient, same values as the chunked pair
    gate_up = gate_up_leaf * 1.0  # the in-place backward above left the gradients in the old one
    y = packed_fn(gate_up, inplace_backward=inplace)
    y_ref = fn(*gate_up_leaf.detach().chunk(2, -1))
    assert torch.equal(y, y_ref)
    go = torch.randn(y.shape, device=y.device).to(dtype)
    (d_packed,) = torch.autograd.grad(y, gate_up_leaf, go)
    g_leaf = gate_up_leaf.detach().clone().requires_grad_(True)
    (d_pair,) = torch.autograd.grad(fn(*(g_leaf * 1.0).chunk(2, -1)), g_leaf, go)
    assert torch.equal(d_packed, d_pair)


def test_non_contiguous_views(device):
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        # transposed (copied to unit last stride) and a row slice (row stride 2 * 33, read in place)
        gate = randn(2, 5, 33, dtype=dtype, device=device, transposed=True, requires_grad=True, scale=3.0)
        up = randn(2, 10, 33, dtype=dtype, device=device, requires_grad=True)[:, ::2]
        assert not gate.is_contiguous() and not up.is_contiguous()
        _check("swiglu", ops.swiglu, reference.swiglu, reference.eager_swiglu, (gate, up), dtype)


def test_expanded_output_gradient(device):
    # y.sum() hands back dy with strides (0, 0): the backward must read it without assuming a layout
    gate, up = _leaves(randn(4, 9, device=device), randn(4, 9, device=device))
    ops.geglu(gate, up).sum().backward()
    g64, u64 = fp64_copy(gate, up)
    reference.geglu(g64, u64).sum().backward()
    torch.testing.assert_close(gate.grad.double(), g64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(up.grad.double(), u64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("contiguous", [True, False])
def test_many_tiles(device, monkeypatch, contiguous):
    # Small tiles, so the tile index math and both masks are exercised at odd sizes (the CPU default
    # covers a whole test case with one tile).
    monkeypatch.setattr(glu_mod, "_tiles", lambda dev, eb, rows, cols, config=None: (2, 16, 1))
    torch.manual_seed(2)
    gate_up = randn(5, 2 * 37, device=device, scale=3.0)
    gate, up = (t.contiguous() for t in gate_up.chunk(2, -1)) if contiguous else gate_up.chunk(2, -1)
    gate, up = _leaves(gate, up)
    _check("geglu", ops.geglu, reference.geglu, reference.eager_geglu, (gate, up), torch.float32)


def test_gpu_tile_heuristic():
    # Pure arithmetic (no GPU needed), at pinned settings: whole-tile widths at Llama shapes, at most 1/16 of
    # a row wasted.
    cfg = GLUConfig(tile_bytes=4096, num_warps=4).ints()
    cuda = torch.device("cuda")
    assert glu_mod._tiles(cuda, 2, 16384, 14336, cfg) == (1, 2048, 4)
    assert glu_mod._tiles(cuda, 2, 16384, 11008, cfg) == (2, 1024, 4)
    assert glu_mod._tiles(cuda, 4, 16384, 14336, cfg) == (1, 1024, 4)
    assert glu_mod._tiles(cuda, 2, 1, 16384 * 14336, cfg) == (1, 2048, 4)  # contiguous: one flat row
    # A flat row's tiles do not follow its length (M * I, M a prefill's prompt length: a new BLOCK_N would compile
    # the kernel again at a new prompt length)
    assert {glu_mod._tiles(cuda, 2, 1, m * 96, cfg) for m in range(22, 600)} == {(1, 2048, 4)}
    assert glu_mod._tiles(cuda, 2, 3, 7, cfg) == (4, 8, 4)
    for cols in (1, 7, 200, 1000, 4097, 11008, 14336, 28672):
        bm, bn, _ = glu_mod._tiles(cuda, 2, 16384, cols, cfg)
        assert bm * bn <= 2048 and (bn <= 128 or -(-cols // bn) * bn * 16 <= cols * 17)
    # The defaults are these settings, and a config changes the tiles it names.
    assert glu_mod._tiles(cuda, 2, 16384, 14336) == (1, 2048, 4)
    assert glu_mod._tiles(cuda, 2, 16384, 14336, GLUConfig(tile_bytes=16384, num_warps=8).ints()) == (4, 2048, 8)


@pytest.mark.parametrize("packed", [False, True])
def test_config_reaches_the_kernel(device, packed, monkeypatch):
    # A config with 32-element CPU tiles runs many programs (the default: one); an elementwise op gives the same
    # bits for every tiling, forward and both gradients, and a bad config is a TypeError naming the op.
    seen, tiles = [], glu_mod._tiles
    monkeypatch.setattr(glu_mod, "_tiles", lambda *a: seen.append(a[4] if len(a) > 4 else None) or tiles(*a))
    torch.manual_seed(3)
    gate_up = randn(5, 2 * 37, device=device, scale=3.0)
    outs = []
    for cfg in (None, GLUConfig(cpu_tile=32)):
        x = gate_up.clone().requires_grad_()
        y = swiglu_packed(x, config=cfg) if packed else ops.swiglu(*x.chunk(2, -1), config=cfg)
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        outs.append((y, dx))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert seen == [None, None] + [GLUConfig(cpu_tile=32).ints()] * 2  # forward and backward launches
    with pytest.raises(TypeError, match="swiglu: config must be"):
        ops.swiglu(gate_up[:, :37], gate_up[:, 37:], config={"cpu_tile": 32})


def _grad_ptrs(t):
    """Record the data pointer of the gradient that reaches t (its storage tells in-place from not)."""
    seen = []
    t.register_hook(lambda g: seen.append(g.data_ptr()))
    return seen


@pytest.mark.parametrize("act", ACTS)
def test_inplace_backward_writes_over_gate_and_up(device, act):
    fn = ACTS[act][0]
    torch.manual_seed(3)
    x, w1, w2 = _leaves(randn(2, 6, 8, device=device), randn(8, 24, device=device), randn(8, 24, device=device))
    go = torch.randn(2, 6, 24, device=device)
    want = torch.autograd.grad(fn(x @ w1, x @ w2), (x, w1, w2), go)
    gate, up = x @ w1, x @ w2
    p_gate, p_up = _grad_ptrs(gate), _grad_ptrs(up)
    got = torch.autograd.grad(fn(gate, up, inplace_backward=True), (x, w1, w2), go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert p_gate == [gate.data_ptr()] and p_up == [up.data_ptr()]  # no new memory for dgate, dup


def test_inplace_backward_packed_returns_gate_up_storage(device):
    x, w = _leaves(randn(5, 8, device=device), randn(8, 2 * 12, device=device))
    gate_up = x @ w
    seen = _grad_ptrs(gate_up)
    swiglu_packed(gate_up, inplace_backward=True).sum().backward()
    assert seen == [gate_up.data_ptr()]


def test_default_mode_is_right_when_gate_feeds_another_branch(device):
    # gate also feeds a branch that saved it (sin), used before and after the op: only the default
    # (out-of-place) backward is right for every order, and it is.
    torch.manual_seed(4)
    x, w1, w2 = _leaves(randn(4, 8, device=device), randn(8, 16, device=device), randn(8, 16, device=device))

    def loss(fn, x, w1, w2):
        gate, up = x @ w1, x @ w2
        before = gate.sin()
        y = fn(gate, up)
        return (y * before).sum() + gate.cos().sum() + fn(gate, gate).sum()

    got = torch.autograd.grad(loss(ops.swiglu, x, w1, w2), (x, w1, w2))
    x64, w164, w264 = fp64_copy(x, w1, w2)
    want = torch.autograd.grad(loss(reference.swiglu, x64, w164, w264), (x64, w164, w264))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_inplace_backward_misuse_fails_loudly(device):
    # A branch that saved gate and runs its backward after the op would read dgate: autograd's version
    # counter catches it instead of returning wrong gradients.
    x, w1, w2 = _leaves(randn(4, 8, device=device), randn(8, 16, device=device), randn(8, 16, device=device))
    gate, up = x @ w1, x @ w2
    other = gate.sin()  # saves gate; its node is older, so it runs after the op's backward
    loss = ops.swiglu(gate, up, inplace_backward=True).sum() + other.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    # so does a second backward through the same graph
    gate, up = x @ w1, x @ w2
    y = ops.swiglu(gate, up, inplace_backward=True).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_inplace_backward_is_ignored_where_unsafe(device):
    # Leaves (and views of leaves) and overlapping gate/up keep the out-of-place backward.
    torch.manual_seed(5)
    gate, up = _leaves(randn(3, 16, device=device), randn(3, 16, device=device))
    kept = gate.detach().clone(), up.detach().clone()
    go = torch.randn(3, 16, device=device)
    d = torch.autograd.grad(ops.swiglu(gate, up, inplace_backward=True), (gate, up), go)
    d_ref = torch.autograd.grad(ops.swiglu(gate, up), (gate, up), go)
    assert torch.equal(gate, kept[0]) and torch.equal(up, kept[1])
    assert all(torch.equal(a, b) for a, b in zip(d, d_ref))
    assert d[0].data_ptr() != gate.data_ptr() and d[1].data_ptr() != up.data_ptr()
    # the same non-leaf tensor as gate and up
    (x,) = _leaves(randn(3, 16, device=device))
    h = x * 2.0
    (dx,) = torch.autograd.grad(ops.swiglu(h, h, inplace_backward=True), x, go)
    (dx_ref,) = torch.autograd.grad(ops.swiglu(x * 2.0, x * 2.0), x, go)
    assert torch.equal(dx, dx_ref)
    # overlapping rows of one buffer (up starts 3 columns into gate)
    buf = x.repeat(1, 2) * 1.0
    g, u = buf[:, :16], buf[:, 3:19]
    (dx,) = torch.autograd.grad(ops.swiglu(g, u, inplace_backward=True), x, go)
    buf2 = x.repeat(1, 2) * 1.0
    (dx_ref,) = torch.autograd.grad(ops.swiglu(buf2[:, :16], buf2[:, 3:19]), x, go)
    assert torch.equal(dx, dx_ref)


@pytest.mark.parametrize(
    "a,b,apart",
    [
        ((slice(None), slice(0, 8)), (slice(None), slice(8, 16)), True),  # chunked halves
        ((slice(None), slice(8, 16)), (slice(None), slice(0, 8)), True),
        ((slice(None), slice(0, 8)), (slice(None), slice(4, 12)), False),
        ((slice(0, 2), slice(0, 8)), (slice(2, 4), slice(0, 8)), True),  # row blocks
        ((slice(0, 3), slice(0, 8)), (slice(2, 5), slice(0, 8)), False),
        ((slice(0, 1), slice(0, 8)), (slice(1, 2), slice(4, 12)), True),
    ],
)
def test_overlap_rule(a, b, apart):
    buf = torch.zeros(5, 16)
    assert glu_mod._apart(buf[a], buf[b]) is apart
    assert glu_mod._apart(torch.zeros(2, 8), torch.zeros(2, 8))


def test_runs_the_kernel_on_this_device(device):
    x = torch.randn(2, 8, device=device)
    for name, fn in (("swiglu", ops.swiglu), ("geglu", ops.geglu), ("swiglu", swiglu_packed)):
        before = ops.dispatch_counts[(name, "triton")]
        fn(x, x) if fn is not swiglu_packed else fn(x)
        assert ops.dispatch_counts[(name, "triton")] == before + 1


def test_empty(device):
    for shape in ((0, 16), (4, 0), (2, 0, 3)):
        gate, up = _leaves(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
        y = ops.swiglu(gate, up, inplace_backward=True)
        assert y.shape == shape
        y.sum().backward()
        assert gate.grad.shape == shape and up.grad.shape == shape


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda d: ops.swiglu(torch.ones(2, 4, device=d), torch.ones(2, 5, device=d)), ValueError, "swiglu: up"),
        (lambda d: ops.geglu(torch.ones(2, 4, device=d), torch.ones(2, 4, dtype=torch.half, device=d)),
         TypeError, "geglu: up"),
        (lambda d: ops.swiglu(torch.ones(2, 4, dtype=torch.long, device=d), torch.ones(2, 4, device=d)),
         TypeError, "gate"),
        (lambda d: ops.swiglu(torch.ones(2, 4, device=d), [1.0]), TypeError, "up"),
        (lambda d: ops.swiglu(torch.tensor(1.0, device=d), torch.ones(1, device=d)), ValueError, "up must have shape"),
        (lambda d: ops.swiglu(torch.ones(4, device=d), torch.ones(4, device=d), inplace_backward=1),
         TypeError, "inplace_backward"),
        (lambda d: swiglu_packed(torch.ones(2, 5, device=d)), ValueError, "gate_up"),
    ],
)
def test_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=match):
        call(device)


def test_opcheck(device):
    g = randn(3, 7, device=device, requires_grad=True)
    u = randn(3, 14, device=device)[:, ::2].contiguous().requires_grad_()
    gu = randn(3, 14, device=device, requires_grad=True)
    dy = randn(3, 7, device=device)
    for act in (0, 1):
        torch.library.opcheck(torch.ops.tigon.glu_fwd, (g, u, act, False))
        torch.library.opcheck(torch.ops.tigon.glu_fwd, (gu, None, act, True))
        # the backward ops are not differentiable: inputs without grad
        torch.library.opcheck(torch.ops.tigon.glu_bwd, (dy, g.detach(), u.detach(), act))
        torch.library.opcheck(torch.ops.tigon.glu_bwd, (dy, gu.detach(), None, act))
        torch.library.opcheck(torch.ops.tigon.glu_bwd_inplace, (dy, g.detach().clone(), u.detach().clone(), act))
        torch.library.opcheck(torch.ops.tigon.glu_bwd_inplace, (dy, gu.detach().clone(), None, act))


def test_compile_aot_eager_with_inplace_backward(device):
    # fullgraph: the ops are single graph nodes; the in-place backward becomes a functionalized mutation
    # of two intermediates of the joint graph (inductor re-inplaces it)
    torch.manual_seed(6)
    x, w1, w2 = _leaves(randn(4, 8, device=device), randn(8, 16, device=device), randn(8, 16, device=device))

    def f(x, w1, w2):
        gate_up = x @ torch.cat([w1, w2], 1)
        return ops.swiglu(x @ w1, x @ w2, inplace_backward=True) + swiglu_packed(gate_up, inplace_backward=True)

    go = torch.randn(4, 16, device=device)
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w1, w2), (x, w1, w2), go)
    want = torch.autograd.grad(f(x, w1, w2), (x, w1, w2), go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# GPU only: Llama-3-8B MLP shapes (16384 tokens, I = 14336) in bf16.

M_GPU, I_GPU = 16384, 14336


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_gpu_llama3_shape_bound_and_determinism(act):
    fn, _, ref_fn, eager_fn = ACTS[act]
    torch.manual_seed(0)
    gate, up = _leaves(randn(4096, I_GPU, dtype=torch.bfloat16, device="cuda", scale=3.0),
                       randn(4096, I_GPU, dtype=torch.bfloat16, device="cuda"))
    _check(act, fn, ref_fn, eager_fn, (gate, up), torch.bfloat16)
    go = torch.randn(gate.shape, device="cuda").bfloat16()
    runs = []
    for _ in range(2):
        y = fn(gate, up)
        runs.append((y, *torch.autograd.grad(y, (gate, up), go)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.gpu
def test_gpu_compile_fullgraph_and_no_host_sync():
    torch.manual_seed(0)
    x, w1, w2 = _leaves(randn(2, 1024, 4096, dtype=torch.bfloat16, device="cuda"),
                        randn(4096, I_GPU, dtype=torch.bfloat16, device="cuda", scale=0.02),
                        randn(4096, I_GPU, dtype=torch.bfloat16, device="cuda", scale=0.02))

    def f(x, w1, w2):
        return ops.swiglu(x @ w1, x @ w2, inplace_backward=True)

    cf = torch.compile(f, fullgraph=True)
    go = torch.randn(2, 1024, I_GPU, device="cuda").bfloat16()
    want = torch.autograd.grad(f(x, w1, w2), (x, w1, w2), go)
    got = torch.autograd.grad(cf(x, w1, w2), (x, w1, w2), go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    gate, up = _leaves(randn(M_GPU, I_GPU, dtype=torch.bfloat16, device="cuda"),
                       randn(M_GPU, I_GPU, dtype=torch.bfloat16, device="cuda"))
    dy = torch.randn(M_GPU, I_GPU, device="cuda").bfloat16()
    for fn in (ops.swiglu, ops.geglu):  # warm up: compile the kernels outside the sync check
        torch.autograd.grad(fn(gate * 1, up * 1, inplace_backward=True), (gate, up), dy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for fn in (ops.swiglu, ops.geglu):
            torch.autograd.grad(fn(gate * 1, up * 1, inplace_backward=True), (gate, up), dy)
            torch.autograd.grad(swiglu_packed(torch.cat([gate, up], 1) * 1, inplace_backward=True),
                                (gate, up), dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_gpu_inplace_backward_memory_is_the_output_only():
    # [16384, 14336] bf16 = 448 MiB per activation: fwd + bwd may add the output and nothing else
    gate = torch.randn(M_GPU, I_GPU, device="cuda", dtype=torch.bfloat16).requires_grad_()
    up = torch.randn(M_GPU, I_GPU, device="cuda", dtype=torch.bfloat16).requires_grad_()
    g, u = gate * 1, up * 1  # non-leaf activations, as a projection would give
    dy = torch.randn(M_GPU, I_GPU, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = ops.swiglu(g, u, inplace_backward=True)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    torch.cuda.synchronize()
    assert dg.data_ptr() == g.data_ptr() and du.data_ptr() == u.data_ptr()
    assert torch.cuda.max_memory_allocated() - base <= M_GPU * I_GPU * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu_rows_is_the_public_op_without_its_checks(device, dtype, activation):
    # The unchecked row entry of the decode wing's prefill: the public ops' kernel and launch, so their bits,
    # for separate gate / up and for a packed [M, 2I] gate_up.
    from tigon.ops.swiglu import glu_rows

    g, u = randn(21, 70, dtype=dtype, device=device), randn(21, 70, dtype=dtype, device=device)
    public, packed = (ops.swiglu, swiglu_packed) if activation == "silu" else (ops.geglu, geglu_packed)
    assert torch.equal(glu_rows(g, u, activation), public(g, u))
    gu = torch.cat((g, u), dim=-1)
    assert torch.equal(glu_rows(gu, None, activation), packed(gu))
