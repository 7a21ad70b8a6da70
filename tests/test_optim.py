"""tigon.optim.AdamW as a drop-in for torch.optim.AdamW: same trajectory, same state dict, fused clipping.

Tolerance of a trajectory in fp32 (the error model of tests/ops/test_adamw.py, step by step): each step's
update is computed by both optimizers within 8 u32 of |p| + |update| of the exact one, |update| <= lr / (1 - beta1)
* (1 - beta1) / sqrt(1 - beta2) (Adam's step bound) <= 32 lr here; over k steps the differences add up.
"""

import pytest
import torch

import tigon
from tests._grid import U32
from tigon import ops


def _model(seed=1, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 7)).to(device, dtype)


def _groups(model, lr=1e-2):
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.0, "lr": lr / 3}]


def _train(model, opt, steps, device, clip=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(17, 33, generator=g).to(device, next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        if clip is not None and isinstance(opt, torch.optim.AdamW):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        if clip is not None and isinstance(opt, tigon.optim.AdamW):
            norms.append(opt.grad_norm)
    return norms


def _close(a, b, steps, lr=1e-2):
    for p, q in zip(a.parameters(), b.parameters()):
        tol = steps * 16 * U32 * (p.detach().abs() + 32 * lr)
        assert ((p.detach() - q.detach()).abs() <= tol).all(), (p - q).abs().max().item()


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("maximize", [False, True])
def test_same_trajectory_as_torch_adamw(device, clip, maximize):
    a, b = _model(device=device), _model(device=device)
    ops.dispatch_counts.clear()
    oa = tigon.optim.AdamW(_groups(a), lr=1e-2, weight_decay=0.1, max_grad_norm=clip, maximize=maximize)
    ob = torch.optim.AdamW(_groups(b), lr=1e-2, weight_decay=0.1, maximize=maximize, foreach=False)
    na = _train(a, oa, 5, device, clip)
    nb = _train(b, ob, 5, device, clip)
    _close(a, b, 5)
    assert ops.dispatch_counts[("adamw", "triton")] == 10  # two groups, five steps: one launch each
    for x, y in zip(na, nb):
        assert abs(x.item() - y.item()) <= 1e-5 * y.item()  # both fp32 sums of ~2.6k squares
    assert all(s["step"].item() == 5 for s in oa.state.values())


def test_clipping_leaves_the_gradients_alone(device):
    a = _model(device=device)
    opt = tigon.optim.AdamW(a.parameters(), max_grad_norm=1e-3)
    a(torch.randn(4, 33, device=device)).sum().backward()
    grads = [p.grad.clone() for p in a.parameters()]
    opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(a.parameters(), grads))
    assert opt.grad_norm.device == grads[0].device and opt.grad_norm.item() > 1e-3


def test_bf16_with_fp32_moments(device):
    a = _model(dtype=torch.bfloat16, device=device)
    opt = tigon.optim.AdamW(a.parameters(), lr=1e-3, state_dtype=torch.float32)
    _train(a, opt, 2, device)
    st = opt.state[next(a.parameters())]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in a.parameters())


def test_state_dict_moves_between_tigon_and_torch(device):
    a, b = _model(device=device), _model(device=device)
    # 3 steps with tigon, then 3 with torch from tigon's state; and the other way round
    oa = tigon.optim.AdamW(a.parameters(), lr=1e-2)
    _train(a, oa, 3, device)
    oa2 = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
    oa2.load_state_dict(oa.state_dict())
    _train(a, oa2, 3, device)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    _train(b, ob, 3, device)
    ob2 = tigon.optim.AdamW(b.parameters(), lr=1e-2)
    ob2.load_state_dict(ob.state_dict())
    _train(b, ob2, 3, device)
    # each half replays the same three batches (seed 0) in both runs
    _close(a, b, 6)
    assert all(s["step"].item() == 6 for s in ob2.state.values())


def test_a_parameter_that_gets_its_first_gradient_later_has_its_own_step(device):
    a, b = _model(device=device), _model(device=device)
    oa = tigon.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    for m, o in ((a, oa), (b, ob)):
        for i in range(4):
            o.zero_grad()
            head = m[2] if i >= 2 else None
            x = torch.randn(5, 33, device=device, generator=torch.Generator(device=device).manual_seed(i))
            h = m[1](m[0](x))
            (head(h) if head is not None else h).pow(2).mean().backward()
            o.step()
    _close(a, b, 4)
    assert oa.state[a[2].weight]["step"].item() == 2 and oa.state[a[0].weight]["step"].item() == 4


def test_a_scheduler_drives_lr(device):
    a, b = _model(device=device), _model(device=device)
    oa, ob = tigon.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda s: 1.0 / (s + 1))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda s: 1.0 / (s + 1))
    for o, s, m in ((oa, sa, a), (ob, sb, b)):
        for _ in range(3):
            _train(m, o, 1, device)
            s.step()
    _close(a, b, 3)


@pytest.mark.parametrize("kw,error,match", [
    (dict(amsgrad=True), ValueError, "amsgrad=True is not supported"),
    (dict(capturable=True), ValueError, "capturable=True is not supported"),
    (dict(lr=torch.tensor(1e-3)), TypeError, "lr must be a Python number"),
    (dict(betas=(0.9,)), ValueError, "betas must be a pair"),
    (dict(betas=(0.9, 1.0)), ValueError, "beta1 and beta2 must be < 1"),
    (dict(max_grad_norm=0.0), ValueError, "max_grad_norm must be > 0"),
    (dict(state_dtype=torch.int8), TypeError, "state_dtype must be"),
    (dict(master_weights=1), TypeError, "master_weights must be True or False"),
])
def test_bad_arguments_are_refused_by_name(kw, error, match):
    with pytest.raises(error, match="tigon.optim.AdamW: " + match):
        tigon.optim.AdamW(_model().parameters(), **kw)


