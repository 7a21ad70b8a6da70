import sys

import pytest
import torch

from tests._grid import DTYPES, U32, KernelSpy, assert_bound, fp64_copy, grads, randn, sum_ulps
from tigon import ops
from tigon.ops import reference

HIDDEN = [1, 7, 200, 1000, 4097]
MODES = [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)]


def _check(op_name, kernel_fn, ref_fn, eager_fn, inputs, dtype, n_out):
    """Forward and every gradient: kernel vs fp64 reference vs the HF formula in dtype."""
    outs = kernel_fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ref_in = fp64_copy(*inputs)
    refs = ref_fn(*ref_in)
    refs = refs if isinstance(refs, tuple) else (refs,)
    eager_in = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eags = eager_fn(*eager_in)
    eags = eags if isinstance(eags, tuple) else (eags,)
    for i in range(n_out):
        assert_bound(f"{op_name} out{i}", outs[i], eags[i], refs[i], dtype)
    gos = [torch.randn(o.shape, dtype=torch.float32, device=o.device).to(o.dtype) for o in outs[:n_out]]
    g_k = grads(outs[:n_out], inputs, gos)
    g_r = grads(refs[:n_out], ref_in, [g.double() for g in gos])
    g_e = grads(eags[:n_out], eager_in, [g.to(e.dtype) for g, e in zip(gos, eags)])
    for j, (a, b, c) in enumerate(zip(g_k, g_e, g_r)):
        if c is not None:
            assert_bound(f"{op_name} grad{j}", a, b, c, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("mode,offset", MODES)
def test_rms_norm(device, dtype, hidden, mode, offset):
    torch.manual_seed(hidden)
    x = randn(3, hidden, dtype=dtype, device=device, requires_grad=True)
    w = randn(hidden, dtype=dtype, device=device, requires_grad=True)
    kw = dict(offset=offset, casting_mode=mode)
    _check(
        "rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-6, **kw), lambda x, w: reference.rms_norm(x, w, 1e-6, **kw),
        lambda x, w: reference.eager_rms_norm(x, w, 1e-6, **kw), (x, w), dtype, 1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [7, 1000])
@pytest.mark.parametrize("mode,offset", MODES)
def test_add_rms_norm(device, dtype, hidden, mode, offset):
    torch.manual_seed(hidden)
    x = randn(5, hidden, dtype=dtype, device=device, requires_grad=True)
    r = randn(5, hidden, dtype=dtype, device=device, requires_grad=True)
    w = randn(hidden, dtype=dtype, device=device, requires_grad=True)
    kw = dict(offset=offset, casting_mode=mode)
    _check(
        "add_rms_norm", lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6, **kw),
        lambda x, r, w: reference.add_rms_norm(x, r, w, 1e-6, **kw),
        lambda x, r, w: reference.eager_add_rms_norm(x, r, w, 1e-6, **kw), (x, r, w), dtype, 2,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 11, 9, 64), (2, 5, 31, 100)])
@pytest.mark.parametrize("mode,offset", MODES)
def test_short_rows_go_in_tiles(device, dtype, shape, mode, offset):
    """QK-norm shapes ([batch, seq, heads, head_dim]): rows of <= 512 are normalized in tiles of rows, 128 rows
    of 64 or 64 of 100 (padded to 128). 297 rows: three tiles, the last one partial; 310 rows: five tiles, the
    last partial; the backward's 4 interpreter programs loop over them. Forward and every gradient against fp64
    and the HF formula in dtype, for rms_norm and add_rms_norm."""
    import sys

    mod = sys.modules["tigon.ops.rms_norm"]
    assert mod._rows_per_tile(128) == 64 and mod._rows_per_tile(64) == 128 and mod._rows_per_tile(1024) == 1
    torch.manual_seed(shape[-1])
    x = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    r = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    w = randn(shape[-1], dtype=dtype, device=device, requires_grad=True)
    kw = dict(offset=offset, casting_mode=mode)
    _check(
        "rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-6, **kw), lambda x, w: reference.rms_norm(x, w, 1e-6, **kw),
        lambda x, w: reference.eager_rms_norm(x, w, 1e-6, **kw), (x, w), dtype, 1,
    )
    _check(
        "add_rms_norm", lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6, **kw),
        lambda x, r, w: reference.add_rms_norm(x, r, w, 1e-6, **kw),
        lambda x, r, w: reference.eager_add_rms_norm(x, r, w, 1e-6, **kw), (x, r, w), dtype, 2,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
