import sys

import pytest
import torch
import torch.nn.functional as F

from tests._grid import DTYPES, assert_bound, assert_tol, cross_entropy_model, randn
from tigon import modules, ops
from tigon.ops import _library, reference

ce_mod = sys.modules["tigon.ops.cross_entropy"]  # tigon.ops.cross_entropy is the function

# (options, reductions): every option alone and together, each under every reduction somewhere
OPTIONS = [
    (dict(), "mean"),
    (dict(label_smoothing=0.1), "sum"),
    (dict(z_loss_scale=1e-3), "none"),
    (dict(softcap=4.0), "mean"),
    (dict(label_smoothing=0.2, z_loss_scale=1e-2, softcap=2.5), "none"),
    (dict(label_smoothing=0.05, softcap=30.0, ignore_index=3), "sum"),
]


def _targets(n, V, device, ignore_index=-100, n_ignored=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (n,), generator=g)
    t[torch.randperm(n, generator=g)[:n_ignored]] = ignore_index
    return t.to(device)


def _check(logits, target, dtype, **kw):
    """Loss (fp32 math on the same inputs, ours and the HF path's) within the fp32 error model of the fp64
    reference (tests/_grid.py: the sums over V and over the rows in any order); the gradient the same in fp32,
    within 2x the HF path's error in bf16/fp16 (reference.cross_entropy: .float(), grads cast back to dtype)."""
    x = logits.detach().clone().requires_grad_()
    loss = ops.cross_entropy(x, target, **kw)
    go = torch.rand(loss.shape, dtype=torch.float32, device=loss.device) + 0.5  # never 1: exercises the scale
    (g_k,) = torch.autograd.grad(loss, x, go)
    x_e = logits.detach().clone().requires_grad_()
    eager = reference.cross_entropy(x_e, target, **kw)
    (g_e,) = torch.autograd.grad(eager, x_e, go)
    V = logits.shape[-1]
    # the GPU's exp2/log2 are approximate (2 ulps each) where torch's are exact
    ulps = 16 if logits.is_cuda else 4
    (ref, loss_tol), (g_r, g_tol) = cross_entropy_model(logits.reshape(-1, V), target, go, ulps=ulps, **kw)
    g_r, g_tol = g_r.reshape(logits.shape), g_tol.reshape(logits.shape)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert g_k.dtype == logits.dtype
    for who, lo, g in (("kernel", loss, g_k), ("torch", eager, g_e)):
        assert_tol(f"{who} loss", lo, ref, loss_tol)
        if dtype == torch.float32:
            assert_tol(f"{who} dlogits", g, g_r, g_tol)
    if dtype != torch.float32:
        # dlogits = go * (p - y) with p, y in [0, 1]: a difference of terms of size go
        assert_bound("dlogits", g_k, g_e, g_r, dtype, ulps=ulps, floor=float(go.max()))


@pytest.mark.parametrize("V", [1, 7, 1000, 5003])
@pytest.mark.parametrize("opts,reduction", OPTIONS)
def test_cross_entropy_fp32(device, V, opts, reduction):
    torch.manual_seed(V)
    x = randn(6, V, device=device, scale=3.0)
    _check(x, _targets(6, V, device, opts.get("ignore_index", -100)), torch.float32, reduction=reduction, **opts)


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("V", [7, 5003])
@pytest.mark.parametrize("opts,reduction", OPTIONS[:1] + OPTIONS[4:])
def test_cross_entropy_half(device, dtype, V, opts, reduction):
    torch.manual_seed(V)
    x = randn(5, V, dtype=dtype, device=device, scale=3.0)
    _check(x, _targets(5, V, device, opts.get("ignore_index", -100)), dtype, reduction=reduction, **opts)


def test_matches_hf_float_path_in_bf16(device):
    torch.manual_seed(0)
    x = randn(4, 32000, dtype=torch.bfloat16, device=device, scale=4.0, requires_grad=True)
    t = _targets(4, 32000, device, n_ignored=1)
    loss = ops.cross_entropy(x, t, label_smoothing=0.1)
    x_e = x.detach().clone().requires_grad_()
    eager = reference.eager_cross_entropy(x_e, t, label_smoothing=0.1)
    torch.testing.assert_close(loss, eager, rtol=2e-6, atol=0)
    loss.backward()
    eager.backward()
    ulp = 2.0**-7 * x_e.grad.abs().max().item()
    assert (x.grad.float() - x_e.grad.float()).abs().max().item() <= ulp  # one bf16 rounding apart at most


