"""_library.dispatch, the one rule every op follows on the kernel path: torch.compile -> the custom op, eager with a
gradient wanted -> the autograd.Function (or the custom op's own autograd), eager otherwise -> the plain launcher.
The three paths run the same launchers, so an op's output is the same bits whichever one ran."""

import sys
from pathlib import Path

import pytest
import torch

from tests._grid import randn
from tigon import ops
from tigon.ops import _library


def test_dispatch_picks_the_path(device):
    calls = []

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            calls.append("function")
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def op(x):
        calls.append("op")
        return x * 2

    def launcher(x):
        calls.append("launcher")
        return x * 2

    x = torch.ones(3, device=device)
    xg = x.clone().requires_grad_()
    _library.dispatch(op, Function, launcher, x, grad_from=(x,))
    _library.dispatch(op, Function, launcher, xg, grad_from=(xg,))
    _library.dispatch(op, None, launcher, xg, grad_from=(xg,))
    with torch.no_grad():
        _library.dispatch(op, Function, launcher, xg, grad_from=(xg,))
    _library.dispatch(op, Function, launcher, xg, grad_from=(None,))
    assert calls == ["launcher", "function", "op", "launcher", "launcher"]
    calls.clear()
    torch.compile(lambda t: _library.dispatch(op, Function, launcher, t, grad_from=(t,)), fullgraph=True,
                  backend="eager")(x)
    assert calls == ["op"]


def _cases(device):
    torch.manual_seed(0)
    x = randn(5, 24, dtype=torch.bfloat16, device=device)
    w = randn(24, dtype=torch.bfloat16, device=device)
    g, u = randn(5, 24, dtype=torch.bfloat16, device=device), randn(5, 24, dtype=torch.bfloat16, device=device)
    q, k = randn(1, 2, 3, 8, device=device), randn(1, 1, 3, 8, device=device)
    ang = torch.rand(1, 3, 4, device=device)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    logits, t = randn(4, 50, device=device), torch.randint(0, 50, (4,), device=device)
    wg, wu, wd = randn(16, 24, device=device), randn(16, 24, device=device), randn(24, 16, device=device)
    xf = randn(3, 24, device=device)
    return {
        "rms_norm": (lambda a: ops.rms_norm(a[0], a[1]), (x, w)),
        "add_rms_norm": (lambda a: ops.add_rms_norm(a[0], a[1], a[2]), (x, g, w)),
        "layer_norm": (lambda a: ops.layer_norm(a[0], a[1], None), (x, w)),
        "swiglu": (lambda a: ops.swiglu(a[0], a[1]), (g, u)),
        "apply_rope": (lambda a: ops.apply_rope(a[0], a[1], cos, sin), (q, k)),
        "cross_entropy": (lambda a: ops.cross_entropy(a[0], t), (logits,)),
        "swiglu_mlp": (lambda a: ops.swiglu_mlp(a[0], a[1], a[2], a[3]), (xf, wg, wu, wd)),
    }


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "layer_norm", "swiglu", "apply_rope", "cross_entropy",
                                  "swiglu_mlp"])
def test_inference_and_training_paths_give_the_same_bits(device, name):
    fn, inputs = _cases(device)[name]
    with torch.no_grad():
        plain = fn(inputs)
    trained = fn([t.detach().clone().requires_grad_() for t in inputs])
    plain = plain if isinstance(plain, tuple) else (plain,)
    trained = trained if isinstance(trained, tuple) else (trained,)
    assert all(torch.equal(a, b.detach()) for a, b in zip(plain, trained))
    assert all(b.requires_grad for b in trained)


def test_no_op_reads_a_custom_ops_private_body():
    """The eager bypass keeps its own reference to each launcher: nothing reads torch.library internals."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("tigon.ops") and getattr(mod, "__file__", None):
            with open(mod.__file__) as f:
                assert "_init_fn" not in f.read(), name


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_path_loss_takes_an_in_place_update(monkeypatch, reduction):
    """CPU tensors without Triton's interpreter take the reference path (the GPU machine's CPU tests do). Its loss
    must take what the kernel path's takes: the Trainer scales the loss in place (`loss *= scale`) before
    backward, which autograd refuses on a view returned by a custom Function. The gradient is then exactly twice
    the unscaled one: scaling by 2 is exact in fp32, and both backwards run the same reference ops."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # _library reads it per call
    assert _library.backend_for(torch.device("cpu")) == "reference"
    torch.manual_seed(0)
    h, w = randn(5, 16), randn(11, 16)
    t = torch.randint(0, 11, (5,))
    grads = []
    for scale in (1.0, 2.0):
        hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
        ops.dispatch_counts.clear()
        loss = ops.linear_cross_entropy(hg, wg, t, reduction=reduction)
        assert ops.dispatch_counts[("linear_cross_entropy", "reference")] == 1
        loss.mul_(scale)
        loss.sum().backward()
        grads.append((hg.grad, wg.grad))
    for one, two in zip(*grads):
        torch.testing.assert_close(two, 2 * one, rtol=0, atol=0)
    logits = randn(5, 11, requires_grad=True)
    loss = ops.cross_entropy(logits, t)
    loss.mul_(2)
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(NotImplementedError):  # still first order only, as the kernel path
        g, = torch.autograd.grad(ops.cross_entropy(logits, t), logits, create_graph=True)
        g.sum().backward()