def test_wide_rows_in_tiles_when_a_config_asks(device, dtype, mode, offset, monkeypatch):
    """A config's tile_elems tiles rows wider than 512 too: rows of 600 (padded to 1024) two a tile with 2048,
    7 rows: three full tiles and one partial, looped over by the backward's programs. Forward and every gradient
    against fp64 and the HF formula in dtype."""
    from tigon.ops.config import RMSNormConfig

    mod = sys.modules["tigon.ops.rms_norm"]
    assert mod._rows_per_tile(1024, 2048) == 2 and mod._rows_per_tile(1024, 512) == 1
    fwd, bwd = KernelSpy(mod._rms_norm_fwd_kernel), KernelSpy(mod._rms_norm_bwd_kernel)
    monkeypatch.setattr(mod, "_rms_norm_fwd_kernel", fwd)
    monkeypatch.setattr(mod, "_rms_norm_bwd_kernel", bwd)
    cfg = RMSNormConfig(tile_elems=2048)
    torch.manual_seed(600)
    x, r = (randn(7, 600, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    w = randn(600, dtype=dtype, device=device, requires_grad=True)
    kw = dict(offset=offset, casting_mode=mode)
    _check(
        "rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-6, config=cfg, **kw),
        lambda x, w: reference.rms_norm(x, w, 1e-6, **kw), lambda x, w: reference.eager_rms_norm(x, w, 1e-6, **kw),
        (x, w), dtype, 1,
    )
    _check(
        "add_rms_norm", lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6, config=cfg, **kw),
        lambda x, r, w: reference.add_rms_norm(x, r, w, 1e-6, **kw),
        lambda x, r, w: reference.eager_add_rms_norm(x, r, w, 1e-6, **kw), (x, r, w), dtype, 2,
    )
    assert {c["BLOCK_M"] for c in fwd.calls + bwd.calls} == {2}


def test_runs_the_kernel_on_this_device(device):
    before = ops.dispatch_counts[("rms_norm", "triton")]
    ops.rms_norm(torch.randn(2, 8, device=device), torch.ones(8, device=device))
    assert ops.dispatch_counts[("rms_norm", "triton")] == before + 1


def test_non_contiguous_3d_and_frozen_weight(device):
    x = randn(2, 3, 33, dtype=torch.bfloat16, device=device, transposed=True, requires_grad=True)
    assert not x.is_contiguous()
    w = randn(33, dtype=torch.bfloat16, device=device)
    y = ops.rms_norm(x, w)
    ref = reference.rms_norm(x.detach().double(), w.double())
    # two roundings to bf16 (the normalized x, then its product with w), each < 1 ulp <= 2^-7 |value|: the
    # interpreter's casts truncate (half that on a GPU, which rounds to nearest)
    assert ((y.double() - ref).abs() <= 2 ** -6 * (1 + 2 ** -7) * ref.abs() + 1e-30).all()
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert dx.shape == x.shape and torch.isfinite(dx).all()


def test_strided_weight(device):
    x = randn(3, 8, device=device)
    w = randn(16, device=device)[::2]
    torch.testing.assert_close(ops.rms_norm(x, w), reference.rms_norm(x, w))


def test_weight_dtype_promotion_matches_llama(device):
    x = randn(4, 64, dtype=torch.bfloat16, device=device)
    w = randn(64, dtype=torch.float32, device=device)
    y = ops.rms_norm(x, w)
    assert y.dtype == reference.eager_rms_norm(x, w).dtype == torch.float32
    e = reference.eager_rms_norm(x, w)
    # n is rounded to bf16 before the fp32 weight, so an rstd one ulp apart may flip one bf16 rounding of n
    assert (y - e).abs().max() <= 2**-7 * e.abs().max()  # one bf16 ulp of n, times |w|


def test_add_rms_norm_grads_reach_both_inputs_independently(device):
    # dx and dresidual are equal values: a later in-place update of one must not change the other.
    x = randn(3, 16, device=device, requires_grad=True)
    r = randn(3, 16, device=device, requires_grad=True)
    y, s = ops.add_rms_norm(x, r, torch.ones(16, device=device))
    (y.sum() + s.sum()).backward()
    torch.testing.assert_close(x.grad, r.grad)
    x.grad.add_(1.0)
    assert not torch.equal(x.grad, r.grad)


def test_empty_rows(device):
    x = torch.empty(0, 16, device=device, requires_grad=True)
    y = ops.rms_norm(x, torch.ones(16, device=device, requires_grad=True))
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 16)


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda d: ops.rms_norm(torch.ones(2, 4, device=d), torch.ones(5, device=d)), ValueError, "weight"),
        (lambda d: ops.rms_norm(torch.ones(2, 4, dtype=torch.long, device=d), None), TypeError, "x"),
        (lambda d: ops.rms_norm(torch.ones(2, 4, device=d), torch.ones(4, device=d), eps=0), ValueError, "eps"),
        (lambda d: ops.rms_norm(torch.ones(2, 4, device=d), torch.ones(4, device=d), casting_mode="x"),
         ValueError, "casting_mode"),
        (lambda d: ops.rms_norm(torch.ones(1, 70000, device=d), None), ValueError, "hidden size"),
        (lambda d: ops.add_rms_norm(torch.ones(2, 4, device=d), torch.ones(2, 5, device=d), None),
         ValueError, "residual"),
        (lambda d: ops.add_rms_norm(torch.ones(2, 4, device=d), torch.ones(2, 4, dtype=torch.half, device=d),
                                    None), TypeError, "residual"),
    ],
)
def test_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=match):
        call(device)