def test_3d_non_contiguous_and_default_leaves_logits_untouched(device):
    torch.manual_seed(1)
    x = randn(2, 3, 33, device=device, transposed=True, requires_grad=True)
    assert not x.is_contiguous()
    t = _targets(6, 33, device).view(2, 3)
    before = x.detach().clone()
    _check(x, t, torch.float32, reduction="none", z_loss_scale=1e-3)
    loss = ops.cross_entropy(x, t)
    loss.backward()
    assert torch.equal(x.detach(), before) and x.grad.shape == x.shape


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_inplace_backward(device, reduction):
    torch.manual_seed(2)
    base = randn(5, 300, dtype=torch.bfloat16, device=device, scale=3.0)
    t = _targets(5, 300, device)
    w = torch.randn(5, device=device) if reduction == "none" else torch.tensor(0.75, device=device)
    x1 = base.clone().requires_grad_()
    (ops.cross_entropy(x1, t, reduction=reduction, label_smoothing=0.1) * w).sum().backward()
    h = base.clone().requires_grad_()
    logits = h * 1  # a non-leaf buffer, as lm_head's output is
    loss = ops.cross_entropy(logits, t, reduction=reduction, label_smoothing=0.1, inplace_backward=True)
    assert not torch.equal(logits.detach(), base)  # the forward already overwrote the logits
    (loss * w).sum().backward()
    assert torch.equal(h.grad, x1.grad)
    # no grad wanted: the logits stay as they were
    x3 = base.clone()
    ops.cross_entropy(x3, t, inplace_backward=True)
    assert torch.equal(x3, base)


def test_grad_output_loss_used_twice_and_retained_graph(device):
    torch.manual_seed(3)
    x = randn(4, 50, device=device, requires_grad=True)
    t = _targets(4, 50, device, n_ignored=1)
    x_r = x.detach().double().requires_grad_()
    loss, ref = ops.cross_entropy(x, t, z_loss_scale=1e-2), reference.cross_entropy(x_r, t, z_loss_scale=1e-2)
    (loss * 0.5 + loss * 0.25).backward(retain_graph=True)
    (ref * 0.75).backward()
    torch.testing.assert_close(x.grad.double(), x_r.grad, rtol=1e-5, atol=1e-7)
    # the saved gradient was rescaled in place: a second backward fails loudly, never silently wrong
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss * 2.0).backward()


def test_num_items_in_batch(device):
    torch.manual_seed(4)
    x = randn(2, 5, 40, device=device, requires_grad=True)
    t = _targets(10, 40, device, n_ignored=3).view(2, 5)
    for n in (7, torch.tensor(7, device=device)):
        loss = ops.cross_entropy(x, t, num_items_in_batch=n)
        ref = F.cross_entropy(x.view(-1, 40), t.view(-1), reduction="sum") / 7
        torch.testing.assert_close(loss, ref)
        (g,) = torch.autograd.grad(loss, x)
        (g_r,) = torch.autograd.grad(ref, x)
        torch.testing.assert_close(g, g_r)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored(device, reduction):
    x = randn(3, 17, device=device, requires_grad=True)
    t = torch.full((3,), -100, device=device)
    loss = ops.cross_entropy(x, t, reduction=reduction)
    ref = F.cross_entropy(x.detach(), t, reduction=reduction)
    torch.testing.assert_close(loss, ref, equal_nan=True)  # mean over no tokens is NaN, like torch
    if reduction == "mean":
        assert torch.isnan(loss)
    loss.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_forward_only_under_no_grad(device):
    x = randn(3, 40, device=device, requires_grad=True)
    t = _targets(3, 40, device, n_ignored=0)
    with torch.no_grad():
        loss = ops.cross_entropy(x, t)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(x.detach(), t))


def test_out_of_range_target_raises_when_validating(device, monkeypatch):
    monkeypatch.setenv("TIGON_VALIDATE", "1")  # CUDA validates only on request (it reads the target)
    x = randn(3, 10, device=device)
    for bad in (10, -1):
        t = torch.tensor([1, bad, -100], device=device)
        with pytest.raises(ValueError, match=r"cross_entropy: target must be in \[0, 10\).*index 1"):
            ops.cross_entropy(x, t)
    monkeypatch.setattr(_library, "interpreter_on", lambda: False)  # the CPU reference path validates too
    if x.device.type == "cpu":
        assert ops.backend_for(x.device) == "reference"
        with pytest.raises(ValueError, match="target must be in"):
            ops.cross_entropy(x, torch.tensor([1, 12, 2]))


