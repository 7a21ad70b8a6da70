"""tigon.optim.AdamW's memory settings: step_in_backward (each parameter stepped from its post-accumulate-grad
hook, its gradient freed) and state_bits=8 (block-quantized moments, tigon.ops.adamw8bit_step_).

Stepping in the backward runs the same kernel on the same numbers as step() after the backward, one parameter at a
time instead of a table of them: the weights must come out bit for bit equal. The 8-bit moments are an
approximation of torch's AdamW (3 mantissa bits, stochastic rounding); their trajectory is checked loosely against
the fp32 one, and exactly against the same optimizer stepping after the backward.
"""

import pytest
import torch
import torch.utils.checkpoint as cp

import tigon
from tigon import ops


def _model(seed=1, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 300)).to(device, dtype)


def _groups(model, lr=1e-2):
    return [{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.0, "lr": lr / 3}]


def _loss(model, x, checkpoint=None):
    if checkpoint is None:
        return model(x).float().pow(2).mean()
    h = cp.checkpoint(lambda t: model[1](model[0](t)), x, use_reentrant=checkpoint == "reentrant")
    return model[2](h).float().pow(2).mean()


def _train(model, opt, steps, device, checkpoint=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(17, 33, generator=g).to(device, dtype)
        if checkpoint == "reentrant":
            x.requires_grad_(True)  # a reentrant checkpoint backpropagates only through inputs that need it
        _loss(model, x, checkpoint).backward()
        if getattr(opt, "step_in_backward", False):
            assert all(p.grad is None for p in model.parameters()), "the backward frees what it stepped"
        opt.step()
        opt.zero_grad()


def _same(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q), (p - q).abs().max().item()


@pytest.mark.parametrize("state_bits", [None, 8])
@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non-reentrant"])
def test_step_in_backward_matches_step_after_backward_bitwise(device, state_bits, checkpoint):
    a, b = _model(device=device), _model(device=device)
    ops.dispatch_counts.clear()
    oa = tigon.optim.AdamW(_groups(a), lr=1e-2, weight_decay=0.1, state_bits=state_bits, step_in_backward=True)
    ob = tigon.optim.AdamW(_groups(b), lr=1e-2, weight_decay=0.1, state_bits=state_bits)
    _train(a, oa, 4, device, checkpoint)
    _train(b, ob, 4, device, checkpoint)
    _same(a, b)
    assert all(s["step"].item() == 4 for s in oa.state.values()) and len(oa.state) == 4
    name = "adamw8bit" if state_bits == 8 else "adamw"
    # the 8-bit step launches once a parameter in both; the 16-bit one once a parameter against once a group
    assert ops.dispatch_counts[(name, "triton")] == 4 * 4 + 4 * (4 if state_bits == 8 else 2)


def test_8bit_moments_track_fp32_adamw(device):
    """A regression fitted for 60 steps in fp32: the 8-bit moments' loss stays within 10% of torch's AdamW's at
    every step past the first ten (each moment is within 2^-3 of its value and unbiased, so the updates differ by a
    few percent and do not drift), and both fall by more than half. fp32 weights, so that only the moments differ
    (bf16 weights add their own rounding, the same with either optimizer)."""
    dtype = torch.float32
    torch.manual_seed(0)
    w_true = torch.randn(48, 31)
    x = torch.randn(256, 31)
    y = x @ w_true.T

    def run(make):
        w = torch.nn.Parameter(torch.zeros(48, 31, dtype=dtype, device=device))
        opt, losses = make([w]), []
        for _ in range(60):
            loss = (x.to(device, dtype) @ w.T - y.to(device, dtype)).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    ref = run(lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.0))
    q8 = run(lambda ps: tigon.optim.AdamW(ps, lr=3e-2, weight_decay=0.0, state_bits=8))
    for r, q in list(zip(ref, q8))[10:]:
        assert abs(q - r) <= 0.1 * r + 1e-3, (q, r)
    assert q8[-1] < 0.5 * q8[0] and ref[-1] < 0.5 * ref[0]


