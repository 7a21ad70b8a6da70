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


# Run in a fresh interpreter without TRITON_INTERPRET (conftest sets it for this process): CPU tensors must then take
# the PyTorch path, in the public op (dispatch_counts) and inside every custom op's body (opcheck calls the bodies
# directly; on a CUDA machine a CPU pointer handed to Triton's launcher raised "cannot be accessed from Triton").
_NO_INTERPRETER = r'''
import json, math, torch
from tests.ops._loss_helpers import head
from tigon import ops
from tigon.ops import reference
from tigon.ops import FusedLinearLossConfig
ops.dispatch_counts.clear()
CFG = FusedLinearLossConfig(chunk_rows=7)
B, T, H, V = 4, 5, 24, 67
h, w, b, t = head(B, T, H, V, torch.float32)
hr = h.detach().reshape(-1, H).requires_grad_()
tf = t.reshape(-1)
labels = torch.tensor([True, False, True, False])
mask = (t != -100).long()
ids = torch.where(t == -100, 0, t)
adv = torch.tensor([1.0, -0.5, 0.25, 2.0])
hs = torch.randn(B * T, H, generator=torch.Generator().manual_seed(1))
ht = torch.randn(B * T, 2 * H, generator=torch.Generator().manual_seed(2))
wt = torch.randn(V, 2 * H, generator=torch.Generator().manual_seed(3)) * 0.2
ws = w.detach().clone().requires_grad_()
hs.requires_grad_()
calls = {
    "fused_linear_preference": [lambda k=k: ops.fused_linear_preference(h, w, t, b, kind=k, compute_nll_loss=True)[0]
                                for k in ("dpo", "orpo", "cpo", "simpo")],
    "fused_linear_kto": [lambda: ops.fused_linear_kto(h, w, t, labels, b)[0]],
    "fused_linear_grpo": [lambda lv=lv: ops.fused_linear_grpo(h, w, ids, mask, adv, b, importance_sampling_level=lv,
                                                               entropy_coef=0.1)[0] for lv in ("token", "sequence")],
    "fused_linear_jsd": [lambda bt=bt: ops.fused_linear_jsd(hs, ws, ht, wt, tf, beta=bt)[0] for bt in (0.0, 0.5, 1.0)],
    "fused_linear_logprobs": [lambda: ops.fused_linear_logprobs(h, w, t, b, temperature=0.7)[0].sum()],
}
for fns in calls.values():
    for f in fns:
        f().backward()
counts = {op: [ops.dispatch_counts[(op, "reference")], ops.dispatch_counts[(op, "triton")]] for op in calls}
tu = ("test_schema", "test_faketensor", "test_autograd_registration")
fl = [0.1, 1.0, 0.0, 0.5, 0.05]
lp_fwd = torch.ops.tigon.fused_linear_logprobs_fwd(hr, w, tf, b, 1.0, -100, CFG.ints())
checks = {
    "fused_linear_preference": (hr, w, t, b, tf.view(B, T), None, None, None, None, "orpo", "sigmoid", fl, -100, True,
                                True, True, True, True, CFG.ints()),
    "fused_linear_kto": (hr, w, t, labels, b, hr.detach(), w.detach(), None, None, None, 0.1, -100, False, True, True,
                         True, CFG.ints()),
    "fused_linear_grpo": (hr, w, ids, mask, adv, b, None, None, None, None, None, None, [0.04, 0.2, 0.2, 0.7, math.nan,
                          0.1], "dapo", "token", 0, True, True, True, CFG.ints()),
    "fused_linear_jsd": (hs, ws, ht, wt, tf, None, None, [0.5, 0.5, 0.5, 2.0], -100, True, True, False, CFG.ints()),
    "fused_linear_logprobs_fwd": (hr, w, tf, b, 1.0, -100, CFG.ints()),
    "fused_linear_logprobs_bwd": (torch.rand(B * T), torch.rand(B * T), hr.detach(), w.detach(), tf, b.detach(),
                                  lp_fwd[5], lp_fwd[1], 1.0, -100, True, True, True, CFG.ints()),
}
opcheck = {}
for name, args in checks.items():
    torch.library.opcheck(getattr(torch.ops.tigon, name).default, args, test_utils=tu)
    opcheck[name] = "ok"
# the op bodies' PyTorch rows against the fp64 reference, loss and every gradient
h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
err = {}
ref = reference.fused_linear_preference(h64, w64, t, b64, kind="dpo", compute_nll_loss=True)[0]
got = torch.ops.tigon.fused_linear_preference(hr.detach(), w.detach(), t, b.detach(), None, None, None, None, None,
                                              "dpo", "sigmoid", fl, -100, True, False, True, True, True, CFG.ints())
want = torch.autograd.grad(ref, [h64, w64, b64])
err["dpo"] = max(float((g.double().reshape(r.shape) - r).abs().max() / r.abs().max().clamp(min=1e-30))
                 for g, r in zip([got[0], *got[10:13]], [ref, *want]))
hs64, ws64 = (x.detach().double().requires_grad_() for x in (hs, ws))
ref = reference.fused_linear_jsd(hs64, ws64, ht.double(), wt.double(), tf, beta=0.5, temperature=2.0)[0]
got = torch.ops.tigon.fused_linear_jsd(hs.detach(), ws.detach(), ht, wt, tf, None, None, [0.5, 0.5, 0.5, 2.0], -100,
                                       True, True, False, CFG.ints())
want = torch.autograd.grad(ref, [hs64, ws64])
err["jsd"] = max(float((g.double() - r).abs().max() / r.abs().max().clamp(min=1e-30))
                 for g, r in zip([got[0], got[3], got[4]], [ref, *want]))
print("RESULT " + json.dumps({"counts": counts, "opcheck": opcheck, "err": err}))
'''


def test_cpu_without_interpreter_runs_the_pytorch_path(tmp_path):
    """What a CUDA machine does with CPU tensors: every loss op records the reference path, each custom op's body
    runs its PyTorch rows (opcheck passes) and equals the fp64 reference to fp32 rounding."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "src"), env.get("PYTHONPATH", "")])
    script = tmp_path / "no_interpreter.py"
    script.write_text(_NO_INTERPRETER)
    proc = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    got = json.loads(line[len("RESULT "):])
    want_calls = {"fused_linear_preference": 4, "fused_linear_kto": 1, "fused_linear_grpo": 2, "fused_linear_jsd": 3,
                  "fused_linear_logprobs": 1}
    assert got["counts"] == {op: [n, 0] for op, n in want_calls.items()}
    assert set(got["opcheck"]) == {"fused_linear_preference", "fused_linear_kto", "fused_linear_grpo",
                                   "fused_linear_jsd", "fused_linear_logprobs_fwd", "fused_linear_logprobs_bwd"}
    # fp32 rows of V = 67 and GEMMs of H = 24: a few hundred ulps of 6e-8 at most; 1e-4 leaves room, a wrong
    # formula is off by O(1)
    assert all(e < 1e-4 for e in got["err"].values()), got["err"]