def test_out_of_range_target_gives_nan_when_not_validating(device, monkeypatch):
    monkeypatch.setattr(ce_mod, "_validating", lambda device: False)
    x = randn(3, 10, device=device, requires_grad=True)
    t = torch.tensor([1, 12, -100], device=device)
    rows = ops.cross_entropy(x, t, reduction="none")
    assert torch.isfinite(rows[0]) and torch.isnan(rows[1]) and rows[2] == 0
    assert torch.isnan(ops.cross_entropy(x, t))
    (g,) = torch.autograd.grad(rows.sum(), x)
    assert torch.isfinite(g[0]).all() and torch.isnan(g[1]).all() and (g[2] == 0).all()


def test_runs_the_kernel_on_this_device(device):
    before = ops.dispatch_counts[("cross_entropy", "triton")]
    ops.cross_entropy(torch.randn(2, 8, device=device), torch.tensor([1, 2], device=device))
    assert ops.dispatch_counts[("cross_entropy", "triton")] == before + 1


def test_module(device):
    m = modules.CrossEntropyLoss(label_smoothing=0.1, z_loss_scale=1e-3)
    assert m.state_dict().keys() == torch.nn.CrossEntropyLoss().state_dict().keys()
    x, t = randn(3, 20, device=device), _targets(3, 20, device, n_ignored=1)
    torch.testing.assert_close(m(x, t), ops.cross_entropy(x, t, label_smoothing=0.1, z_loss_scale=1e-3))


def test_int32_target_and_empty_batch(device):
    x = randn(4, 9, device=device, requires_grad=True)
    t = _targets(4, 9, device, n_ignored=1)
    torch.testing.assert_close(ops.cross_entropy(x, t.int()), F.cross_entropy(x, t))
    e = ops.cross_entropy(torch.empty(0, 9, device=device, requires_grad=True), t[:0], reduction="sum")
    assert e.item() == 0


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda d: ops.cross_entropy(torch.ones(2, 4, dtype=torch.long, device=d), torch.ones(2, dtype=torch.long,
                                                                                              device=d)),
         TypeError, "cross_entropy: logits"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, device=d)), TypeError, "integer"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(3, dtype=torch.long, device=d)),
         ValueError, r"target must have shape \(2,\)"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, dtype=torch.long, device="meta")),
         ValueError, "target is on meta"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, dtype=torch.long, device=d),
                                     reduction="avg"), ValueError, "reduction"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, dtype=torch.long, device=d),
                                     label_smoothing=1.5), ValueError, "label_smoothing"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, dtype=torch.long, device=d),
                                     z_loss_scale=float("inf")), ValueError, "z_loss_scale"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, dtype=torch.long, device=d),
                                     softcap=0.0), ValueError, "softcap"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, dtype=torch.long, device=d),
                                     ignore_index=1.0), TypeError, "ignore_index"),
        (lambda d: ops.cross_entropy(torch.ones(2, 4, device=d), torch.ones(2, dtype=torch.long, device=d),
                                     num_items_in_batch=[3]), TypeError, "num_items_in_batch"),
        (lambda d: ops.cross_entropy(torch.ones(2, 0, device=d), torch.ones(2, dtype=torch.long, device=d)),
         ValueError, "V >= 1"),
    ],
)
def test_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=match):
        call(device)


def test_opcheck(device):
    x = randn(4, 20, device=device, requires_grad=True)
    t = _targets(4, 20, device, n_ignored=1)
    # With compute_grad the op returns the gradient that its backward rescales in place: opcheck's
    # aot_dispatch test hands that output to the caller too, which the public op never does (it is
    # compiled below and in test_compile_aot_eager).
    no_aot = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.tigon.cross_entropy_fwd, (x, t, None, -100, 0.1, 0.0, 0.0, 1, True),
                          test_utils=no_aot)
    torch.library.opcheck(torch.ops.tigon.cross_entropy_fwd, (x, t, None, -100, 0.0, 1e-3, 2.0, 0, False))
    torch.library.opcheck(torch.ops.tigon.cross_entropy_fwd_inplace,
                          (x.detach().clone(), t, torch.tensor(3.0, device=device), -100, 0.0, 0.0, 0.0, 2))
    g = torch.randn(4, 20, device=device)
    torch.library.opcheck(torch.ops.tigon.scale_grad_, (g.clone(), torch.tensor(0.5, device=device)))
    torch.library.opcheck(torch.ops.tigon.scale_grad_, (g.clone(), torch.rand(4, device=device)))


