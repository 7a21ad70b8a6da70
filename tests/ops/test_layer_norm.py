import pytest
import torch

from tests._grid import DTYPES, assert_bound, assert_no_sync_and_deterministic, fp64_copy, grads, randn
from tigon import ops
from tigon.ops import reference

HIDDEN = [1, 7, 200, 1000, 4097]
AFFINE = [(True, True), (True, False), (False, True), (False, False)]


def _check(inputs, dtype, eps=1e-5, eager_fn=None):
    """Forward and every gradient: kernel vs fp64 reference vs torch in dtype (F.layer_norm by default)."""
    eager_fn = eager_fn or (lambda x, w, b: reference.eager_layer_norm(x, w, b, eps))
    y = ops.layer_norm(*inputs, eps)
    ref_in = fp64_copy(*inputs)
    ref = reference.layer_norm(*ref_in, eps)
    eager_in = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eag = eager_fn(*eager_in)
    assert y.dtype == inputs[0].dtype
    assert_bound("layer_norm y", y, eag, ref, dtype)
    go = torch.randn(y.shape, dtype=torch.float32, device=y.device).to(y.dtype)
    g_k = grads(y, inputs, go)
    g_r = grads(ref, ref_in, go.double())
    g_e = grads(eag, eager_in, go)
    for name, a, b, c in zip(("dx", "dw", "db"), g_k, g_e, g_r, strict=True):
        if c is not None:
            assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
            # dx = rstd * (g - mean(g) - xhat * c1): at H=1 the exact value is 0 and one rounding of the
            # bracket is multiplied by rstd <= 1/sqrt(eps)
            floor = eps**-0.5 * float(go.abs().max()) if name == "dx" and inputs[0].shape[-1] == 1 else 0.0
            assert_bound(f"layer_norm {name}", a, b, c, dtype, floor=floor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_layer_norm(device, dtype, hidden):
    torch.manual_seed(hidden)
    # A mean well away from 0 (|mean| = 3 std): a one-pass variance would lose digits here.
    x = (randn(3, hidden, device=device) + 3.0).to(dtype).requires_grad_(True)
    w = randn(hidden, dtype=dtype, device=device, requires_grad=True)
    b = randn(hidden, dtype=dtype, device=device, requires_grad=True)
    _check((x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
def test_weight_and_bias_are_optional(device, dtype, affine):
    torch.manual_seed(0)
    x = randn(4, 33, dtype=dtype, device=device, requires_grad=True)
    w = randn(33, dtype=dtype, device=device, requires_grad=True) if affine[0] else None
    b = randn(33, dtype=dtype, device=device, requires_grad=True) if affine[1] else None
    _check((x, w, b), dtype, eps=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_nn_layer_norm(device, dtype):
    torch.manual_seed(1)
    m = torch.nn.LayerNorm(96, eps=1e-6, device=device, dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(torch.randn(96))
        m.bias.copy_(torch.randn(96))
    x = randn(2, 3, 96, dtype=dtype, device=device, requires_grad=True)
    module = lambda x, w, b: torch.func.functional_call(m, {"weight": w, "bias": b}, (x,))
    _check((x, m.weight, m.bias), dtype, eps=m.eps, eager_fn=module)


def test_non_contiguous_3d(device):
    x = randn(2, 3, 65, dtype=torch.bfloat16, device=device, transposed=True, requires_grad=True)
    assert not x.is_contiguous()
    w = randn(65, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = randn(65, dtype=torch.bfloat16, device=device, requires_grad=True)
    _check((x, w, b), torch.bfloat16)
    # a strided weight (every other element of a bigger buffer) is read right too
    w2 = randn(130, dtype=torch.bfloat16, device=device, requires_grad=True)[::2]
    _check((x, w2, None), torch.bfloat16)


def test_fp32_params_with_bf16_input(device):
    # mixed precision without autocast: output and dx in x.dtype, dw and db in the params' fp32
    torch.manual_seed(3)
    x = randn(3, 40, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = randn(40, device=device, requires_grad=True)
    b = randn(40, device=device, requires_grad=True)
    y = ops.layer_norm(x, w, b)
    assert y.dtype == torch.bfloat16
    ref = reference.layer_norm(x.double(), w.double(), b.double())
    # two bf16 ulps of the largest value: the interpreter's fp32 -> bf16 cast truncates (a GPU rounds)
    assert (y.double() - ref).abs().max() <= 2**-6 * ref.abs().max()
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == b.grad.dtype == torch.float32
    xn = (x.detach().double() - x.detach().double().mean(-1, keepdim=True)) * torch.rsqrt(
        x.detach().double().var(-1, unbiased=False, keepdim=True) + 1e-5
    )
    torch.testing.assert_close(b.grad.double(), torch.full((40,), 3.0, dtype=torch.float64, device=device))
    torch.testing.assert_close(w.grad.double(), xn.sum(0), rtol=1e-5, atol=1e-5)


def test_constant_rows(device):
    # var = 0: y = bias exactly and dx = (g - mean(g)) / sqrt(eps), large but finite
    x = torch.full((2, 17), 3.0, device=device, requires_grad=True)
    w, b = randn(17, device=device), randn(17, device=device)
    y = ops.layer_norm(x, w, b)
    assert torch.equal(y, b.expand(2, 17))
    go = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, go)
    x64 = x.detach().double().requires_grad_(True)
    (dx64,) = torch.autograd.grad(reference.layer_norm(x64, w.double(), b.double()), x64, go.double())
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-3)


def test_runs_the_kernel_on_this_device(device):
    before = ops.dispatch_counts[("layer_norm", "triton")]
    ops.layer_norm(torch.randn(2, 8, device=device), torch.ones(8, device=device), None)
    assert ops.dispatch_counts[("layer_norm", "triton")] == before + 1


def test_frozen_params_get_no_grad(device):
    x = randn(3, 9, device=device, requires_grad=True)
    w, b = randn(9, device=device), randn(9, device=device)
    y = ops.layer_norm(x, w, b)
    y.sum().backward()
    assert x.grad is not None and w.grad is None and b.grad is None


def test_empty_rows(device):
    x = torch.empty(0, 16, device=device, requires_grad=True)
    w = torch.ones(16, device=device, requires_grad=True)
    b = torch.zeros(16, device=device, requires_grad=True)
    y = ops.layer_norm(x, w, b)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 16)
    assert torch.equal(w.grad, torch.zeros(16, device=device)) and torch.equal(b.grad, w.grad)


def test_compile_fullgraph_aot_eager(device):
    x = randn(3, 24, device=device, requires_grad=True)
    w = randn(24, device=device, requires_grad=True)
    b = randn(24, device=device, requires_grad=True)
    f = torch.compile(ops.layer_norm, fullgraph=True, backend="aot_eager")
    y = f(x, w, b)
    torch.testing.assert_close(y, reference.layer_norm(x, w, b), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(b.grad, torch.full_like(b, 3.0))


def _ones(device, *shape, dtype=torch.float32):
    return torch.ones(*(shape or (2, 4)), dtype=dtype, device=device)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda d: ops.layer_norm(_ones(d), _ones(d, 5), None), ValueError, "weight"),
        (lambda d: ops.layer_norm(_ones(d), None, _ones(d, 2, 2)), ValueError, "bias"),
        (lambda d: ops.layer_norm(_ones(d, dtype=torch.long), None, None), TypeError, "x"),
        (lambda d: ops.layer_norm(_ones(d), _ones(d, 4, dtype=torch.int32), None), TypeError, "weight"),
        (lambda d: ops.layer_norm([1.0, 2.0], None, None), TypeError, "x"),
        (lambda d: ops.layer_norm(torch.ones((), device=d), None, None), ValueError, "dimension"),
        (lambda d: ops.layer_norm(_ones(d), None, None, eps=0), ValueError, "eps"),
        (lambda d: ops.layer_norm(_ones(d), None, None, eps=float("nan")), ValueError, "eps"),
        (lambda d: ops.layer_norm(_ones(d, 1, 70000), None, None), ValueError, "hidden size"),
        (lambda d: ops.layer_norm(_ones(d), None, _ones("meta", 4)), ValueError, "bias is on meta"),
    ],
)
def test_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=f"layer_norm: .*{match}"):
        call(device)


def test_opcheck(device):
    x = randn(3, 7, device=device, requires_grad=True)
    w = randn(7, device=device, requires_grad=True)
    b = randn(7, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.tigon.layer_norm_fwd, (x, w, b, 1e-5))
    torch.library.opcheck(torch.ops.tigon.layer_norm_fwd, (x, None, b, 1e-5))
    _, mean, rstd = torch.ops.tigon.layer_norm_fwd(x.detach(), w.detach(), b.detach(), 1e-5)
    dy = randn(3, 7, device=device)
    x, w, b = x.detach(), w.detach(), b.detach()
    torch.library.opcheck(torch.ops.tigon.layer_norm_bwd, (dy, x, w, b, mean, rstd, True, True))
    torch.library.opcheck(torch.ops.tigon.layer_norm_bwd, (dy, x, None, None, mean, rstd, False, False))


@pytest.mark.gpu
def test_llama_3_8b_shape_bf16():
    torch.manual_seed(0)
    x = randn(2, 4096, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    _check((x, w, b), torch.bfloat16)


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    x = randn(8, 1000, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = randn(1000, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = randn(1000, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    f = torch.compile(ops.layer_norm, fullgraph=True)
    y = f(x, w, b)
    g = grads(y, (x, w, b), torch.ones_like(y))
    y_e = ops.layer_norm(x, w, b)
    g_e = grads(y_e, (x, w, b), torch.ones_like(y_e))
    assert torch.equal(y, y_e)
    for a, e in zip(g, g_e, strict=True):
        assert torch.equal(a, e)


@pytest.mark.gpu
def test_no_host_sync_and_deterministic():
    x = randn(4096, 4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = randn(4096, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    go = randn(4096, 4096, dtype=torch.bfloat16, device="cuda")

    def run():
        y = ops.layer_norm(x, w, b)
        return (y, *grads(y, (x, w, b), go))

    assert_no_sync_and_deterministic(run)
