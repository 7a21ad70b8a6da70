"""tigon.ops.moe_combine and moe_permute against the fp64 reference: forward and every gradient.

Error model (the inputs are the same dtype-rounded tensors on both sides, so only the op's own roundings count):
combine's out[t] is a sum of K products w * y, computed in fp32 and rounded once to the dtype, so
|out - ref| <= u(dtype) |ref| + (1 + u(dtype)) e32 with e32 = u32 (8 sqrt(K) + 4) sum_k |w y| (tests/_grid.py);
dy = w * dout is one fp32 product and one rounding; dw[t, k] = <y, dout> is a sum of H products, rounded to
weights.dtype. permute is a copy (exact) and its gradient a sum of K terms. Triton's interpreter casts fp32 to
bf16/fp16 by truncation (a GPU rounds to nearest): there one cast is within 2 u |ref|, not u |ref|.
"""

import pytest
import torch

from tests._grid import U32, UNIT_ROUNDOFF, sum_ulps
from tigon import ops
from tigon.ops import moe, reference


def _bound(name, got, ref, terms_abs, k, dtype):
    e32 = U32 * (sum_ulps(k) + 4) * terms_abs
    cast = UNIT_ROUNDOFF[dtype] * (1 if got.device.type == "cuda" else 2)
    tol = cast * ref.abs() + (1 + cast) * e32 + 1e-30
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    bad = (got.double() - ref).abs() > tol
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, worst {((got.double() - ref).abs() - tol).max():.3e}"


