"""Public ops under torch.compile(dynamic=True, fullgraph=True): Python floats (eps, offset, label smoothing, a
softcap, ...) then reach the ops as SymFloats, and the argument checks must trace without a graph break (math.isfinite
cannot take one). Each case runs at two sizes through one compiled function and matches eager, value and gradient."""

import pytest
import torch

from tests._grid import randn
from tigon import ops

# name: (inputs at n rows, the op on them with a float f, the index of the input whose gradient is compared)
CASES = {
    "rms_norm": (lambda n: (randn(n, 8), randn(8)), lambda x, w, f: ops.rms_norm(x, w, f, offset=0.5)),
    "add_rms_norm": (lambda n: (randn(n, 8), randn(n, 8), randn(8)),
                     lambda x, r, w, f: ops.add_rms_norm(x, r, w, f)[0]),
    "layer_norm": (lambda n: (randn(n, 8), randn(8), randn(8)), lambda x, w, b, f: ops.layer_norm(x, w, b, f)),
    "qk_norm_rope": (lambda n: (randn(1, n, 2, 8), randn(1, n, 1, 8), randn(8), randn(8), randn(1, n, 8),
                                randn(1, n, 8)),
                     lambda q, k, wq, wk, c, s, f: ops.qk_norm_rope(q, k, wq, wk, c, s, f)[0]),
    "cross_entropy": (lambda n: (randn(n, 11), torch.randint(0, 11, (n,))),
                      lambda x, t, f: ops.cross_entropy(x, t, label_smoothing=f * 1e4, z_loss_scale=f, softcap=30.0)),
    "linear_cross_entropy": (lambda n: (randn(n, 8), randn(11, 8), torch.randint(0, 11, (n,))),
                             lambda h, w, t, f: ops.linear_cross_entropy(h, w, t, label_smoothing=f * 1e4)),
    "fused_linear_simpo": (lambda n: (randn(4, n, 8), randn(11, 8), torch.randint(0, 11, (4, n))),
                           lambda h, w, t, f: ops.fused_linear_simpo(h, w, t, beta=f * 1e4)[0]),
    "fused_linear_grpo": (lambda n: (randn(2, n, 8), randn(11, 8), torch.randint(0, 11, (2, n)),
                                     torch.ones(2, n, dtype=torch.long), randn(2)),
                          lambda h, w, ids, m, adv, f: ops.fused_linear_grpo(h, w, ids, m, adv, beta=f * 1e4)[0]),
    "fused_linear_jsd": (lambda n: (randn(n, 8), randn(11, 8), randn(n, 8), randn(11, 8), torch.randint(0, 11, (n,))),
                         lambda s, sw, t, tw, y, f: ops.fused_linear_jsd(s, sw, t, tw, y, beta=f * 1e4)[0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dynamic_fullgraph(name):
    make, op = CASES[name]
    torch._dynamo.reset()  # `run` is one code object for every case: each case's graphs would count as recompiles

    def run(*args):
        return op(*args).float().sum()

    compiled = torch.compile(run, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (3, 5):
        torch.manual_seed(n)
        inputs = make(n)
        got_x, want_x = (inputs[0].clone().requires_grad_() for _ in range(2))
        got = compiled(got_x, *inputs[1:], 1e-5)
        want = run(want_x, *inputs[1:], 1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        got.backward(), want.backward()
        torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-5, atol=1e-6)
