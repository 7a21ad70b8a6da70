import sys

import pytest
import torch
import torch.nn.functional as F

from tests._grid import DTYPES, UNIT_ROUNDOFF, assert_bound, err, randn
from tigon import modules, ops
from tigon.memory.rolling_buffer import workspace
from tigon.ops import reference

ce_mod = sys.modules["tigon.ops.cross_entropy"]
flce_mod = sys.modules["tigon.ops.linear_cross_entropy"]

OPTIONS = [
    (dict(), "mean"),
    (dict(label_smoothing=0.1, z_loss_scale=1e-2, softcap=3.0), "mean"),
    (dict(label_smoothing=0.1), "sum"),
    (dict(z_loss_scale=1e-3, softcap=2.0), "none"),
    (dict(num_items_in_batch=7), "mean"),
]


def _targets(n, V, device, n_ignored=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (n,), generator=g)
    t[torch.randperm(n, generator=g)[:n_ignored]] = -100
    return t.to(device)


def _inputs(N, H, V, dtype, device, bias=False, seed=0):
    torch.manual_seed(seed)
    h = randn(N, H, dtype=dtype, device=device, requires_grad=True)
    w = randn(V, H, dtype=dtype, device=device, scale=H**-0.5 * 3, requires_grad=True)
    b = randn(V, dtype=dtype, device=device, requires_grad=True) if bias else None
    return h, w, b


def _eager(h, w, t, b, **kw):
    """The HF path in dtype: F.linear in dtype, then the fp32 (.float()) cross-entropy."""
    return reference.cross_entropy(F.linear(h, w, b), t, **kw)


def _run(fn, ins, t, go, **kw):
    ins = [None if i is None else i.detach().clone().requires_grad_(i.requires_grad) for i in ins]
    loss = fn(*ins[:2], t, ins[2], **kw)
    want = [i for i in ins if i is not None and i.requires_grad]
    got = iter(torch.autograd.grad(loss, want, go.to(loss.dtype)))
    return loss, [next(got) if (i is not None and i.requires_grad) else None for i in ins]