def test_non_contiguous_parameter_is_refused(device):
    p = torch.nn.Parameter(torch.zeros(4, 6, device=device).t())
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="tigon.optim.AdamW: a parameter of shape"):
        tigon.optim.AdamW([p]).step()


def test_fused_and_foreach_flags_are_accepted(device):
    a = _model(device=device)
    opt = tigon.optim.AdamW(a.parameters(), fused=True, foreach=False)
    _train(a, opt, 1, device)


def test_the_reference_path_takes_the_same_steps(monkeypatch):
    """With the kernels off (a CPU without TRITON_INTERPRET) the step runs the PyTorch reference, same results."""
    a, b = _model(), _model()
    oa = tigon.optim.AdamW(_groups(a), lr=1e-2, max_grad_norm=0.05)
    _train(a, oa, 3, "cpu", 0.05)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ops.dispatch_counts.clear()
    ob = tigon.optim.AdamW(_groups(b), lr=1e-2, max_grad_norm=0.05)
    _train(b, ob, 3, "cpu", 0.05)
    assert ops.dispatch_counts[("adamw", "reference")] == 6 and ops.dispatch_counts[("adamw", "triton")] == 0
    _close(a, b, 3)


def test_gradients_at_new_addresses(device):
    """The optimizer caches the device table of addresses per group; gradients allocated elsewhere next step (the
    old ones still alive) must be read from their new place."""
    a, b = _model(device=device), _model(device=device)
    oa = tigon.optim.AdamW(a.parameters(), lr=1e-2)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    keep = []
    for i in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            x = torch.randn(5, 33, device=device, generator=torch.Generator(device=device).manual_seed(i))
            m(x).pow(2).mean().backward()
            if o is oa:
                keep += [p.grad for p in m.parameters()]
                for p in m.parameters():
                    p.grad = p.grad.clone()  # a new block: the old one stays alive in `keep`
            o.step()
    _close(a, b, 3)
    assert len(oa._tables) == 1


def test_master_weights_keep_updates_below_half_an_ulp(device):
    """bf16 weights at 1.0 (ulp 2^-7 above it) and steps of ~1e-4 up: without masters every update rounds away;
    with them the fp32 master moves by the sum of the steps and the weight follows. (Steps up: the interpreter
    truncates toward zero where a GPU rounds to nearest, and both keep 1.0 + 1e-4 at 1.0.)"""
    def run(master):
        p = torch.nn.Parameter(torch.ones(300, dtype=torch.bfloat16, device=device))
        opt = tigon.optim.AdamW([p], lr=1e-4, weight_decay=0.0, master_weights=master, state_dtype=torch.float32)
        for _ in range(100):
            p.grad = -torch.ones_like(p)
            opt.step()
        return p, opt
    plain, _ = run(False)
    assert (plain == 1.0).all()
    p, opt = run(True)
    w = opt.state[p]["master"]
    assert w.dtype == torch.float32 and w.shape == p.shape
    # Adam with a constant gradient steps lr per step (m_hat / sqrt(v_hat) = 1, fp32 moments): 100 steps of 1e-4
    assert torch.allclose(w, torch.full_like(w, 1.01), rtol=0, atol=1e-5)
    assert (p == 1.0078125).all()  # 1.01 between the bf16 values 1.0078125 and 1.015625, either rounding
    assert "master" in opt.state_dict()["state"][0]


def test_master_weights_leave_fp32_parameters_alone(device):
    a, b = _model(device=device), _model(device=device)
    oa = tigon.optim.AdamW(a.parameters(), lr=1e-2, master_weights=True)
    ob = tigon.optim.AdamW(b.parameters(), lr=1e-2)
    _train(a, oa, 2, device)
    _train(b, ob, 2, device)
    assert all("master" not in st for st in oa.state.values())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_compiled_training_step_calls_the_step_eagerly(device):
    """torch.compile over a function that runs forward, backward and opt.step(): the step is a graph break
    (torch.compiler.disable: host tables and scalars) and the result is the eager one."""
    a, b = _model(device=device), _model(device=device)
    oa, ob = tigon.optim.AdamW(a.parameters(), lr=1e-2), tigon.optim.AdamW(b.parameters(), lr=1e-2)
    x = torch.randn(5, 33, device=device)

    def train_step(model, opt):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    compiled = torch.compile(train_step, backend="eager")
    for _ in range(2):
        compiled(a, oa)
        train_step(b, ob)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("clip", [None, 0.05])
def test_norm_at_next_step_is_the_norm_the_step_clips_by(device, clip):
    """One pass serves clipping and logging: the tensor handed out before step() holds clip_grad_norm_'s norm after
    it; without max_grad_norm the step computes it and clips nothing (the same trajectory as unclipped torch)."""
    a, b = _model(device=device), _model(device=device)
    oa = tigon.optim.AdamW(_groups(a), lr=1e-2, max_grad_norm=clip)
    ob = torch.optim.AdamW(_groups(b), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(17, 33, generator=g).to(device)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        out = oa.norm_at_next_step(device)
        assert out.isnan() and out.dtype == torch.float32
        ref = torch.nn.utils.clip_grad_norm_(b.parameters(), clip if clip is not None else float("inf"))
        oa.step()
        ob.step()
        assert abs(out.item() - ref.item()) <= 1e-5 * ref.item()
    _close(a, b, 3)
    oa.step()  # handed out once: the next step fills nothing
    assert not oa._norm_outs