def test_opcheck(device):
    x = randn(3, 7, device=device, requires_grad=True)
    r = randn(3, 7, device=device, requires_grad=True)
    w = randn(7, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.tigon.rms_norm_fwd, (x, r, w, 1e-6, 0.0, 0, torch.float32))
    torch.library.opcheck(torch.ops.tigon.rms_norm_fwd, (x, None, w, 1e-6, 1.0, 1, torch.float32))


def test_compile_fullgraph_uses_the_custom_op(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    x = randn(4, 24, device=device, requires_grad=True)
    r = randn(4, 24, device=device, requires_grad=True)
    w = randn(24, device=device, requires_grad=True)
    fn = lambda x, r, w: ops.add_rms_norm(x, r, w)[0].sum() + ops.rms_norm(x, w).square().sum()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = grads(compiled(x, r, w), (x, r, w), torch.tensor(1.0, device=device))
    want = grads(fn(x, r, w), (x, r, w), torch.tensor(1.0, device=device))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("path", ["function", "custom_op"])
def test_config_reaches_both_launches(device, monkeypatch, path):
    # The warps, programs per SM and short-row tile of an RMSNormConfig reach the forward and backward launches
    # on the eager (autograd.Function) and the custom-op path. The interpreter ignores warps and uses 4
    # programs, and the tile groups rows without changing their math, so there the result is the default's,
    # bit for bit; on a GPU warps and programs reorder the fp32 sums (a row's over H, dw's over the programs'
    # partial rows): each result is then within 2 * u * (LAMBDA sqrt(24) + 8) of its terms' scale, which for
    # these unit-normal inputs stays under 4x the output's largest value.
    import sys

    from tigon.ops import _launch
    from tigon.ops.config import RMSNormConfig

    mod = sys.modules["tigon.ops.rms_norm"]  # the module: tigon.ops.rms_norm is the function

    fwd, bwd, per_sm = KernelSpy(mod._rms_norm_fwd_kernel), KernelSpy(mod._rms_norm_bwd_kernel), []
    monkeypatch.setattr(mod, "_rms_norm_fwd_kernel", fwd)
    monkeypatch.setattr(mod, "_rms_norm_bwd_kernel", bwd)
    programs = _launch.num_programs
    monkeypatch.setattr(_launch, "num_programs", lambda d, rows, per_sm_=None, **kw: per_sm.append(
        kw.get("per_sm", per_sm_)) or programs(d, rows, kw.get("per_sm", per_sm_)))
    cfg = RMSNormConfig(fwd_warps=2, bwd_warps=16, bwd_per_sm=3, tile_elems=64)
    x, r, w = (randn(*s, device=device) for s in ((5, 24), (5, 24), (24,)))
    outs = []
    for c in (None, cfg):
        xs = [t.clone().requires_grad_() for t in (x, r, w)]
        if path == "function":
            y, _ = ops.add_rms_norm(*xs, config=c)
        else:
            y, _, _ = torch.ops.tigon.rms_norm_fwd(xs[0], xs[1], xs[2], 1e-6, 0.0, 0, torch.float32,
                                                   None if c is None else c.ints())
        outs.append((y, *grads(y, xs, torch.ones_like(y))))
    # rows of 24 go in tiles of rows, whose default is 4 warps
    assert [c["num_warps"] for c in fwd.calls] == [4, 2] and [c["num_warps"] for c in bwd.calls] == [4, 16]
    # rows of 24 pad to 32: 8192 // 32 = 256, capped at 128 rows a tile by default; 64 // 32 = 2 with the config
    assert [c["BLOCK_M"] for c in fwd.calls] == [128, 2] and [c["BLOCK_M"] for c in bwd.calls] == [128, 2]
    assert per_sm == [2, 3]
    for a, b in zip(*outs):
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            tol = 2 * U32 * (sum_ulps(24) + 8) * 4 * b.abs().max().item()
            assert (a - b).abs().max().item() <= tol
    with pytest.raises(TypeError, match="rms_norm: config must be"):
        ops.rms_norm(x, w, config=(2, 16, 3))
    torch.library.opcheck(torch.ops.tigon.rms_norm_fwd, (x.requires_grad_(), None, w, 1e-6, 0.0, 0, torch.float32,
                                                        cfg.ints()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rows_is_the_public_op_without_its_checks(device, dtype):
    # The unchecked row entry of the decode wing's prefill: the same kernel and launch as rms_norm /
    # add_rms_norm in "llama" casting, so the same bits.
    x, r = randn(37, 96, dtype=dtype, device=device), randn(37, 96, dtype=dtype, device=device)
    w = randn(96, dtype=dtype, device=device)
    m = sys.modules["tigon.ops.rms_norm"]
    y, s = m.rms_norm_rows(x, w, 1e-5)
    assert s is None and torch.equal(y, ops.rms_norm(x, w, 1e-5))
    y, s = m.rms_norm_rows(x, w, 1e-5, residual=r)
    y_ref, s_ref = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)


def test_row_entries_compile_to_their_custom_ops(device):
    # The prefill's unchecked entries under torch.compile(fullgraph=True): the custom ops, the eager bits.
    from tigon.ops.swiglu import glu_rows

    m = sys.modules["tigon.ops.rms_norm"]
    x, r = randn(7, 40, device=device), randn(7, 40, device=device)
    w = randn(40, device=device)

    def f(x, r, w):
        y, s = m.rms_norm_rows(x, w, 1e-5, residual=r)
        return glu_rows(y, s, "silu"), m.rms_norm_rows(x, w, 1e-5)[0]

    torch._dynamo.reset()
    for got, want in zip(torch.compile(f, fullgraph=True)(x, r, w), f(x, r, w)):
        assert torch.equal(got, want)


def test_default_backward_keeps_about_8192_elements_of_rows_in_flight_an_sm():
    """One row a program: backward programs per SM for ~8192 elements an SM, at least 2 (the measured plan)."""
    import sys

    mod = sys.modules["tigon.ops.rms_norm"]
    assert [mod._launch_plan(h, None)[3] for h in (1024, 2048, 4096, 8192, 16384)] == [8, 4, 2, 2, 2]
    assert [mod._launch_plan(h, None)[0] for h in (1024, 2048)] == [1, 1]  # rows of 1024 on: one a program
    assert mod._launch_plan(1024, [0, 0, 3, 0])[3] == 3  # a config's count wins