def _training_calls(device):
    """One call of every public training op with inputs that want a gradient (tiny shapes: the interpreter)."""
    torch.manual_seed(0)

    def r(*shape):
        return randn(*shape, device=device).requires_grad_()

    x, w, g, u = r(3, 8), r(8), r(3, 8), r(3, 8)
    q, k = r(1, 2, 3, 8), r(1, 1, 3, 8)
    ang = torch.rand(1, 3, 4, device=device)
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    t = torch.randint(0, 11, (3,), device=device)
    pos = torch.randperm(6, device=device).view(3, 2)
    h3, w_head, tt = r(2, 3, 8), r(11, 8), torch.randint(0, 11, (2, 3), device=device)
    return {
        "rms_norm": lambda: ops.rms_norm(x, w),
        "add_rms_norm": lambda: ops.add_rms_norm(x, g, w)[0],
        "layer_norm": lambda: ops.layer_norm(x, w, None),
        "swiglu": lambda: ops.swiglu(g, u),
        "geglu": lambda: ops.geglu(g, u),
        "apply_rope": lambda: ops.apply_rope(q, k, cos, sin)[0],
        "qk_norm_rope": lambda: ops.qk_norm_rope(q.transpose(1, 2), k.transpose(1, 2), w, w, cos, sin)[0],
        "cross_entropy": lambda: ops.cross_entropy(r(3, 11), t),
        "linear_cross_entropy": lambda: ops.linear_cross_entropy(x, w_head, t),
        "swiglu_mlp": lambda: ops.swiglu_mlp(x, r(4, 8), r(4, 8), r(8, 4)),
        "moe_combine": lambda: ops.moe_combine(r(6, 8), r(3, 2), pos),
        "moe_permute": lambda: ops.moe_permute(x, pos),
        "lora_linear": lambda: ops.lora_linear(x, w_head, None, r(2, 8), r(11, 2), 0.5),
        "fused_linear_dpo": lambda: ops.fused_linear_dpo(h3[:2], w_head, tt[:2])[0],
        "fused_linear_kto": lambda: ops.fused_linear_kto(h3, w_head, tt, torch.tensor([True, False], device=device))[0],
        "fused_linear_grpo": lambda: ops.fused_linear_grpo(h3, w_head, tt, torch.ones_like(tt),
                                                           torch.rand(2, device=device))[0],
        "fused_linear_jsd": lambda: ops.fused_linear_jsd(x, w_head, x.detach(), w_head.detach(), t)[0],
        "fused_linear_logprobs": lambda: ops.fused_linear_logprobs(x, w_head, t)[0],
    }


def test_every_training_op_goes_through_dispatch(device, monkeypatch):
    """Each public training op, called eagerly with inputs that want a gradient, runs its kernel path through
    `_library.dispatch` (the one rule), and its result has a gradient."""
    seen = []
    rule = _library.dispatch
    monkeypatch.setattr(_library, "dispatch", lambda *a, **kw: seen.append(a[0]) or rule(*a, **kw))
    for name, call in _training_calls(device).items():
        seen.clear()
        out = call()
        assert seen, f"{name} did not go through _library.dispatch"
        assert out.requires_grad, name


def _sources(*folders):
    root = Path(__file__).resolve().parents[2] / "src" / "tigon"
    return [p for f in folders for p in sorted((root / f).rglob("*.py"))]


def test_only_the_library_asks_whether_torch_compile_traces():
    """`_library.tracing()` is the one question; no op or module file asks torch.compile itself."""
    askers = [p.name for p in _sources("ops", "modules") if p.name != "_library.py"
              and "is_compiling(" in p.read_text()]
    assert askers == []


# Inference and list-of-adapter ops that still write their custom op by hand (each already goes through dispatch).
_HAND_WRITTEN = {"decode_attention.py", "decode_linear.py", "kv_write.py", "lora_linear.py", "quant_linear.py"}


def test_training_ops_are_built_by_the_scaffold():
    """Every other op file registers its custom ops through `_library.Kernel` / `_library.Op`: no
    torch.library.custom_op or register_autograd of its own."""
    own = [p.name for p in _sources("ops") if p.name != "_library.py" and p.name not in _HAND_WRITTEN
           and ("torch.library.custom_op" in p.read_text() or ".register_autograd(" in p.read_text())]
    assert own == []