def _routing(T, K, E, seed, device, index_dtype=torch.int64):
    """pos [T, K] of a stable sort of random expert ids among E (with E > K * T / 2 some experts get no token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
    _, perm = torch.sort(ids.reshape(-1), stable=True)
    pos = torch.empty_like(perm)
    pos[perm] = torch.arange(T * K)
    return pos.view(T, K).to(device=device, dtype=index_dtype), ids


def _inputs(T, K, H, dtype, w_dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(T * K, H, generator=g).to(device=device, dtype=dtype)
    w = torch.rand(T, K, generator=g).to(device=device, dtype=w_dtype)
    dout = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    return y, w, dout


def _check_combine(y, w, pos, dout, n_rows=None):
    dtype = y.dtype
    yk, wk = y.clone().requires_grad_(), w.clone().requires_grad_()
    out = ops.moe_combine(yk, wk, pos, n_rows)
    dy, dw = torch.autograd.grad(out, (yk, wk), dout)
    yd, wd = y.double().requires_grad_(), w.double().requires_grad_()
    ref = reference.moe_combine(yd, wd, pos, n_rows)
    ry, rw = torch.autograd.grad(ref, (yd, wd), dout.double())
    T, K = pos.shape
    valid = reference._moe_valid(pos, n_rows).view(T, K, 1)
    rows = torch.where(valid, y.double()[pos.reshape(-1).long()].view(T, K, -1), 0.0)
    terms = (rows * w.double()[..., None]).abs().sum(1)
    _bound("out", out, ref.detach(), terms, K, dtype)
    _bound("dy", dy, ry, torch.zeros_like(ry), 1, dtype)  # one product, one rounding
    _bound("dw", dw, rw, (rows * dout.double()[:, None, :]).abs().sum(-1), y.shape[1], w.dtype)
    return out, dy, dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K,H,E", [(1, 1, 1, 1), (5, 1, 37, 3), (7, 3, 70, 16), (4, 8, 33, 128)])
def test_combine(device, dtype, T, K, H, E):
    pos, _ = _routing(T, K, E, seed=T + K + H, device=device)
    y, w, dout = _inputs(T, K, H, dtype, dtype, device)
    _check_combine(y, w, pos, dout)


def test_combine_row_chunks_int32_pos_and_fp32_weights(device, monkeypatch):
    monkeypatch.setattr(moe, "_MAX_BLOCK_H", 16)  # 70 columns: five chunks, the last one masked
    pos, _ = _routing(6, 4, 9, seed=3, device=device, index_dtype=torch.int32)
    y, w, dout = _inputs(6, 4, 70, torch.bfloat16, torch.float32, device, seed=1)
    out, dy, dw = _check_combine(y, w, pos, dout)
    assert out.dtype == dy.dtype == torch.bfloat16 and dw.dtype == torch.float32


def test_rows_past_n_rows_are_not_routed(device):
    # The sentinel tail: its rows of y are garbage (NaN) and must neither reach out nor get a gradient.
    T, K, H = 5, 3, 24
    pos, _ = _routing(T, K, 6, seed=5, device=device)
    y, w, dout = _inputs(T, K, H, torch.float32, torch.float32, device, seed=2)
    n = T * K - 4
    y[n:] = float("nan")
    n_rows = torch.tensor([n], dtype=torch.int32, device=device)
    out, dy, dw = _check_combine(torch.where(torch.arange(T * K, device=device)[:, None] < n, y, 0.0), w, pos, dout,
                                 n_rows)
    yk, wk = y.clone().requires_grad_(), w.clone().requires_grad_()
    out2 = ops.moe_combine(yk, wk, pos, n_rows)
    dy2, dw2 = torch.autograd.grad(out2, (yk, wk), dout)
    assert torch.equal(out2, out) and torch.equal(dy2, dy) and torch.equal(dw2, dw)
    assert (dy2[n:] == 0).all() and (dw2.view(-1)[(pos.view(-1) >= n)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_without_weights_and_weights_without_grad(device, dtype):
    pos, _ = _routing(6, 2, 5, seed=7, device=device)
    y, w, dout = _inputs(6, 2, 19, dtype, dtype, device, seed=3)
    yk = y.clone().requires_grad_()
    out = ops.moe_combine(yk, None, pos)
    (dy,) = torch.autograd.grad(out, yk, dout)
    ref = reference.moe_combine(y.double(), None, pos)
    _bound("out", out, ref, y.double()[pos.reshape(-1)].view(6, 2, -1).abs().sum(1), 2, dtype)
    assert torch.equal(dy, torch.repeat_interleave(dout, 2, 0)[torch.argsort(pos.reshape(-1))])
    yk = y.clone().requires_grad_()
    (dy,) = torch.autograd.grad(ops.moe_combine(yk, w, pos), yk, dout)  # the weight-free scatter path
    want = (w.double().reshape(-1, 1) * dout.double().repeat_interleave(2, 0))[torch.argsort(pos.reshape(-1))]
    _bound("dy", dy, want, torch.zeros_like(want), 1, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute(device, dtype):
    T, K, H = 7, 3, 45
    pos, _ = _routing(T, K, 10, seed=9, device=device)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype).requires_grad_()
    dxg = torch.randn(T * K, H, generator=g).to(device=device, dtype=dtype)
    n_rows = torch.tensor([T * K - 2], device=device)
    for n in (None, n_rows):
        xg = ops.moe_permute(x, pos, n)
        assert torch.equal(xg, reference.moe_permute(x.detach(), pos, n))  # a copy: exact
        (dx,) = torch.autograd.grad(xg, x, dxg)
        ref = reference.moe_combine(dxg.double(), None, pos, n)
        _bound("dx", dx, ref, reference.moe_combine(dxg.double().abs(), None, pos, n), K, dtype)
    assert (xg[T * K - 2:] == 0).all()


def test_double_backward_matches_the_reference(device):
    # create_graph=True (a gradient penalty): the second derivatives through combine and permute are the reference's
    pos, _ = _routing(4, 2, 5, seed=11, device=device)
    y, w, dout = _inputs(4, 2, 9, torch.float32, torch.float32, device, seed=5)
    x = torch.randn(4, 9, device=device)

    def second(combine, permute):
        leaves = [t.clone().requires_grad_() for t in (y, w, x)]
        out = combine(leaves[0] + permute(leaves[2], pos), leaves[1], pos)
        grads = torch.autograd.grad(out, leaves, dout, create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)

    for a, b in zip(second(ops.moe_combine, ops.moe_permute), second(reference.moe_combine, reference.moe_permute)):
        torch.testing.assert_close(a, b)


def test_empty(device):
    pos = torch.zeros(0, 3, dtype=torch.long, device=device)
    y = torch.zeros(0, 8, device=device, requires_grad=True)
    w = torch.zeros(0, 3, device=device, requires_grad=True)
    out = ops.moe_combine(y, w, pos)
    assert out.shape == (0, 8)
    assert [g.shape for g in torch.autograd.grad(out.sum(), (y, w))] == [(0, 8), (0, 3)]
    assert ops.moe_permute(torch.zeros(0, 8, device=device), pos).shape == (0, 8)


def test_runs_the_kernel_on_this_device(device):
    pos, _ = _routing(2, 2, 3, seed=0, device=device)
    before = ops.dispatch_counts[("moe_combine", "triton")], ops.dispatch_counts[("moe_permute", "triton")]
    ops.moe_combine(torch.ones(4, 3, device=device), None, pos)
    ops.moe_permute(torch.ones(2, 3, device=device), pos)
    after = ops.dispatch_counts[("moe_combine", "triton")], ops.dispatch_counts[("moe_permute", "triton")]
    assert after == (before[0] + 1, before[1] + 1)


def _pos(device, T=2, K=2):
    return _routing(T, K, 3, seed=0, device=device)[0]


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda d: ops.moe_combine(torch.ones(4, 3, dtype=torch.long, device=d), None, _pos(d)), TypeError, "y must"),
        (lambda d: ops.moe_combine(torch.ones(4, device=d), None, _pos(d)), ValueError, "y must be 2-D"),
        (lambda d: ops.moe_combine(torch.ones(5, 3, device=d), None, _pos(d)), ValueError, "T \\* K = 4 rows"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), None, _pos(d).float()), TypeError, "pos must be an int"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), None, _pos(d).view(-1)), ValueError, "pos must be 2-D"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), torch.ones(2, 3, device=d), _pos(d)), ValueError,
         "weights must have shape"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), torch.ones(2, 2, dtype=torch.long, device=d),
                                   _pos(d)), TypeError, "weights must be float"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), None, _pos(d), 3), TypeError, "n_rows must be None"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), None, _pos(d), torch.tensor([1, 2], device=d)),
         TypeError, "n_rows"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), None, torch.zeros(2, 2, dtype=torch.long, device=d)),
         ValueError, "permutation"),
        (lambda d: ops.moe_combine(torch.ones(4, 3, device=d), None, _pos(d) + 1), ValueError, "permutation"),
        (lambda d: ops.moe_permute(torch.ones(3, 3, device=d), _pos(d)), ValueError, "x must have T = 2 rows"),
        (lambda d: ops.moe_permute([1.0], _pos(d)), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_bad_input(device, call, exc, match):
    if torch.device(device).type == "cuda" and match == "permutation":
        # data-dependent, so checked on CPU (or with TIGON_VALIDATE=1) only; on CUDA the kernels skip ids outside
        # [0, S): no illegal access, whatever pos holds
        call(device)
        torch.cuda.synchronize()
        return
    with pytest.raises(exc, match=match):
        call(device)


def test_opcheck(device):
    pos, _ = _routing(3, 2, 4, seed=1, device=device)
    y, w, dout = _inputs(3, 2, 5, torch.float32, torch.float32, device)
    n_rows = torch.tensor([5], device=device)
    for n in (None, n_rows):
        torch.library.opcheck(torch.ops.tigon.moe_combine, (y.clone().requires_grad_(), w.clone().requires_grad_(),
                                                            pos, n))
        torch.library.opcheck(torch.ops.tigon.moe_combine, (y.clone().requires_grad_(), None, pos, n))
        torch.library.opcheck(torch.ops.tigon.moe_scatter, (dout.clone().requires_grad_(), None, pos, n))
        torch.library.opcheck(torch.ops.tigon.moe_combine_bwd, (dout, y, w, pos, n))


def test_compile_fullgraph(device):
    pos, _ = _routing(5, 2, 4, seed=2, device=device)
    x = torch.randn(5, 8, device=device, requires_grad=True)
    w = torch.rand(5, 2, device=device, requires_grad=True)
    lin = torch.randn(8, 8, device=device, requires_grad=True)
    n_rows = torch.tensor([9], device=device)

    def f(x, w, lin):
        return ops.moe_combine(ops.moe_permute(x, pos, n_rows) @ lin, w, pos, n_rows)

    go = torch.randn(5, 8, device=device)
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, lin), (x, w, lin), go)
    want = torch.autograd.grad(f(x, w, lin), (x, w, lin), go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_qwen3_moe_shape_bound_and_determinism():
    T, K, H, E = 8192, 8, 2048, 128
    pos, _ = _routing(T, K, E, seed=0, device="cuda")
    y, w, dout = _inputs(T, K, H, torch.bfloat16, torch.bfloat16, "cuda")
    first = _check_combine(y, w, pos, dout)
    second = _check_combine(y, w, pos, dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