def _check(ins, t, dtype, chunk=4, accum_dtype=None, **kw):
    """Loss within fp32 rounding of fp64 math on the dtype-rounded logits; each gradient within 2x the HF
    path's error in dtype (a single full-batch GEMM there, one GEMM per chunk here)."""
    rows = kw.get("reduction") == "none" and kw.get("num_items_in_batch") is None
    go = torch.rand(t.shape if rows else (), device=t.device) + 0.5  # never 1: exercises the rescale
    loss, g_k = _run(lambda h, w, t, b, **k: ops.linear_cross_entropy(h, w, t, b, _chunk_rows=chunk,
                                                                       accum_dtype=accum_dtype, **k), ins, t, go, **kw)
    eager, g_e = _run(_eager, ins, t, go, **kw)
    ref, g_r = _run(reference.linear_cross_entropy, [None if i is None else i.double() for i in ins], t, go, **kw)
    # the loss sees logits rounded to dtype, as the HF path does: its reference is eager's logits in fp64
    ref_same_logits = reference.cross_entropy(F.linear(*[None if i is None else i.detach() for i in ins[:2]],
                                                       None if ins[2] is None else ins[2].detach()).double(), t, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    lse_scale = float(ref_same_logits.detach().abs().max()) + 1.0
    assert_bound("loss", loss, eager, ref_same_logits, torch.float32, ulps=16 if loss.is_cuda else 4, floor=lse_scale)
    for name, a, e, r in zip(("dhidden", "dweight", "dbias"), g_k, g_e, g_r):
        if r is not None:
            assert a.dtype == dtype
            assert_bound(name, a, e, r, dtype)
    return g_k


@pytest.mark.parametrize("opts,reduction", OPTIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_fp32(device, opts, reduction, bias):
    ins = _inputs(11, 13, 37, torch.float32, device, bias)
    _check(ins, _targets(11, 37, device), torch.float32, reduction=reduction, **opts)  # 3 chunks of <= 4 rows


@pytest.mark.parametrize("V", [1, 7, 1000, 5003, 32000])
def test_vocab_sizes(device, V):
    ins = _inputs(5, 16, V, torch.float32, device, bias=V == 7, seed=V)
    _check(ins, _targets(5, V, device, n_ignored=1), torch.float32, chunk=2, label_smoothing=0.1)


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("opts,reduction", OPTIONS[:2] + OPTIONS[3:4])
def test_linear_cross_entropy_half(device, dtype, opts, reduction):
    ins = _inputs(12, 24, 61, dtype, device, bias=True)
    _check(ins, _targets(12, 61, device), dtype, reduction=reduction, **opts)


def _dw_same_logits(h, w, t):
    """dW in fp64 from the very logits gradient the chunks hold (bf16 logits by the same GEMM, our row
    kernel): isolates the error of dW's accumulation over chunks."""
    logits = torch.mm(h.detach(), w.detach().t()).requires_grad_()
    (dl,) = torch.autograd.grad(ops.cross_entropy(logits, t), [logits])
    return dl.double().t() @ h.detach().double()


def test_accum_fp32_is_one_rounding(device):
    # 12 one-row chunks: weight.dtype accumulation rounds dW 12 times, fp32 accumulation once at the end
    ins = _inputs(12, 32, 29, torch.bfloat16, device, seed=5)
    t = _targets(12, 29, device, n_ignored=1)
    _check(ins, t, torch.bfloat16, chunk=1, accum_dtype=torch.float32)
    (dw,) = torch.autograd.grad(ops.linear_cross_entropy(*ins[:2], t, _chunk_rows=1, accum_dtype=torch.float32),
                                [ins[1]])
    dw_r = _dw_same_logits(ins[0], ins[1], t)
    assert dw.dtype == torch.bfloat16
    assert err(dw, dw_r) <= 2**-8 * dw_r.abs().max().item()  # within one ulp of max|dW|: one rounding


def test_autocast_fp32_master_weight(device):
    h, w, b = _inputs(9, 16, 23, torch.float32, device, bias=True, seed=6)
    t = _targets(9, 23, device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = ops.linear_cross_entropy(h, w, t, b, _chunk_rows=4)
    dh, dw, db = torch.autograd.grad(loss, [h, w, b])
    assert dw.dtype == db.dtype == dh.dtype == torch.float32
    h16, w16, b16 = (x.detach().bfloat16().float().requires_grad_() for x in (h, w, b))
    ref = reference.cross_entropy(F.linear(h16, w16, b16).bfloat16().float(), t)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, r in zip((dh, dw, db), torch.autograd.grad(ref, [h16, w16, b16])):
        assert err(a, r) <= 4 * UNIT_ROUNDOFF[torch.bfloat16] * r.abs().max().item()


@pytest.mark.parametrize("needs", [(False, True, False), (True, False, False), (False, False, True)])
def test_gradient_subsets(device, needs):
    """Frozen weight (no dW GEMM), hidden without grad (no dh GEMM), bias only."""
    h, w, b = _inputs(7, 9, 19, torch.float32, device, bias=True, seed=7)
    for x, n in zip((h, w, b), needs):
        x.requires_grad_(n)
    t = _targets(7, 19, device)
    _check((h, w, b), t, torch.float32, chunk=3, z_loss_scale=1e-3)


def test_grad_output_and_loss_used_twice(device):
    h, w, _ = _inputs(10, 8, 21, torch.float32, device, seed=8)
    t = _targets(10, 21, device)
    loss = ops.linear_cross_entropy(h, w, t, _chunk_rows=3)
    (loss * 0.5 + loss * 0.25).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (reference.linear_cross_entropy(h64, w64, t) * 0.75).backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-8)


def test_num_items_tensor_3d_and_all_ignored(device):
    h, w, _ = _inputs(2 * 5, 8, 21, torch.float32, device, seed=9)
    h3 = h.detach().view(2, 5, 8).requires_grad_()
    t = _targets(10, 21, device, n_ignored=3).view(2, 5)
    loss = ops.linear_cross_entropy(h3, w, t, num_items_in_batch=torch.tensor(4, device=device), _chunk_rows=4)
    ref = F.cross_entropy(F.linear(h3, w).view(-1, 21), t.view(-1), reduction="sum") / 4
    torch.testing.assert_close(loss, ref)
    rows = ops.linear_cross_entropy(h3, w, t, reduction="none", _chunk_rows=4)
    assert rows.shape == (2, 5)
    t_ign = torch.full_like(t, -100)
    loss = ops.linear_cross_entropy(h3, w, t_ign, _chunk_rows=4)
    assert torch.isnan(loss)
    dh, dw = torch.autograd.grad(loss, [h3, w])
    assert torch.equal(dh, torch.zeros_like(dh)) and torch.equal(dw, torch.zeros_like(dw))


def test_logits_never_materialized(device):
    h, w, _ = _inputs(12, 8, 50, torch.float32, device, seed=10)
    t = _targets(12, 50, device)
    ws = workspace(device)
    ws.reset_peak()
    before = ws.stats()["in_use_bytes"]
    ops.linear_cross_entropy(h, w, t, _chunk_rows=5).backward()
    assert ws.stats()["peak_in_use_bytes"] - before <= 5 * 50 * 4 + ws.alignment  # one chunk, never [12, 50]
    assert flce_mod.chunk_rows(16384, 128256, 2) == 512  # 128 MiB of bf16 logits
    assert flce_mod.chunk_rows(1000, 128256, 2) == 512
    assert flce_mod.chunk_rows(100, 32000, 2) == 100


def test_out_of_range_target(device, monkeypatch):
    monkeypatch.setenv("TIGON_VALIDATE", "1")  # CUDA validates only on request (it reads the target)
    h, w, _ = _inputs(3, 8, 10, torch.float32, device, seed=11)
    t = torch.tensor([1, 10, -100], device=device)
    with pytest.raises(ValueError, match=r"linear_cross_entropy: target must be in \[0, 10\)"):
        ops.linear_cross_entropy(h, w, t)
    monkeypatch.setattr(ce_mod, "_validating", lambda device: False)
    rows = ops.linear_cross_entropy(h, w, t, reduction="none", _chunk_rows=2)
    assert torch.isfinite(rows[0]) and torch.isnan(rows[1]) and rows[2] == 0
    (dh,) = torch.autograd.grad(rows.sum(), [h])
    assert torch.isfinite(dh[0]).all() and torch.isnan(dh[1]).all() and (dh[2] == 0).all()


def test_runs_the_kernel_on_this_device_and_module(device):
    h, w, b = _inputs(3, 8, 10, torch.float32, device, bias=True)
    t = _targets(3, 10, device, n_ignored=0)
    before = ops.dispatch_counts[("linear_cross_entropy", "triton")]
    m = modules.LinearCrossEntropyLoss(label_smoothing=0.1)
    torch.testing.assert_close(m(h, w, t, b), ops.linear_cross_entropy(h, w, t, b, label_smoothing=0.1))
    assert ops.dispatch_counts[("linear_cross_entropy", "triton")] == before + 2
    assert m.state_dict() == {}


def _lce(h_shape=(2, 4), w_shape=(5, 4), t_shape=(2,), hd=torch.float32, wd=torch.float32, td=torch.long, b=None,
         **kw):
    return lambda d: ops.linear_cross_entropy(torch.ones(h_shape, dtype=hd, device=d),
                                              torch.ones(w_shape, dtype=wd, device=d),
                                              torch.ones(t_shape, dtype=td, device=d), b, **kw)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (_lce(w_shape=(5, 3)), ValueError, r"weight must have shape \(V, 4\)"),
        (_lce(w_shape=(5,)), ValueError, "weight"),
        (_lce(wd=torch.bfloat16), TypeError, "weight has dtype"),
        (_lce(hd=torch.long), TypeError, "linear_cross_entropy: hidden"),
        (_lce(td=torch.float32), TypeError, "integer"),
        (_lce(t_shape=(3,)), ValueError, "target must have shape"),
        (_lce(b=torch.ones(4)), ValueError, "bias must have shape"),
        (_lce(b=torch.ones(5, device="meta")), ValueError, "bias is on meta"),
        (_lce(accum_dtype=torch.float16), ValueError, "accum_dtype"),
        (_lce(reduction="avg"), ValueError, "reduction"),
        (_lce(softcap=-1.0), ValueError, "softcap"),
    ],
)
def test_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=match):
        call(device)


