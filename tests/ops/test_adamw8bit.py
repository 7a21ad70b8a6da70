"""tigon.ops.adamw8bit_step_ and the 8-bit moment format: the kernel against the reference and torch's AdamW.

Error model. The kernel and the reference run the same fp32 operations in the same order, each one IEEE rounding
(the reference takes its divisions and sqrt through fp64, which rounds to the same fp32 quotient and root as
Triton's div_rn / sqrt_rn). On the CPU (the interpreter computes each operation in numpy's IEEE fp32) the fp32
values, hence every code and scale, are the same bits; the interpreter's cast to bf16 truncates where torch
rounds to nearest, so a bf16 param may be 1 ulp off. On a GPU the multiply-adds contract to FMAs (one rounding
instead of two): each fp32 value may be a few u32 of its terms' magnitudes off (8 u32, as in test_adamw.py), so
the param is within 1 ulp of its dtype plus 8 u32 of those magnitudes, and a code moves by one step where that
difference carries bits(u) + r across a multiple of 2^20 (about one element in 2^19 a u32 of difference; a
block's scale an ulp off moves its u's by an ulp each).

Encoding error: between two neighbouring codes L < x < U of one binade, U - L = 2^-3 2^e <= 2^-3 x, so a decoded
value is within 2^-3 |x| of x (plus the fp32 roundings of u and of the decode, 2 u32), or within the smallest
code's value where x is below it (flushed to 0 or rounded up to it).
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from tests._grid import U32
from tigon import ops
from tigon.ops import _library, adamw8bit, reference
from tigon.ops.config import AdamW8bitConfig

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
SMALL = AdamW8bitConfig(blocks_per_program=2)  # 512 elements a program: several programs, unmasked and masked
BIG = AdamW8bitConfig(blocks_per_program=8)  # one program for the longer runs (the interpreter's cost is per program)
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}
SHAPES = [(1,), (255,), (257,), (1000,), (4096 + 37,), (4, 128), (33, 31)]
STEP = 2.0**-3  # a code step, relative to the value


def _smallest(signed: bool) -> float:
    """The value of code 1 at scale 1 (below it values flush to 0 or round up to it)."""
    return reference.decode_moment(torch.tensor([1], dtype=torch.uint8), torch.ones(1), signed).item()


def _moments(shape, device, seed=0, step=0):
    """A state as after some steps: random float moments, quantized."""
    g = torch.Generator().manual_seed(seed)
    m = 0.05 * torch.randn(shape, generator=g)
    v = 0.01 * torch.rand(shape, generator=g) ** 2
    return list(ops.quantize_moments(m.to(device), v.to(device), step=step))


def _param_grad(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    return (torch.randn(shape, generator=g).to(device, dtype),
            (0.5 * torch.randn(shape, generator=g)).to(device, dtype))


def _within_a_code_step(got_codes, got_scales, want_codes, want_scales, signed):
    got, want = (reference.decode_moment(c.cpu(), s.cpu(), signed).double()
                 for c, s in ((got_codes, got_scales), (want_codes, want_scales)))
    scale = torch.maximum(got_scales.cpu(), want_scales.cpu()).double().repeat_interleave(256)[:got.numel()]
    tol = STEP * torch.maximum(got.abs(), want.abs()) * (1 + 4 * U32) + _smallest(signed) * scale
    return bool(((got - want).abs() <= tol).all())


# the hash -------------------------------------------------------------------------------------------------------


@triton.jit
def _hash_probe_kernel(OUT, base, seed, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + o, adamw8bit._moment_hash(base + o, seed).to(tl.int32, bitcast=True))


def _hash_py(i: int, seed: int) -> int:
    x = (i & 0xFFFFFFFF) ^ seed
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@pytest.mark.parametrize("base", [0, 2**32 - 300, 2**40 + 7])
@pytest.mark.parametrize("seed", [reference.moment_seed(1, 1), reference.moment_seed(12345, 2), 0x7FFFFFFF, 0])
def test_hash_is_the_same_bits_in_triton_and_torch(device, base, seed):
    n = 1024
    out = torch.empty(n, dtype=torch.int32, device=device)
    _hash_probe_kernel[(n // 256,)](out, base, seed, BLOCK=256)
    want = reference.moment_hash(torch.arange(base, base + n), seed)
    assert torch.equal(out.cpu().long() & 0xFFFFFFFF, want)
    assert [_hash_py(base + i, seed) for i in (0, 1, 517, n - 1)] == [want[i].item() for i in (0, 1, 517, n - 1)]
    assert want.min() >= 0 and want.max() < 2**32


def test_seeds_differ_by_step_and_moment():
    seeds = {reference.moment_seed(s, salt) for s in range(1, 200) for salt in (1, 2)}
    assert len(seeds) == 398 and all(0 <= s < 2**31 for s in seeds)


# the format -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed", [True, False])
def test_representable_values_round_trip_exactly(signed):
    cmax = 127 if signed else 255
    codes = torch.arange(3 * 256) % (cmax + 1)
    codes[::256] = cmax  # each block holds its max, so its scale is the one given
    if signed:
        codes = codes | ((torch.arange(codes.numel()) % 3 == 0).long() << 7)  # a third negative
    codes = codes.to(torch.uint8)
    scales = torch.tensor([1.0, 2.0**-20, 2.0**7])
    x = reference.decode_moment(codes, scales, signed)
    for step in (1, 2, 77):
        got, got_scales = reference.encode_moment(x, reference.moment_seed(step, 1), signed)
        # -0.0 and 0.0 are one value: a negative code 0 encodes as code 0
        assert torch.equal(got, torch.where(codes & 0x7F == 0, 0, codes).to(torch.uint8) if signed else codes)
        assert torch.equal(got_scales, scales)
        assert torch.equal(reference.decode_moment(got, got_scales, signed), x)


def test_block_max_is_cmax_zeros_are_zero_and_the_sign_is_the_top_bit():
    x = torch.zeros(600)
    x[3], x[4], x[300], x[301] = 0.5, -0.25, -7.0, 7.0  # blocks 0 and 1; block 2 all zero
    m, ms = reference.encode_moment(x, 123, True)
    assert m[3] == 127 and m[4] == 0x80 | (127 - 8) and m[300] == 0xFF and m[301] == 127
    assert torch.equal(ms, torch.tensor([0.5, 7.0, 0.0]))
    assert (m[512:] == 0).all() and m[5] == 0
    v, vs = reference.encode_moment(x.abs(), 123, False)
    assert v[3] == 255 and v[300] == 255 and v[4] == 255 - 8 and (v[512:] == 0).all()
    assert torch.equal(reference.decode_moment(m, ms, True)[[3, 4, 300, 301]], torch.tensor([0.5, -0.25, -7.0, 7.0]))


@pytest.mark.parametrize("signed", [True, False])
def test_decoded_values_are_within_a_code_step(signed):
    g = torch.Generator().manual_seed(3)
    n = 20 * 256 + 17
    x = torch.exp(8 * torch.randn(n, generator=g))  # 2^-35 .. 2^35: every binade of a block, and flushed values
    if signed:
        x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    codes, scales = reference.encode_moment(x, reference.moment_seed(5, 2), signed)
    got = reference.decode_moment(codes, scales, signed).double()
    xd = x.double()
    floor = _smallest(signed) * scales.double().repeat_interleave(256)[:n]
    tol = STEP * xd.abs() + 2 * U32 * xd.abs() + floor
    assert ((got - xd).abs() <= tol).all()
    assert (got == 0).any() and (got != xd).float().mean() > 0.5  # the flush and the rounding were exercised
    # negative control: a decode a quarter off fails the bound
    assert not ((got * 1.25 - xd).abs() <= tol).all()


@pytest.mark.parametrize("signed,value", [(True, 0.3), (True, -0.3), (False, 0.3), (False, 0.003)])
def test_stochastic_rounding_is_unbiased(signed, value):
    """255 elements of one value beside their block's max of 1.0, over 64 steps' seeds: the mean of the decodes
    is the value within 4 standard errors; round-to-nearest would be ~100 standard errors off."""
    x = torch.full((64 * 256,), value)
    x[::256] = 1.0
    draws = []
    for step in range(1, 65):
        codes, scales = reference.encode_moment(x, reference.moment_seed(step, 1 if signed else 2), signed)
        draws.append(reference.decode_moment(codes, scales, signed).view(64, 256)[:, 1:].double())
    draws = torch.cat(draws).flatten()
    lo, hi = draws.min().item(), draws.max().item()
    exact = torch.tensor(value, dtype=torch.float32).double().item()
    assert lo < exact < hi and hi - lo <= STEP * abs(exact) * (1 + 1e-6)  # two neighbours, one code step apart
    p = (exact - lo) / (hi - lo)
    se = (hi - lo) * math.sqrt(p * (1 - p) / draws.numel())
    assert abs(draws.mean().item() - exact) <= 4 * se
    assert min(abs(lo - exact), abs(hi - exact)) > 20 * se  # a biased rounding would fail the bound above
    again = reference.encode_moment(x, reference.moment_seed(64, 1 if signed else 2), signed)
    assert torch.equal(again[0], codes), "deterministic for a given step"


# the kernel -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_codes_are_the_reference_encoding(device, dtype):
    """beta1 = beta2 = 0 makes the new moments g and g * g exactly (0 * m + 1 * g, even as an FMA), so the
    kernel's codes and scales are the reference's encoding of them, bit for bit on any device."""
    shape = (4096 + 37,)
    p, g = _param_grad(shape, dtype, device, seed=1)
    state = _moments(shape, device, seed=1)
    for step in (1, 2, 9):
        ops.adamw8bit_step_(p, g, *state, **dict(HYPER, beta1=0.0, beta2=0.0), step=step, config=SMALL)
        gf = g.float().cpu()
        want = ops.quantize_moments(gf, gf * gf, step=step)
        for got, w in zip(state, want):
            assert torch.equal(got.cpu(), w)


def _exact_param(p0, g, state, step, hyper=HYPER):
    """The fp64 update from the decoded moments and the magnitude of its terms (the error model's mag)."""
    lr, b1, b2, eps, wd = (hyper[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    m0, v0 = (t.double() for t in reference.dequantize_moments(*(s.cpu() for s in state), p0.shape))
    p0, g = p0.cpu().double(), g.cpu().double()
    m, v = b1 * m0 + (1 - b1) * g, b2 * v0 + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2**step) + eps
    step_size = lr / (1 - b1**step)
    p = p0 * (1 - lr * wd) - step_size * m / denom
    mag = p0.abs() * (1 + lr * wd) + step_size * (b1 * m0.abs() + (1 - b1) * g.abs()) / denom
    return p, mag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_the_reference(device, dtype, shape):
    p, g = _param_grad(shape, dtype, device)
    state = _moments(shape, device, step=0)
    g_before = g.clone()
    for step in (1, 2, 3):
        kp, ks = p.clone(), [t.clone() for t in state]
        ops.dispatch_counts.clear()
        ops.adamw8bit_step_(kp, g, *ks, **HYPER, step=step, config=SMALL)
        assert ops.dispatch_counts[("adamw8bit", "triton")] == 1
        rp, rs = p.cpu().clone(), [t.cpu().clone() for t in state]
        reference.adamw8bit_step_(rp, g.cpu(), *rs, **HYPER, step=step)
        exact, mag = _exact_param(p, g, state, step)
        tol = ULP[dtype] * exact.abs() + 8 * U32 * mag
        assert ((kp.cpu().double() - rp.double()).abs() <= tol + ULP[dtype] * rp.double().abs()).all()
        assert ((rp.double() - exact).abs() <= tol).all(), "the reference is the update, rounded once"
        if device.type == "cpu":  # the interpreter: the same fp32 bits; its bf16 cast truncates (1 ulp)
            assert torch.equal(ks[0], rs[0]) and torch.equal(ks[1], rs[1])
            assert torch.equal(ks[2], rs[2]) and torch.equal(ks[3], rs[3])
            if dtype != torch.bfloat16:
                assert torch.equal(kp, rp)
        else:
            for codes, scales, ref_codes, ref_scales, signed in ((*ks[:2], *rs[:2], True), (*ks[2:], *rs[2:], False)):
                assert (codes.cpu() != ref_codes).sum() <= max(1, 0.01 * codes.numel())
                assert ((scales.cpu().double() - ref_scales.double()).abs() <= 8 * U32 * ref_scales.double()).all()
                assert _within_a_code_step(codes, scales, ref_codes, ref_scales, signed)
        assert torch.equal(g, g_before), "the grad is read only"
        p, state = rp.to(device), [t.to(device) for t in rs]  # on from the reference: no drift between the two


def test_the_kernel_is_deterministic(device):
    p, g = _param_grad((3000,), torch.bfloat16, device, seed=4)
    state = _moments((3000,), device, seed=4)
    twin_p, twin_state = p.clone(), [t.clone() for t in state]
    for step in (1, 2):
        ops.adamw8bit_step_(p, g, *state, **HYPER, step=step, config=SMALL)
        ops.adamw8bit_step_(twin_p, g, *twin_state, **HYPER, step=step, config=SMALL)
    assert torch.equal(p, twin_p) and all(torch.equal(a, b) for a, b in zip(state, twin_state))


def test_launch_settings_change_nothing(device):
    p, g = _param_grad((2000,), torch.float32, device, seed=5)
    state = _moments((2000,), device, seed=5)
    outs = []
    for cfg in (AdamW8bitConfig(blocks_per_program=1, num_warps=2), SMALL, BIG):
        q, s = p.clone(), [t.clone() for t in state]
        ops.adamw8bit_step_(q, g, *s, **HYPER, step=4, config=cfg)
        outs.append([q, *s])
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_tracks_torch_adamw_on_a_linear_regression(device):
    """50 steps of least squares (an [8, 250] weight: 8 blocks, a partial last one) from zero, fp32, against
    torch.optim.AdamW. The 8-bit moments are an approximation: given the same history a decoded m is within a
    code step (2^-3) of the exact one, so the new m is within beta1 2^-3 = 11% and the new v within 2^-3, and the
    step m / sqrt(v) within ~19% of AdamW's; stochastic rounding makes these errors zero-mean, so over T steps
    they partly cancel. Loose bounds from that: every weight within 0.25 lr T of torch's (the worst case with
    |m| / sqrt(v) <= 1.3), the loss within 10% of torch's at every step, the total update's direction within
    a cosine of 0.99."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 250, generator=g)
    Y = X @ (torch.randn(8, 250, generator=g) / 250**0.5).T + 0.01 * torch.randn(256, 8, generator=g)

    def loss_grad(w):
        w = w.detach().cpu().requires_grad_()
        with torch.enable_grad():
            loss = ((X @ w.T - Y) ** 2).mean()
            loss.backward()
        return loss.item(), w.grad

    lr, steps = 1e-2, 50
    w_torch = torch.zeros(8, 250, requires_grad=True)
    opt = torch.optim.AdamW([w_torch], lr=lr, weight_decay=0.01)
    w8 = torch.zeros(8, 250, device=device)
    state = ops.new_moments(w8)
    for step in range(1, steps + 1):
        loss_t, w_torch.grad = loss_grad(w_torch)
        opt.step()
        loss_8, grad = loss_grad(w8)
        ops.adamw8bit_step_(w8, grad.to(device), *state, lr=lr, weight_decay=0.01, step=step, config=BIG)
        assert abs(loss_8 - loss_t) <= 0.1 * loss_t, (step, loss_8, loss_t)
    d_torch, d8 = w_torch.detach().flatten(), w8.cpu().flatten()
    assert (d8 - d_torch).abs().max() <= 0.25 * lr * steps
    assert torch.nn.functional.cosine_similarity(d8, d_torch, 0) >= 0.99
    assert loss_grad(w8)[0] < 0.01 * loss_grad(torch.zeros(8, 250))[0]  # it trains


def test_clipping_scales_the_gradient(device):
    shape = (1000,)
    p, g = _param_grad(shape, torch.float32, device, seed=6)
    state = _moments(shape, device, seed=6)
    norm = torch.tensor([4.0], device=device)
    kp, ks = p.clone(), [t.clone() for t in state]
    ops.adamw8bit_step_(kp, g, *ks, **HYPER, step=2, max_grad_norm=1.0, norm=norm, config=SMALL)
    rp, rs = p.cpu().clone(), [t.cpu().clone() for t in state]
    reference.adamw8bit_step_(rp, g.cpu(), *rs, **HYPER, step=2, max_grad_norm=1.0, norm=norm.cpu())
    up, us = p.clone(), [t.clone() for t in state]
    ops.adamw8bit_step_(up, g, *us, **HYPER, step=2, config=SMALL)
    exact, mag = _exact_param(p, g * (1.0 / (4.0 + 1e-6)), state, 2)
    assert ((kp.cpu().double() - exact).abs() <= ULP[torch.float32] * exact.abs() + 8 * U32 * mag).all()
    assert ((up.cpu().double() - exact).abs() > 1e-5).any(), "clipping changed the update"
    if device.type == "cpu":
        assert torch.equal(kp, rp) and all(torch.equal(a, b) for a, b in zip(ks, rs))
    # a norm under the limit: coef 1, the unclipped step to the bit
    cp, cs = p.clone(), [t.clone() for t in state]
    ops.adamw8bit_step_(cp, g, *cs, **HYPER, step=2, max_grad_norm=1.0, norm=torch.tensor([0.5], device=device),
                        config=SMALL)
    assert torch.equal(cp, up) and all(torch.equal(a, b) for a, b in zip(cs, us))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_maximize_steps_on_the_negated_gradient(device, dtype):
    p, g = _param_grad((700,), dtype, device, seed=7)
    state = _moments((700,), device, seed=7)
    a, sa = p.clone(), [t.clone() for t in state]
    b, sb = p.clone(), [t.clone() for t in state]
    ops.adamw8bit_step_(a, g, *sa, **HYPER, step=3, maximize=True, config=SMALL)
    ops.adamw8bit_step_(b, -g, *sb, **HYPER, step=3, config=SMALL)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(sa, sb))


def test_weight_decay_alone(device):
    """A zero gradient on zero moments: the param is only decayed, p (1 - lr wd) rounded once, and the moments
    stay zero (scale 0: code 0 for every element)."""
    p = _param_grad((513,), torch.float32, device, seed=8)[0]
    state = list(ops.new_moments(p))
    want = p.cpu() * (1.0 - 1e-2 * 0.1)
    ops.adamw8bit_step_(p, torch.zeros_like(p), *state, lr=1e-2, weight_decay=0.1, step=1, config=SMALL)
    assert torch.equal(p.cpu(), want)
    assert all((t == 0).all() for t in state)


def test_writes_stay_inside_each_tensor(device):
    """The param, grad and state as views at odd offsets of larger buffers (unaligned addresses), the padding
    NaN / 0xAB: nothing outside the views changes, and the result is the contiguous twin's."""
    n, nb = 1000, 4
    pad = 13

    def inside(buf, k):
        return buf[pad:pad + k]
    bufs = [torch.full((n + 2 * pad,), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(2)]
    codes = [torch.full((n + 2 * pad,), 0xAB, dtype=torch.uint8, device=device) for _ in range(2)]
    scales = [torch.full((nb + 2 * pad,), float("nan"), device=device) for _ in range(2)]
    p, g = _param_grad((n,), torch.bfloat16, device, seed=9)
    state = _moments((n,), device, seed=9)
    inside(bufs[0], n).copy_(p)
    inside(bufs[1], n).copy_(g)
    views = [inside(codes[0], n), inside(scales[0], nb), inside(codes[1], n), inside(scales[1], nb)]
    for v, s in zip(views, state):
        v.copy_(s)
    ops.adamw8bit_step_(inside(bufs[0], n), inside(bufs[1], n), *views, **HYPER, step=2, config=SMALL)
    ops.adamw8bit_step_(p, g, *state, **HYPER, step=2, config=SMALL)
    assert torch.equal(inside(bufs[0], n), p) and all(torch.equal(v, s) for v, s in zip(views, state))
    for buf, k in ((bufs[0], n), (bufs[1], n), (scales[0], nb), (scales[1], nb)):
        assert buf[:pad].isnan().all() and buf[pad + k:].isnan().all()
    for buf in codes:
        assert (buf[:pad] == 0xAB).all() and (buf[pad + n:] == 0xAB).all()
    assert torch.isfinite(p).all() and torch.isfinite(state[1]).all() and torch.isfinite(state[3]).all()


def test_reference_path_is_the_kernel_path(device, monkeypatch):
    """With the kernels off (CPU without the interpreter) the op runs the reference: the same result."""
    p, g = _param_grad((600,), torch.float32, device, seed=10)
    state = _moments((600,), device, seed=10)
    kp, ks = p.clone(), [t.clone() for t in state]
    ops.adamw8bit_step_(kp, g, *ks, **HYPER, step=1, config=SMALL)
    monkeypatch.setattr(_library, "interpreter_on", lambda: False)
    rp, rs = p.cpu().clone().requires_grad_(), [t.cpu().clone() for t in state]  # a leaf, as in a grad hook
    ops.dispatch_counts.clear()
    ops.adamw8bit_step_(rp, g.cpu(), *rs, **HYPER, step=1)
    assert ops.dispatch_counts[("adamw8bit", "reference")] == 1
    if device.type == "cpu":
        assert torch.equal(kp, rp.detach()) and all(torch.equal(a, b) for a, b in zip(ks, rs))
    else:  # the GPU's FMAs (the module docstring)
        assert _within_a_code_step(*ks[:2], *rs[:2], True) and _within_a_code_step(*ks[2:], *rs[2:], False)


def test_a_param_that_requires_grad_is_updated_in_place(device):
    p, g = _param_grad((300,), torch.float32, device, seed=11)
    leaf = p.clone().requires_grad_()
    state = _moments((300,), device, seed=11)
    twin = [t.clone() for t in state]
    ops.adamw8bit_step_(leaf, g, *state, **HYPER, step=1, config=SMALL)
    ops.adamw8bit_step_(p, g, *twin, **HYPER, step=1, config=SMALL)
    assert torch.equal(leaf.detach(), p) and leaf.requires_grad


def test_opcheck(device):
    p, g = _param_grad((700,), torch.float32, device, seed=12)
    state = _moments((700,), device, seed=12)
    norm = torch.tensor([2.0], device=device)
    torch.library.opcheck(torch.ops.tigon.adamw8bit_step_, (p, g, *state, norm, 1e-2, 0.9, 0.999, 1e-8, 0.1, 2,
                                                            False, 0.5, list(SMALL.ints())))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_compile_is_the_eager_result(device, backend):
    p, g = _param_grad((777,), torch.bfloat16, device, seed=13)
    state = _moments((777,), device, seed=13)
    twin_p, twin_state = p.clone(), [t.clone() for t in state]
    norm = torch.tensor([3.0], device=device)

    def fn(p, g, mc, ms, vc, vs):
        for step in (1, 2):
            ops.adamw8bit_step_(p, g, mc, ms, vc, vs, **HYPER, step=step, max_grad_norm=1.0, norm=norm, config=SMALL)
        return p.float().sum()

    got = torch.compile(fn, fullgraph=True, backend=backend)(p, g, *state)
    want = fn(twin_p, g, *twin_state)
    assert torch.equal(got, want) and torch.equal(p, twin_p)
    assert all(torch.equal(a, b) for a, b in zip(state, twin_state))


def test_empty_param_is_a_no_op(device):
    p = torch.zeros(0, 5, device=device)
    state = ops.new_moments(p)
    assert [t.shape for t in state] == [(0,), (0,), (0,), (0,)]
    ops.adamw8bit_step_(p, torch.zeros_like(p), *state, lr=1e-3, step=1)


# the state ------------------------------------------------------------------------------------------------------


def test_new_moments_are_zeros_of_the_format(device):
    p = torch.ones(3, 300, dtype=torch.bfloat16, device=device)
    mc, ms, vc, vs = ops.new_moments(p)
    assert ops.MOMENT_BLOCK == 256
    for t, dtype, n in ((mc, torch.uint8, 900), (ms, torch.float32, 4), (vc, torch.uint8, 900),
                        (vs, torch.float32, 4)):
        assert t.dtype == dtype and t.shape == (n,) and t.device == p.device and (t == 0).all()
    m, v = ops.dequantize_moments(mc, ms, vc, vs, p.shape)
    assert m.shape == v.shape == p.shape and m.dtype == torch.float32 and (m == 0).all() and (v == 0).all()


def test_a_torch_adamw_state_converts_within_a_code_step(device):
    w = torch.nn.Parameter(torch.randn(5, 211))
    opt = torch.optim.AdamW([w], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn_like(w)
        opt.step()
    st = opt.state[w]
    m, v = st["exp_avg"].to(device), st["exp_avg_sq"].to(device)
    state = ops.quantize_moments(m, v, step=3)
    assert all(t.device == m.device for t in state)
    m8, v8 = ops.dequantize_moments(*state, m.shape)
    for got, want, signed, scales in ((m8, m, True, state[1]), (v8, v, False, state[3])):
        floor = _smallest(signed) * scales.cpu().double().repeat_interleave(256)[:want.numel()].view(want.shape)
        tol = STEP * want.cpu().double().abs() * (1 + 4 * U32) + floor
        assert ((got.cpu().double() - want.cpu().double()).abs() <= tol).all()


def test_quantize_moments_in_chunks_is_one_encoding(monkeypatch):
    g = torch.Generator().manual_seed(14)
    m, v = torch.randn(2000, generator=g), torch.rand(2000, generator=g)
    whole = ops.quantize_moments(m, v, step=5)
    monkeypatch.setattr(adamw8bit, "_QUANTIZE_CHUNK", 512)
    chunked = ops.quantize_moments(m, v, step=5)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    assert not torch.equal(whole[0], ops.quantize_moments(m, v, step=6)[0]), "each step its own rounding"


@pytest.mark.parametrize("case,error,match", [
    ("noncontiguous", ValueError, "param must be a dense contiguous tensor"),
    ("grad_dtype", TypeError, "grad has dtype torch.float16 but param has dtype torch.float32"),
    ("grad_shape", ValueError, r"grad has shape \(2, 3\) but param has \(6,\)"),
    ("int_param", TypeError, "param must be float32, float16 or bfloat16"),
    ("codes_dtype", TypeError, "m_codes must be torch.uint8, got torch.float32"),
    ("scales_dtype", TypeError, "v_scales must be torch.float32, got torch.bfloat16"),
    ("codes_size", ValueError, r"v_codes must be a contiguous 1-D tensor of shape \(6,\) \(a code per element\)"),
    ("codes_2d", ValueError, r"m_codes must be a contiguous 1-D tensor of shape \(6,\).*got shape \(2, 3\)"),
    ("scales_size", ValueError, r"m_scales must be a contiguous 1-D tensor of shape \(1,\)"),
    ("state_device", ValueError, "v_codes is on meta but param is on"),
    ("no_norm", ValueError, "max_grad_norm needs norm, .* got NoneType"),
    ("norm_shape", ValueError, r"max_grad_norm needs norm, .* got shape \(2,\)"),
    ("step0", ValueError, "step must be an int >= 1"),
    ("beta2", ValueError, "beta1 and beta2 must be < 1"),
    ("maximize", TypeError, "maximize must be a bool"),
    ("config", TypeError, "config must be an AdamW8bitConfig"),
])
def test_bad_input_is_refused_by_name(device, case, error, match):
    p, g = torch.zeros(6, device=device), torch.zeros(6, device=device)
    state = list(ops.new_moments(p))
    kw = dict(HYPER, step=1)
    if case == "noncontiguous":
        p = torch.zeros(12, device=device)[::2]
    elif case == "grad_dtype":
        g = g.half()
    elif case == "grad_shape":
        g = g.view(2, 3)
    elif case == "int_param":
        p = p.int()
    elif case == "codes_dtype":
        state[0] = state[0].float()
    elif case == "scales_dtype":
        state[3] = state[3].bfloat16()
    elif case == "codes_size":
        state[2] = state[2][:5]
    elif case == "codes_2d":
        state[0] = state[0].view(2, 3)
    elif case == "scales_size":
        state[1] = torch.zeros(2, device=device)
    elif case == "state_device":
        state[2] = torch.zeros(6, dtype=torch.uint8, device="meta")
    elif case == "no_norm":
        kw["max_grad_norm"] = 1.0
    elif case == "norm_shape":
        kw.update(max_grad_norm=1.0, norm=torch.ones(2, device=device))
    elif case == "step0":
        kw["step"] = 0
    elif case == "beta2":
        kw["beta2"] = 1.0
    elif case == "maximize":
        kw["maximize"] = 1
    elif case == "config":
        kw["config"] = ops.AdamWConfig()
    with pytest.raises(error, match="tigon.ops.adamw8bit_step_: " + match):
        ops.adamw8bit_step_(p, g, *state, **kw)


def test_state_helpers_refuse_bad_input_by_name(device):
    with pytest.raises(ValueError, match=r"tigon.ops.quantize_moments: exp_avg_sq has shape \(3,\) but exp_avg"):
        ops.quantize_moments(torch.zeros(4, device=device), torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="tigon.ops.quantize_moments: step must be an int >= 0"):
        ops.quantize_moments(torch.zeros(4, device=device), torch.zeros(4, device=device), step=-1)
    state = ops.new_moments(torch.zeros(300, device=device))
    with pytest.raises(ValueError, match=r"tigon.ops.dequantize_moments: m_codes must be .* shape \(299,\)"):
        ops.dequantize_moments(*state, (299,))
    with pytest.raises(TypeError, match="tigon.ops.dequantize_moments: shape must be a sequence of ints"):
        ops.dequantize_moments(*state, 300.0)


def test_a_nan_gradient_stays_in_its_element(device):
    """A NaN gradient element: its param is NaN (as torch's AdamW), its codes are cmax, and its block's scales and
    every other element stay finite; kernel and reference agree (NaN bits of any payload or sign encode alike)."""
    p, g = _param_grad((700,), torch.float32, device, seed=15)
    g[300] = float("nan")
    state = _moments((700,), device, seed=15)
    rp, rs = p.cpu().clone(), [t.cpu().clone() for t in state]
    ops.adamw8bit_step_(p, g, *state, **HYPER, step=2, config=SMALL)
    reference.adamw8bit_step_(rp, g.cpu(), *rs, **HYPER, step=2)
    for q in (p.cpu(), rp):
        assert q[300].isnan() and torch.isfinite(torch.cat([q[:300], q[301:]])).all()
    for s in (state, rs):
        assert s[0][300] == 127 and s[2][300] == 255 and torch.isfinite(s[1]).all() and torch.isfinite(s[3]).all()
    if device.type == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(state, rs))
    else:
        assert _within_a_code_step(*state[:2], *rs[:2], True) and _within_a_code_step(*state[2:], *rs[2:], False)
