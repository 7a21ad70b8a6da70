"""JSD distillation on fused linear heads (student and teacher of different hidden sizes): vs the fp64 formula
(loss, soft, hard, the student's gradients; none for the teacher), vs liger-kernel, bad input."""

import pytest
import torch

from tests.ops._loss_helpers import as64, check, grads_of, lengths
from tigon import ops
from tigon.ops import FusedLinearLossConfig, reference

CFG = FusedLinearLossConfig(chunk_rows=7)
N, HS, HT, V = 20, 24, 40, 67


def _inputs(dtype, bias=True):
    g = torch.Generator().manual_seed(6)
    hs = torch.randn(N, HS, generator=g).to(dtype).requires_grad_()
    ws = (torch.randn(V, HS, generator=g) * 0.4).to(dtype).requires_grad_()
    bs = (torch.randn(V, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    ht = torch.randn(N, HT, generator=g).to(dtype).requires_grad_()
    wt = (torch.randn(V, HT, generator=g) * 0.3).to(dtype).requires_grad_()
    lab = torch.randint(0, V, (N,), generator=g)
    lab[[0, 5, 11]] = -100
    return hs, ws, bs, ht, wt, lab


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta,temperature,w_hard", [(0.5, 1.0, 0.5), (0.0, 2.0, 0.0), (1.0, 0.7, 0.3),
                                                       (0.25, 1.5, 1.0)])
def test_jsd_vs_fp64(beta, temperature, w_hard, dtype):
    hs, ws, bs, ht, wt, lab = _inputs(dtype)
    kw = dict(beta=beta, temperature=temperature, weight_hard_loss=w_hard, weight_soft_loss=1 - w_hard / 2)
    loss, soft, hard = ops.fused_linear_jsd(hs, ws, ht, wt, lab, bs, None, config=CFG, **kw)
    got = grads_of(loss, [hs, ws, bs])
    assert ht.grad is None and wt.grad is None
    h64, w64, b64 = as64([hs, ws, bs])
    ref, rsoft, rhard = reference.fused_linear_jsd(h64, w64, ht.detach().double(), wt.detach().double(), lab, b64,
                                                   None, **kw)
    want = grads_of(ref, [h64, w64, b64])
    k = lengths(HT, V, N)
    check("loss", loss, ref, dtype, k=k, mag=5.0)
    check("soft", soft, rsoft, dtype, k=k, mag=5.0)
    check("hard", hard, rhard, dtype, k=k, mag=5.0)
    for n, g, r in zip(("dh", "dW", "db"), got, want):
        assert g.dtype == dtype
        check(n, g, r, dtype, k=k)


liger_cl = pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_matches_liger(beta):
    hs, ws, bs, ht, wt, lab = _inputs(torch.float32)
    kw = dict(beta=beta, temperature=1.3, weight_hard_loss=0.4, weight_soft_loss=0.6)
    lg = liger_cl.LigerFusedLinearJSDLoss(compiled=False, chunk_size=8, return_soft_hard_loss=True, **kw)
    l_out = lg(hs, ws, ht, wt, lab, bs, None)
    out = ops.fused_linear_jsd(hs, ws, ht, wt, lab, bs, None, config=CFG, **kw)
    for a, la in zip(out, l_out):
        torch.testing.assert_close(a, la, rtol=1e-5, atol=1e-6)
    for g, lgr in zip(grads_of(out[0], [hs, ws, bs]), grads_of(l_out[0], [hs, ws, bs])):
        torch.testing.assert_close(g, lgr, rtol=1e-4, atol=1e-6)


def test_bad_input():
    hs, ws, bs, ht, wt, lab = _inputs(torch.float32)
    with pytest.raises(ValueError, match="fused_linear_jsd: teacher_weight must have the student's vocabulary"):
        ops.fused_linear_jsd(hs, ws, ht, wt[:5], lab)
    with pytest.raises(ValueError, match="fused_linear_jsd: beta must be a finite number in"):
        ops.fused_linear_jsd(hs, ws, ht, wt, lab, beta=1.5)
    with pytest.raises(ValueError, match="fused_linear_jsd: teacher_input must have 20 rows"):
        ops.fused_linear_jsd(hs, ws, ht[:3], wt, lab)
    with pytest.raises(ValueError, match="fused_linear_jsd: teacher_weight must have shape"):
        ops.fused_linear_jsd(hs, ws, ht, ws, lab)