def test_opcheck(device):
    h, w, b = _inputs(5, 8, 20, torch.float32, device, bias=True)
    t = _targets(5, 20, device, n_ignored=1)
    # the forward returns the gradients its backward rescales in place, which opcheck's aot_dispatch
    # test would hand to the caller; the public op is compiled in test_compile_aot_eager instead.
    no_aot = ("test_schema", "test_autograd_registration", "test_faketensor")
    fwd, bwd = torch.ops.tigon.linear_cross_entropy_fwd, torch.ops.tigon.linear_cross_entropy_bwd
    torch.library.opcheck(fwd, (h, w, t, b, None, -100, 0.1, 0.0, 0.0, 1, True, True, True, False, 2),
                          test_utils=no_aot)
    torch.library.opcheck(fwd, (h, w, t, None, None, -100, 0.0, 1e-3, 3.0, 0, True, True, False, False, 2))
    n_items = torch.tensor(3.0, device=device)
    torch.library.opcheck(fwd, (h.detach(), w, t, None, n_items, -100, 0.0, 0.0, 0.0, 2, False, True,
                                False, True, 2), test_utils=no_aot)
    hd, wd, bd = h.detach(), w.detach(), b.detach()
    rows = torch.rand(5, device=device)
    torch.library.opcheck(bwd, (rows, hd, wd, t, bd, -100, 0.0, 0.0, 0.0, True, True, True, False, 2))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_aot_eager(device, reduction):
    h, w, _ = _inputs(9, 8, 30, torch.float32, device, seed=12)
    t = _targets(9, 30, device)
    fn = torch.compile(lambda h, w, t: ops.linear_cross_entropy(h, w, t, reduction=reduction, _chunk_rows=4)
                       .sum() * 2.0, backend="aot_eager", fullgraph=True)
    fn(h, w, t).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (reference.linear_cross_entropy(h64, w64, t, reduction=reduction).sum() * 2.0).backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-7)