def test_8bit_state_dict_and_loading_float_moments(device):
    a, b = _model(device=device), _model(device=device)
    torch_opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _train(a, torch_opt, 2, device)
    b.load_state_dict(a.state_dict())
    opt = tigon.optim.AdamW(b.parameters(), lr=1e-2, state_bits=8)
    opt.load_state_dict(torch_opt.state_dict())
    _train(b, opt, 1, device, seed=5)
    for p in b.parameters():
        st = opt.state[p]
        assert "exp_avg" not in st and st["step"].item() == 3
        assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_codes"].numel() == p.numel()
        assert st["exp_avg_sq_scales"].numel() == -(-p.numel() // ops.MOMENT_BLOCK)
    again = tigon.optim.AdamW(_model(device=device).parameters(), lr=1e-2, state_bits=8)
    again.load_state_dict(opt.state_dict())  # its own state moves as it is
    assert torch.equal(again.state_dict()["state"][0]["exp_avg_codes"], opt.state_dict()["state"][0]["exp_avg_codes"])


def test_8bit_clipping_inside_the_step(device):
    """max_grad_norm with 8-bit moments: the norm is the clip_grad_norm_ one, and the update is the one of the
    gradients clipped first (fp32: the same products, at most an ulp of the clipped gradient apart)."""
    a, b = _model(device=device), _model(device=device)
    oa = tigon.optim.AdamW(a.parameters(), lr=1e-2, state_bits=8, max_grad_norm=0.05)
    ob = tigon.optim.AdamW(b.parameters(), lr=1e-2, state_bits=8)
    out = oa.norm_at_next_step(device)
    x = torch.randn(17, 33, device=device)
    _loss(a, x).backward()
    _loss(b, x).backward()
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
    oa.step()
    ob.step()
    assert abs(out.item() - want.item()) <= 1e-5 * want.item() and oa.grad_norm is not None
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)


def test_remove_hooks_and_a_collected_optimizer_leave_the_gradients(device):
    m = _model(device=device)
    opt = tigon.optim.AdamW(m.parameters(), lr=1e-2, step_in_backward=True)
    before = [p.detach().clone() for p in m.parameters()]
    opt.remove_hooks()
    _loss(m, torch.randn(3, 33, device=device)).backward()
    assert all(p.grad is not None for p in m.parameters())
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    opt.step()  # step() steps what it finds
    assert not any(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    m2 = _model(device=device)
    opt2 = tigon.optim.AdamW(m2.parameters(), lr=1e-2, step_in_backward=True)
    del opt2  # the hooks hold it weakly: they do nothing now
    _loss(m2, torch.randn(3, 33, device=device)).backward()
    assert all(p.grad is not None for p in m2.parameters())


def test_step_in_backward_reads_the_group_lr_of_the_moment(device):
    """An LR scheduler between steps: the next backward's updates use the new lr, also after load_state_dict
    (which replaces the group dicts)."""
    a, b = _model(device=device), _model(device=device)
    oa = tigon.optim.AdamW(a.parameters(), lr=1e-2, step_in_backward=True)
    ob = tigon.optim.AdamW(b.parameters(), lr=1e-2)
    sa, sb = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (oa, ob))
    for i in range(3):
        _train(a, oa, 1, device, seed=i)
        _train(b, ob, 1, device, seed=i)
        sa.step()
        sb.step()
        if i == 1:
            oa.load_state_dict(oa.state_dict())
    _same(a, b)


def test_bad_settings_name_the_argument():
    ps = _model().parameters()
    with pytest.raises(ValueError, match="max_grad_norm"):
        tigon.optim.AdamW(ps, step_in_backward=True, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="state_bits must be None or 8"):
        tigon.optim.AdamW(_model().parameters(), state_bits=4)
    with pytest.raises(ValueError, match="state_dtype and master_weights"):
        tigon.optim.AdamW(_model().parameters(), state_bits=8, state_dtype=torch.float32)
    with pytest.raises(ValueError, match="state_dtype and master_weights"):
        tigon.optim.AdamW(_model().parameters(), state_bits=8, master_weights=True)
    with pytest.raises(TypeError, match="AdamW8bitConfig"):
        tigon.optim.AdamW(_model().parameters(), state_bits=8, config=ops.AdamWConfig())
    with pytest.raises(TypeError, match="step_in_backward must be True or False"):
        tigon.optim.AdamW(_model().parameters(), step_in_backward=1)


def test_step_in_backward_under_a_compiled_model(device):
    """torch.compile(fullgraph=True) over the model: the compiled backward's gradients still reach the parameters'
    post-accumulate-grad hooks, so the updates are those of the eager model (aot_eager: the same kernels)."""
    a, b = _model(device=device), _model(device=device)
    oa = tigon.optim.AdamW(a.parameters(), lr=1e-2, state_bits=8, step_in_backward=True)
    ob = tigon.optim.AdamW(b.parameters(), lr=1e-2, state_bits=8, step_in_backward=True)
    compiled = torch.compile(a, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(17, 33, generator=g).to(device)
        compiled(x).float().pow(2).mean().backward()
        b(x).float().pow(2).mean().backward()
        assert all(p.grad is None for p in a.parameters())
    assert all(s["step"].item() == 3 for s in oa.state.values()) and len(oa.state) == len(ob.state) == 4
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q), (p - q).abs().max().item()
