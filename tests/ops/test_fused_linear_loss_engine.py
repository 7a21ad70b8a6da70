"""The fused-linear loss engine: torch.compile(fullgraph=True) sees each loss as one custom-op node (no graph break,
same loss and gradients as eager), torch.library.opcheck of the custom ops, the modules, and bitwise determinism."""

import pytest
import torch

from tests.ops._loss_helpers import grads_of, head
from tigon import modules, ops
from tigon.ops import FusedLinearLossConfig

CFG = FusedLinearLossConfig(chunk_rows=7)
B, T, H, V = 4, 5, 24, 67


def _dpo(h, w, t, b):
    return ops.fused_linear_dpo(h, w, t, b, loss_type="sigmoid", compute_nll_loss=True, config=CFG)[0]


def test_compile_fullgraph_matches_eager():
    h, w, b, t = head(B, T, H, V, torch.float32)
    ref = _dpo(h, w, t, b)
    want = grads_of(ref, [h, w, b])
    torch._dynamo.reset()
    f = torch.compile(_dpo, fullgraph=True, backend="aot_eager")
    got_loss = f(h, w, t, b)
    got = grads_of(got_loss, [h, w, b])
    torch.testing.assert_close(got_loss, ref)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_opcheck():
    h, w, b, t = head(B, T, H, V, torch.float32)
    hr = h.detach().reshape(-1, H).requires_grad_()
    args = (hr, w, t, b, None, None, None, None, None, "dpo", "sigmoid", [0.1, 1.0, 0.0, 0.5, 0.05], -100, True,
            False, True, True, True, CFG.ints())
    torch.library.opcheck(torch.ops.tigon.fused_linear_preference.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.tigon.fused_linear_logprobs_fwd.default, (hr, w, t.reshape(-1), b, 1.0, -100,
                          CFG.ints()), test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_deterministic_bits():
    h, w, b, t = head(B, T, H, V, torch.float32)
    runs = []
    for _ in range(2):
        loss = _dpo(h, w, t, b)
        runs.append([loss] + grads_of(loss, [h, w, b]))
    for a, c in zip(*runs):
        assert torch.equal(a, c)


def test_modules():
    h, w, b, t = head(B, T, H, V, torch.float32)
    m = modules.FusedLinearDPOLoss(beta=0.2, config=CFG)
    assert m.state_dict() == {} and "beta=0.2" in repr(m)
    loss, aux = m(h, w, t, b)
    torch.testing.assert_close(loss, ops.fused_linear_dpo(h, w, t, b, beta=0.2, config=CFG)[0])
    lp = modules.FusedLinearLogProbs(temperature=0.5, config=CFG)(h, w, t, b)[0]
    assert lp.shape == (B, T)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (inductor + real Triton kernels)")
def test_compile_inductor_cuda():
    h, w, b, t = [x.cuda() if x is not None else None for x in head(B, T, H, V, torch.bfloat16)]
    h, w, b = (x.detach().requires_grad_() for x in (h, w, b))
    ref = _dpo(h, w, t, b)
    f = torch.compile(_dpo, fullgraph=True)
    torch.testing.assert_close(f(h, w, t, b), ref)