def test_compile_aot_eager(device):
    x = randn(6, 50, device=device, requires_grad=True)
    t = _targets(6, 50, device)
    fn = torch.compile(lambda x, t: ops.cross_entropy(x, t, label_smoothing=0.1, softcap=5.0) * 0.5,
                       backend="aot_eager", fullgraph=True)
    fn(x, t).backward()
    x_r = x.detach().double().requires_grad_()
    (reference.cross_entropy(x_r, t, label_smoothing=0.1, softcap=5.0) * 0.5).backward()
    torch.testing.assert_close(x.grad.double(), x_r.grad, rtol=1e-5, atol=1e-8)


# GPU only: Llama-3 / Gemma vocabularies in bf16, > 2^31 elements, compile, no host sync, determinism.


@pytest.mark.gpu
@pytest.mark.parametrize("V", [128256, 262144])
def test_gpu_large_vocab(V):
    torch.manual_seed(0)
    x = randn(64, V, dtype=torch.bfloat16, device="cuda", scale=4.0)
    t = _targets(64, V, "cuda", n_ignored=8)
    _check(x, t, torch.bfloat16, label_smoothing=0.1, z_loss_scale=1e-4, softcap=30.0)
    _check(x, t, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_over_2_31_elements():
    N, V = 20000, 128256  # 2.57e9 elements: the last rows start past 2^31 (int64 offsets); 5.1 GB in bf16
    torch.manual_seed(0)
    x = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = _targets(N, V, "cuda", n_ignored=100)
    ends = torch.cat([torch.arange(4), torch.arange(N - 4, N)]).cuda()
    x_e = x.detach()[ends].float().requires_grad_()
    rows = ops.cross_entropy(x, t, reduction="none")
    torch.testing.assert_close(rows[ends], F.cross_entropy(x_e.detach(), t[ends], reduction="none"))
    loss = ops.cross_entropy(x, t)
    (g,) = torch.autograd.grad(loss, x)
    (F.cross_entropy(x_e, t[ends], reduction="sum") / (N - 100)).backward()
    torch.testing.assert_close(g[ends].float(), x_e.grad, rtol=2**-8, atol=1e-12)


@pytest.mark.gpu
def test_gpu_compile_no_sync_deterministic():
    torch.manual_seed(0)
    x = randn(4096, 128256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    t = _targets(4096, 128256, "cuda", n_ignored=500)
    fn = torch.compile(lambda x, t: ops.cross_entropy(x, t, z_loss_scale=1e-4), fullgraph=True)
    fn(x, t).backward()  # compile and warm up outside the sync check
    grads = []
    for _ in range(2):
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = fn(x, t)
            loss.backward()
            eager = ops.cross_entropy(x, t, z_loss_scale=1e-4)
            (eager * 0.5).backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        grads.append((loss.detach().clone(), x.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("inplace", [False, True])
def test_config_reaches_the_launches(device, monkeypatch, inplace):
    # A CrossEntropyConfig's L2 hints reach the row kernel and its programs per SM the grad_output scaling, on
    # the out-of-place and the in-place path; hints change no value, so the bits match the default's.
    from tigon.ops import _launch
    from tigon.ops.config import CrossEntropyConfig

    mod = sys.modules["tigon.ops.cross_entropy"]
    hints, per_sm, real = [], [], mod._cross_entropy_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                hints.append(kwargs["L2_HINTS"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(mod, "_cross_entropy_kernel", Spy())
    programs = _launch.num_programs
    monkeypatch.setattr(_launch, "num_programs", lambda d, rows, per_sm_=None, **kw: per_sm.append(
        kw.get("per_sm", per_sm_)) or programs(d, rows, kw.get("per_sm", per_sm_)))
    torch.manual_seed(0)
    x0, t = torch.randn(3, 40, device=device), torch.tensor([1, 7, 39], device=device)
    outs = []
    for cfg in (None, CrossEntropyConfig(l2_hints=False, scale_per_sm=7)):
        x = x0.clone().requires_grad_()
        logits = x * 1.0 if inplace else x  # in place needs logits autograd made
        loss = ops.cross_entropy(logits, t, inplace_backward=inplace, config=cfg)
        outs.append((loss, *torch.autograd.grad(loss * 0.5, x)))
    assert hints == [True, False] and per_sm == [4, 7]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="cross_entropy: config must be"):
        ops.cross_entropy(x0, t, config=(0, 0, 4, 1))
    with pytest.raises(ValueError, match="l2_hints must be a bool"):
        CrossEntropyConfig(l2_hints=1)