# GPU only: Llama-3-8B's head in bf16 (16k tokens would need a 16 GB fp64 reference: 2k tokens here).


def _gpu_llama_inputs(N=2048, H=4096, V=128256, seed=0):
    torch.manual_seed(seed)
    h = (torch.randn(N, H, device="cuda")).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda") * H**-0.5 * 2).bfloat16().requires_grad_()
    return h, w, _targets(N, V, "cuda", n_ignored=N // 8, seed=seed)


@pytest.mark.gpu
@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_gpu_llama3_head(accum_dtype):
    h, w, t = _gpu_llama_inputs()
    loss = ops.linear_cross_entropy(h, w, t, accum_dtype=accum_dtype)
    dh, dw = torch.autograd.grad(loss, [h, w])
    logits = F.linear(h.detach(), w.detach()).float().requires_grad_()  # the same bf16 logits, fp32 CE
    ref = reference.cross_entropy(logits, t)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    (dl,) = torch.autograd.grad(ref, [logits])
    dl = dl.bfloat16().double()  # the HF path's bf16 gradient of the logits
    dh_ref = dl @ w.detach().double()
    del logits, dl
    dw_ref = _dw_same_logits(h, w, t)
    rel = lambda a, r: (a.double() - r).abs().max().item() / r.abs().max().item()  # noqa: E731
    assert rel(dh, dh_ref) <= 2**-8
    # fp32 accumulation: one bf16 rounding at the end (up to one ulp of max|dW| away); addmm in bf16 rounds
    # once per chunk (4 chunks here), each rounding a half ulp of the running sum
    print(f"dW rel err {rel(dw, dw_ref):.2e} (accum_dtype={accum_dtype})")
    assert rel(dw, dw_ref) <= (2**-8 if accum_dtype else 4 * 2**-8)


@pytest.mark.gpu
def test_gpu_memory_compile_no_sync_deterministic():
    N, H, V = 16384, 4096, 128256
    torch.manual_seed(0)
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda") * 0.03).bfloat16().requires_grad_()
    t = _targets(N, V, "cuda", n_ignored=N // 8)
    fn = torch.compile(lambda h, w, t: ops.linear_cross_entropy(h, w, t), fullgraph=True)
    fn(h, w, t).backward()  # compile and warm up (the workspace grows once) outside the checks
    results = []
    for _ in range(2):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = fn(h, w, t)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        peak = torch.cuda.max_memory_allocated() - base
        # dW (1002 MiB) + dh (128 MiB) + one 128 MiB chunk, with the chunk held by the workspace in `base`
        assert peak <= 1.25 * 2**30, f"peak {peak / 2**20:.0f} MiB"
        results.append((loss.detach().clone(), h.grad.clone(), w.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))
