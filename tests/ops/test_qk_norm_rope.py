"""qk_norm_rope: RMSNorm of every head of q and k over head_dim, then rotate-half RoPE, in one kernel.

Forward and the four gradients against the fp64 reference, with the HF formula in the input dtype as the
yardstick (Qwen3's q_norm / k_norm, then apply_rotary_pos_emb with cos / sin cast to the dtype): err(kernel) <=
2 * err(HF in dtype) + atol, atol the error model of `_assert_model`. Then the shapes, layouts, tiles, configs,
paths and refusals.
"""

import re
import sys

import pytest
import torch

from tests._grid import DTYPES, U32, UNIT_ROUNDOFF, KernelSpy, err, fp64_copy, grads, sum_ulps
from tests._grid import randn as _randn
from tigon import ops
from tigon.ops import _library, reference
from tigon.ops.config import QKNormRopeConfig, RopeConfig

mod = sys.modules["tigon.ops.qk_norm_rope"]  # the module: tigon.ops.qk_norm_rope is the function
OP = "tigon.ops.qk_norm_rope"
MODES = [("llama", 0.0), ("gemma", 1.0), ("none", 0.0)]
NAMES = ("dq", "dk", "dq_weight", "dk_weight")
# Where the `device` fixture runs the kernels: CUDA on a GPU machine, else the CPU under the interpreter. Every
# tensor of this file is made there (the reference-path cases pass their CPU device explicitly).
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, device=None, **kw):
    return _randn(*shape, device=device or torch.get_default_device(), **kw)


@pytest.fixture(autouse=True)
def _factories_on_the_kernels_device():
    with torch.device(DEV):  # torch.randn / ones / zeros / *_like without a device
        yield


def _heads(B, T, H, D, dtype, layout):
    """A [B, T, H, D] input in one of the layouts an attention module hands over."""
    if layout == "bthd":  # q_proj(x).view(B, T, H, D): dense
        return randn(B, T, H, D, dtype=dtype)
    if layout == "bhtd":  # a [B, H, T, D] tensor transposed to [B, T, H, D]: dense, not contiguous
        return randn(B, H, T, D, dtype=dtype).transpose(1, 2)
    if layout == "strided_head_dim":  # every other element of the last dim: copied to unit stride first
        return randn(B, T, H, 2 * D, dtype=dtype)[..., ::2]
    if layout == "expanded_batch":  # stride 0 over the batch
        return randn(1, T, H, D, dtype=dtype).expand(B, T, H, D)
    raise ValueError(layout)


def _inputs(B, T, Hq, Hk, D, dtype, *, layout="bthd", w_dtype=None, k_dtype=None, Bc=1, cs_dtype=torch.float32,
            strided_cs=False, grad=True, device=None):
    """q, k (requiring grad), q_weight, k_weight (requiring grad), cos, sin. layout "fused_qkv": q and k are slices
    of one qkv projection output [B, T, (Hq + 2 Hk) D] viewed to heads. cos / sin [Bc, T, D] random, their halves
    different (so a swapped half shows); strided_cs: transposed views of [Bc, D, T] (stride T on D)."""
    with torch.device(device or DEV):
        return _make_inputs(B, T, Hq, Hk, D, dtype, layout, w_dtype, k_dtype, Bc, cs_dtype, strided_cs, grad)


def _make_inputs(B, T, Hq, Hk, D, dtype, layout, w_dtype, k_dtype, Bc, cs_dtype, strided_cs, grad):
    if layout == "fused_qkv":
        qkv = randn(B, T, (Hq + 2 * Hk) * D, dtype=dtype)
        q, k = qkv[..., :Hq * D].view(B, T, Hq, D), qkv[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D)
        assert not q.is_contiguous() and not k.is_contiguous()
    else:
        q, k = _heads(B, T, Hq, D, dtype, layout), _heads(B, T, Hk, D, k_dtype or dtype, layout)
    wq = randn(D, dtype=w_dtype or dtype)
    wk = randn(D, dtype=w_dtype or dtype)
    if strided_cs:
        cos, sin = (randn(Bc, D, T, dtype=cs_dtype).transpose(1, 2) for _ in range(2))
    else:
        cos, sin = randn(Bc, T, D, dtype=cs_dtype), randn(Bc, T, D, dtype=cs_dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, wq, wk)) + (cos, sin)


def _angles(Bc, T, D, dtype=torch.float32):
    """Real RoPE tables (cos^2 + sin^2 = 1, equal halves), positions 3.. of a base-10000 rotary."""
    inv_freq = 10000.0 ** -(torch.arange(0, D, 2, dtype=torch.float32) / D)
    pos = torch.arange(3, 3 + T, dtype=torch.float32)[None, :] + 5 * torch.arange(Bc, dtype=torch.float32)[:, None]
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _hf(q, k, wq, wk, cos, sin, eps, *, offset, casting_mode):
    """Qwen3's attention input in the activation dtype: q_norm / k_norm, then apply_rotary_pos_emb with cos and
    sin cast to the dtype (as HF's rotary embedding returns them)."""
    qn = reference.eager_rms_norm(q, wq, eps, offset=offset, casting_mode=casting_mode)
    kn = reference.eager_rms_norm(k, wk, eps, offset=offset, casting_mode=casting_mode)
    return reference.eager_apply_rope(qn, kn, cos.to(qn.dtype), sin.to(qn.dtype), unsqueeze_dim=2)


def _assert_model(name, got, torch_in_dtype, ref, dtype, *, k=1, terms=None, ulps=4):
    """err(kernel) <= 2 * err(torch in dtype) + atol, atol the error model: `ulps` roundings of `dtype` at the
    result's scale (the casts to the dtype, the interpreter's truncating ones included) plus an fp32 sum of k
    terms, `terms` the largest sum of their magnitudes (default: the result's scale), sum_ulps(k) u32 off (the
    sums of squares and of dn * n over head_dim, dw's sum over the rows)."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    terms = scale if terms is None else terms
    atol = ulps * UNIT_ROUNDOFF[dtype] * scale + U32 * sum_ulps(k) * terms + 1e-30
    e_k, e_t = err(got, ref), err(torch_in_dtype, ref)
    assert e_k <= 2 * e_t + atol, f"{name}: kernel err {e_k:.3e} > 2 * torch err {e_t:.3e} + {atol:.3e}"


def _dw_terms(x, go, cos, sin, eps):
    """max over j of sum over the rows of |dy_j n_j| in fp64 (dy: go rotated back, n: x normalized): the
    magnitude of the terms of the weight gradient's sum."""
    x = x.detach().double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = torch.zeros_like(n, requires_grad=True)
    out, _ = reference.apply_rope(y, y[:, :, :0], cos.double(), sin.double(), unsqueeze_dim=2)
    (dy,) = torch.autograd.grad(out, y, go.double())
    return (dy * n).abs().sum((0, 1, 2)).max().item()


def _grads(outs, inputs, gos):
    """`grads` over the outputs that need a gradient (k_embed does not when neither k nor k_weight needs one)."""
    pairs = [(o, g) for o, g in zip(outs, gos, strict=True) if o.requires_grad]
    return grads([o for o, _ in pairs], inputs, [g for _, g in pairs])


def _check(q, k, wq, wk, cos, sin, *, mode="llama", offset=0.0, eps=1e-6, config=None):
    """Forward and every gradient that is wanted: kernel vs fp64 reference vs the HF formula in dtype. Returns
    (outputs, gradients)."""
    kw = dict(offset=offset, casting_mode=mode)
    inputs = (q, k, wq, wk)
    outs = ops.qk_norm_rope(q, k, wq, wk, cos, sin, eps, config=config, **kw)
    with torch.no_grad():
        in_dtype = reference.qk_norm_rope(q, k, wq, wk, cos, sin, eps, **kw)
    ref_in = fp64_copy(*inputs)
    refs = reference.qk_norm_rope(*ref_in, cos.double(), sin.double(), eps, **kw)
    eager_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eags = _hf(*eager_in, cos, sin, eps, **kw)
    D = q.shape[-1]
    for name, o, x, e, r, want in zip(("q_embed", "k_embed"), outs, (q, k), eags, refs, in_dtype, strict=True):
        assert o.shape == x.shape and o.is_contiguous(), f"{name}: {tuple(o.shape)} {o.stride()}"
        assert o.dtype == want.dtype, f"{name}: dtype {o.dtype} != the reference's {want.dtype}"
        _assert_model(f"qk_norm_rope {name}", o, e, r, x.dtype, k=D)
    gos = [torch.randn(o.shape, dtype=torch.float32).to(o.dtype) for o in outs]
    g_k = _grads(outs, inputs, gos)
    g_r = _grads(refs, ref_in, [g.double() for g in gos])
    g_e = _grads(eags, eager_in, [g.to(e.dtype) for g, e in zip(gos, eags)])
    dw_terms = [_dw_terms(x, g, cos, sin, eps) for x, g in zip((q, k), gos)] * 2
    for i, (name, a, e, r, x) in enumerate(zip(NAMES, g_k, g_e, g_r, inputs, strict=True)):
        if r is None:
            assert a is None, f"{name}: a gradient nobody asked for"
            continue
        assert a.dtype == x.dtype and a.shape == x.shape, f"{name}: {a.dtype} {tuple(a.shape)}"
        if i < 2:  # a row's sums over head_dim
            _assert_model(f"qk_norm_rope {name}", a, e, r, q.dtype, k=D)
        else:  # dw: a sum over the B * T * H rows of its tensor
            src = inputs[i - 2]
            _assert_model(f"qk_norm_rope {name}", a, e, r, q.dtype, k=src.shape[:3].numel(), terms=dw_terms[i])
    return outs, g_k


# 1. every dtype and casting mode: GQA heads, cos / sin per batch, fp32 tables beside bf16 / fp16 inputs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
def test_qk_norm_rope(device, dtype, mode, offset):
    torch.manual_seed(7)
    args = _inputs(2, 3, 4, 2, 64, dtype, Bc=2, cs_dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    _check(*args, mode=mode, offset=offset)


# 2. odd sizes: odd B * T, Hq = 3 / Hk = 1, head_dim 2, 6 (not a power of two: masked halves), 8, 64, 128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,Hq,Hk,D,Bc", [
    (1, 3, 3, 1, 8, 1),
    (3, 1, 3, 1, 6, 3),
    (1, 5, 3, 1, 6, 1),
    (1, 1, 1, 1, 2, 1),
    (2, 1, 5, 1, 64, 2),
    (1, 2, 2, 1, 128, 1),
    (1, 3, 1, 3, 8, 1),  # more k heads than q heads: the backward's grid is sized from q's tiles
])
def test_shapes(device, dtype, B, T, Hq, Hk, D, Bc):
    torch.manual_seed(B * 100 + T * 10 + D)
    _check(*_inputs(B, T, Hq, Hk, D, dtype, Bc=Bc), mode="gemma" if D == 6 else "llama",
           offset=1.0 if D == 6 else 0.0)


@pytest.mark.parametrize("mode,offset", MODES)
def test_fp32_weights_with_bf16_inputs(device, mode, offset):
    # llama casting promotes the output to fp32 (LlamaRMSNorm: fp32 weight * bf16 normalized x); gemma and none
    # keep bf16. dw comes back in the weights' fp32, dq / dk in bf16.
    torch.manual_seed(3)
    args = _inputs(2, 3, 3, 1, 16, torch.bfloat16, w_dtype=torch.float32)
    (qo, ko), g = _check(*args, mode=mode, offset=offset)
    want = torch.float32 if mode == "llama" else torch.bfloat16
    assert qo.dtype == ko.dtype == want
    assert [t.dtype for t in g] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]


def test_q_and_k_in_different_dtypes(device):
    # each tensor rounds to its own dtype: fp16 q beside bf16 k (and their weights)
    torch.manual_seed(4)
    q, k, wq, wk, cos, sin = _inputs(1, 3, 2, 1, 8, torch.float16, k_dtype=torch.bfloat16)
    wk = wk.detach().to(torch.bfloat16).requires_grad_()
    qo, ko = ops.qk_norm_rope(q, k, wq, wk, cos, sin)
    assert qo.dtype == torch.float16 and ko.dtype == torch.bfloat16
    for x, w, o in ((q, wq, qo), (k, wk, ko)):  # each against its own op on its own
        ref = reference.qk_norm_rope(*fp64_copy(x, x, w, w), cos.double(), sin.double())[0]
        hf = _hf(x.detach(), x.detach(), w.detach(), w.detach(), cos, sin, 1e-6, offset=0.0, casting_mode="llama")[0]
        _assert_model(f"{x.dtype} output", o, hf, ref, x.dtype, k=8)
    dq, dk, dwq, dwk = grads((qo, ko), (q, k, wq, wk), (torch.ones_like(qo), torch.ones_like(ko)))
    assert (dq.dtype, dk.dtype, dwq.dtype, dwk.dtype) == (torch.float16, torch.bfloat16, torch.float16,
                                                          torch.bfloat16)


# 3. views: the layouts attention modules hand over; outputs are dense [B, T, H, D]


@pytest.mark.parametrize("layout", ["fused_qkv", "bhtd", "strided_head_dim", "expanded_batch"])
def test_layouts(device, layout):
    torch.manual_seed(5)
    q, k, wq, wk, cos, sin = _inputs(2, 3, 3, 1, 8, torch.bfloat16, layout=layout, Bc=2,
                                     strided_cs=layout == "fused_qkv")
    q0, k0 = q.detach().clone(), k.detach().clone()
    _check(q, k, wq, wk, cos, sin)
    assert torch.equal(q, q0) and torch.equal(k, k0), "q and k must not be modified"


def test_views_give_the_dense_inputs_bits(device):
    # The kernel reads any strides: a fused-qkv slice and a transposed view give the contiguous copy's bits,
    # forward and backward.
    torch.manual_seed(6)
    B, T, Hq, Hk, D = 2, 3, 3, 1, 16
    qkv = randn(B, T, (Hq + 2 * Hk) * D)
    cos, sin = _angles(1, T, D)
    wq, wk = randn(D), randn(D)
    views = (qkv[..., :Hq * D].view(B, T, Hq, D), qkv[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D))
    bhtd = tuple(v.transpose(1, 2).contiguous().transpose(1, 2) for v in views)
    go = (randn(B, T, Hq, D), randn(B, T, Hk, D))
    results = []
    for q, k in (views, bhtd, tuple(v.contiguous() for v in views)):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        w = (wq.clone().requires_grad_(), wk.clone().requires_grad_())
        outs = ops.qk_norm_rope(q, k, *w, cos, sin)
        assert all(o.is_contiguous() for o in outs)
        results.append((*outs, *grads(outs, (q, k, *w), go)))
    for got in results[:2]:
        for a, b in zip(got, results[2], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("grad_layout", ["transposed", "expanded", "strided_head_dim"])
def test_non_contiguous_output_gradient(device, grad_layout):
    # The output gradient as autograd hands it over: through a transposed view of the output (HF's
    # .transpose(1, 2) after RoPE), expanded (a sum against a [D] vector), or not unit-stride on D. The kernel
    # reads its strides: the contiguous gradient's bits.
    torch.manual_seed(8)
    q, k, wq, wk, cos, sin = _inputs(1, 3, 2, 1, 8, torch.float32)
    B, T, Hq, D = q.shape
    g_q, g_k = randn(B, Hq, T, D), randn(B, 1, T, D)
    if grad_layout == "expanded":
        g_q, g_k = randn(D).expand(B, Hq, T, D), randn(D).expand(B, 1, T, D)
    elif grad_layout == "strided_head_dim":
        g_q, g_k = randn(B, Hq, T, 2 * D)[..., ::2], randn(B, 1, T, 2 * D)[..., ::2]
    qo, ko = ops.qk_norm_rope(q, k, wq, wk, cos, sin)
    got = torch.autograd.grad((qo.transpose(1, 2), ko.transpose(1, 2)), (q, k, wq, wk), (g_q, g_k))
    qo, ko = ops.qk_norm_rope(q, k, wq, wk, cos, sin)
    want = torch.autograd.grad((qo, ko), (q, k, wq, wk),
                               (g_q.transpose(1, 2).contiguous(), g_k.transpose(1, 2).contiguous()))
    for name, a, b in zip(NAMES, got, want, strict=True):
        if device.type == "cuda":  # a stride of 0 or 1 compiles another specialization: FMAs may contract apart
            torch.testing.assert_close(a, b, rtol=8 * U32, atol=8 * U32 * b.abs().max().item(), msg=name)
        else:
            assert torch.equal(a, b), name


# 4. tiles: several forward tiles and backward programs, tile edges off the heads and tokens


class _GridSpy(KernelSpy):
    """KernelSpy that also records each launch's grid."""

    def __init__(self, kernel):
        super().__init__(kernel)
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return super().__getitem__(grid)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,tile_elems,blocks", [(8, 32, (1, 4, 4, 1)), (8, 64, (2, 4, 8, 1)), (6, 16, (1, 2, 2, 1)),
                                                 (64, 64, (1, 1, 1, 1))])
def test_small_tiles(device, monkeypatch, dtype, D, tile_elems, blocks):
    # q: 7 tokens x 3 heads, k: 7 x 1. A tile is (tokens, heads) of one tensor: blocks = (tokens, heads) of q's
    # tiles, then k's. (8, 32): q a token a tile (3 heads in a block of 4), k 4 tokens (the last tile 3);
    # (8, 64): q 2 tokens (the last tile one), k all 7 in one tile of 8; (6, 16): halves of 3 padded to 4, q's
    # heads in blocks of 2 (the second block one head), 14 tiles; (64, 64): one head a tile, 21 and 7. Forward
    # and backward run a program a tile; the backward's partial dw rows, one a tile, are summed after.
    fwd, bwd = _GridSpy(mod._qk_norm_rope_fwd_kernel), _GridSpy(mod._qk_norm_rope_bwd_kernel)
    monkeypatch.setattr(mod, "_qk_norm_rope_fwd_kernel", fwd)
    monkeypatch.setattr(mod, "_qk_norm_rope_bwd_kernel", bwd)
    torch.manual_seed(D)
    cfg = QKNormRopeConfig(tile_elems=tile_elems)
    _check(*_inputs(1, 7, 3, 1, D, dtype), config=cfg)
    names = ("BLOCK_TQ", "BLOCK_HQ", "BLOCK_TK", "BLOCK_HK")
    assert [tuple(c[n] for n in names) for c in fwd.calls + bwd.calls] == [blocks, blocks]
    tq, hq, tk, hk = blocks
    q_tiles, k_tiles = -(-7 // tq) * -(-3 // hq), -(-7 // tk) * -(-1 // hk)
    assert fwd.grids == bwd.grids == [(q_tiles + k_tiles,)]


def test_config_reaches_both_launches(device, monkeypatch):
    # The warps, programs per SM and tile of a QKNormRopeConfig reach the forward and backward launches on the
    # eager (autograd.Function) and the custom-op path. The interpreter ignores warps, and a tile groups rows
    # without changing their math: the outputs and dq / dk are the default's bits; dw sums other partial rows
    # (the default's 2 tiles, the config's 9), so it is the default's within the fp32 error of a sum of 21 rows.
    fwd, bwd = KernelSpy(mod._qk_norm_rope_fwd_kernel), KernelSpy(mod._qk_norm_rope_bwd_kernel)
    monkeypatch.setattr(mod, "_qk_norm_rope_fwd_kernel", fwd)
    monkeypatch.setattr(mod, "_qk_norm_rope_bwd_kernel", bwd)
    cfg = QKNormRopeConfig(tile_elems=32, fwd_warps=2, bwd_warps=16)
    torch.manual_seed(9)
    q, k, wq, wk, cos, sin = _inputs(1, 7, 3, 1, 8, torch.float32)
    go = (torch.randn(q.shape), torch.randn(k.shape))
    for path in ("function", "custom_op"):
        fwd.calls.clear(), bwd.calls.clear()
        results = []
        for c in (None, cfg):
            xs = [t.detach().clone().requires_grad_() for t in (q, k, wq, wk)]
            if path == "function":
                outs = ops.qk_norm_rope(*xs, cos, sin, config=c)
            else:
                outs = torch.ops.tigon.qk_norm_rope_fwd(*xs, cos, sin, 1e-6, 0.0, 0, None if c is None else c.ints())
            results.append((*outs, *grads(outs, xs, go)))
        # the default from the shape: 32 heads of 8 a tile (256 elements), 1 forward warp (one per 1024 elements,
        # at least 1), 2 backward warps
        assert [c["num_warps"] for c in fwd.calls] == [1, 2] and [c["num_warps"] for c in bwd.calls] == [2, 16]
        # the 3 q heads (a block of 4) of 8 tokens a tile by default, of 1 token with the config's 32 elements; the
        # k head of 32 and 4 tokens
        blocks = [(c["BLOCK_TQ"], c["BLOCK_HQ"], c["BLOCK_TK"], c["BLOCK_HK"]) for c in fwd.calls + bwd.calls]
        assert blocks == [(8, 4, 32, 1), (1, 4, 4, 1)] * 2
        for name, a, b in zip(("q_embed", "k_embed") + NAMES, *results, strict=True):
            if name.startswith("dq_") or name.startswith("dk_"):
                assert (a - b).abs().max() <= 2 * U32 * sum_ulps(21) * 21 * b.abs().max(), name
            else:
                assert torch.equal(a, b), name
    torch.library.opcheck(torch.ops.tigon.qk_norm_rope_fwd, (q, k, wq, wk, cos, sin, 1e-6, 0.0, 0, cfg.ints()))


# 5. the separate ops, one after the other


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,offset", MODES)
def test_equals_rms_norm_then_apply_rope(device, dtype, mode, offset):
    # Both round the norm's output to its dtype and rotate it in fp32, with one rounding on store: the same bits
    # but where the row's sum of squares, summed in another order (two halves here, the whole row there), moves
    # rstd by fp32 ulps. In fp16 / bf16 that can flip a rounding of the normalized value: one ulp of the output
    # dtype at the rotation terms' magnitude |y1 c1| + |y2 s1| (|c|, |s| <= 1). In fp32 no rounding absorbs it:
    # the two sums of D squares are each within sum_ulps(D) u32 of the exact one (measured: 541 of 2560 fp32
    # elements differ, by at most 2.6 u32 times the terms' magnitude; fp16 and bf16 are the same bits).
    torch.manual_seed(10)
    q, k, wq, wk, _, _ = _inputs(2, 5, 4, 2, 64, dtype, grad=False)
    cos, sin = _angles(2, 5, 64, torch.float32 if dtype == torch.bfloat16 else dtype)
    kw = dict(offset=offset, casting_mode=mode)
    fused = ops.qk_norm_rope(q, k, wq, wk, cos, sin, 1e-6, **kw)
    yq, yk = ops.rms_norm(q, wq, 1e-6, **kw), ops.rms_norm(k, wk, 1e-6, **kw)
    separate = ops.apply_rope(yq, yk, cos, sin, unsqueeze_dim=2)
    for name, a, b, y in zip(("q_embed", "k_embed"), fused, separate, (yq, yk), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        y = y.double()
        c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2)
        mag = y.abs() * c.abs() + reference.rotate_half(y).abs() * s.abs()
        tol = (2 * UNIT_ROUNDOFF[a.dtype] + U32 * sum_ulps(64)) * mag
        diff = (a.double() - b.double()).abs()
        assert (diff <= tol).all(), f"{name}: {diff.max().item():.3e} over the bound, {int((diff > 0).sum())} differ"
        if dtype != torch.float32:  # the rstd moves are far below an ulp of the 16-bit dtypes' roundings
            assert (diff <= 2 * UNIT_ROUNDOFF[a.dtype] * mag).all(), name


# 6. frozen weights, only q


def test_frozen_weights_and_only_q(device, monkeypatch):
    # No weight needs a gradient: the backward skips dw (COMPUTE_DW off) and dq / dk are the bits of the run that
    # computes it. Only q needing one: dq alone, the same bits again.
    bwd = KernelSpy(mod._qk_norm_rope_bwd_kernel)
    monkeypatch.setattr(mod, "_qk_norm_rope_bwd_kernel", bwd)
    torch.manual_seed(11)
    q, k, wq, wk, cos, sin = _inputs(1, 5, 3, 1, 8, torch.bfloat16, grad=False)
    go = (randn(*q.shape, dtype=torch.bfloat16), randn(*k.shape, dtype=torch.bfloat16))

    def run(needs):
        xs = [t.clone().requires_grad_(n) for t, n in zip((q, k, wq, wk), needs)]
        return _grads(ops.qk_norm_rope(*xs, cos, sin), xs, go)

    full = run((True, True, True, True))
    frozen = run((True, True, False, False))
    only_q = run((True, False, False, False))
    only_wq = run((False, False, True, False))
    assert [c["COMPUTE_DW"] for c in bwd.calls] == [True, False, False, True]
    assert frozen[2:] == [None, None] and only_q[1:] == [None, None, None]
    assert torch.equal(frozen[0], full[0]) and torch.equal(frozen[1], full[1]) and torch.equal(only_q[0], full[0])
    assert only_wq[0] is None and only_wq[1] is None and only_wq[3] is None and torch.equal(only_wq[2], full[2])
    # and against the reference, frozen weights
    _check(*(t.clone().requires_grad_(n) for t, n in zip((q, k, wq, wk), (True, True, False, False))), cos, sin)
    _check(*(t.clone().requires_grad_(n) for t, n in zip((q, k, wq, wk), (True, False, False, False))), cos, sin)


def test_one_output_unused(device):
    # Only k_embed reaches the loss: q's gradient is zero (autograd hands the backward a zero output gradient).
    torch.manual_seed(12)
    q, k, wq, wk, cos, sin = _inputs(1, 3, 2, 1, 8, torch.float32)
    for fwd in (lambda *a: ops.qk_norm_rope(*a), lambda *a: torch.ops.tigon.qk_norm_rope_fwd(*a, 1e-6, 0.0, 0)):
        _, ko = fwd(q, k, wq, wk, cos, sin)
        dq, dk, dwq, dwk = torch.autograd.grad(ko.sum(), (q, k, wq, wk))
        assert torch.equal(dq, torch.zeros_like(q)) and torch.equal(dwq, torch.zeros_like(wq))
        assert torch.isfinite(dk).all() and dk.abs().sum() > 0 and dwk.abs().sum() > 0


# 7. determinism


def test_backward_is_deterministic(device):
    torch.manual_seed(13)
    q, k, wq, wk, cos, sin = _inputs(2, 5, 3, 1, 8, torch.bfloat16)
    go = (randn(*q.shape, dtype=torch.bfloat16), randn(*k.shape, dtype=torch.bfloat16))
    cfg = QKNormRopeConfig(tile_elems=32)  # 8 q tiles over 4 programs: several partial rows of dw
    first, second = (grads(ops.qk_norm_rope(q, k, wq, wk, cos, sin, config=cfg), (q, k, wq, wk), go)
                     for _ in range(2))
    for name, a, b in zip(NAMES, first, second, strict=True):
        assert torch.equal(a, b), name


# 8. every element written, finite for a zero head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_head_is_finite_and_nothing_is_left_unwritten(device, dtype):
    # The outputs and gradients are allocated with torch.empty, NaN-poisoned by tests/conftest.py: an element a
    # program does not store stays NaN. A head of zeros normalizes to zeros (rstd = 1 / sqrt(eps)), its
    # gradient is rstd * dn: finite, as the reference's.
    torch.manual_seed(14)
    q, k, wq, wk, cos, sin = _inputs(1, 5, 3, 1, 8, dtype, grad=False)
    q[0, 2, 1] = 0
    k[0, 4, 0] = 0
    args = [t.requires_grad_() for t in (q, k, wq, wk)] + [cos, sin]
    outs, g = _check(*args, eps=1e-5, config=QKNormRopeConfig(tile_elems=32))
    assert torch.equal(outs[0][0, 2, 1], torch.zeros_like(outs[0][0, 2, 1]))
    assert torch.equal(outs[1][0, 4, 0], torch.zeros_like(outs[1][0, 4, 0]))
    assert all(torch.isfinite(t).all() for t in (*outs, *g))


def test_empty(device):
    # no token, no batch, no k head: empty outputs, and zero weight gradients (no partial row left NaN)
    for B, T, Hk in ((0, 3, 1), (2, 0, 1), (1, 3, 0)):
        q, k, wq, wk, cos, sin = _inputs(B, T, 2, Hk, 8, torch.float32, Bc=1)
        qo, ko = ops.qk_norm_rope(q, k, wq, wk, cos, sin)
        assert qo.shape == q.shape and ko.shape == k.shape
        dq, dk, dwq, dwk = grads((qo, ko), (q, k, wq, wk), (torch.ones_like(qo), torch.ones_like(ko)))
        assert dq.shape == q.shape and dk.shape == k.shape
        assert torch.equal(dwk, torch.zeros_like(wk))
        if B * T == 0:
            assert torch.equal(dwq, torch.zeros_like(wq))
        else:  # no k head: q's gradients as without k
            ins = fp64_copy(q, k, wq, wk)
            ref = reference.qk_norm_rope(*ins, cos.double(), sin.double())
            want = torch.autograd.grad(ref[0].sum(), (ins[0], ins[2]))
            torch.testing.assert_close(dq.double(), want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dwq.double(), want[1], rtol=1e-5, atol=1e-5)


# 9. refused input: the same error on the kernel path and on the reference path


@pytest.fixture(params=["kernel", "reference"])
def path(request, device, monkeypatch):
    """(device, expected dispatch path): the Triton kernels (CUDA, or the interpreter on CPU), or the PyTorch
    reference (CPU with the interpreter routed off, as a machine without TRITON_INTERPRET runs it)."""
    if request.param == "reference":
        monkeypatch.setattr(_library, "interpreter_on", lambda: False)
        return torch.device("cpu"), "reference"
    return device, "triton"


def _args(d, B=2, T=3, Hq=4, Hk=2, D=8, *, k_shape=None, wq=None, wk=None, rd=None, Bc=1, sin_rd=None,
          dtype=torch.float32):
    q = torch.randn(B, T, Hq, D, device=d).to(dtype)
    k = torch.randn(*(k_shape or (B, T, Hk, D)), device=d)
    wq = torch.ones(D, device=d) if wq is None else wq
    wk = torch.ones(D, device=d) if wk is None else wk
    cos = torch.ones(Bc, T, rd or D, device=d)
    sin = torch.ones(Bc, T, sin_rd or rd or D, device=d)
    return [q, k, wq, wk, cos, sin]


def _with(args, i, value):
    args = list(args)
    args[i] = value
    return args


# (name, exception, argument pattern, call(device) -> thunk)
REFUSED = [
    ("q_3d", ValueError, "q must be 4-D", lambda d: _with(_args(d), 0, torch.ones(2, 3, 8, device=d))),
    ("k_5d", ValueError, "k must be 4-D", lambda d: _with(_args(d), 1, torch.ones(2, 3, 2, 8, 1, device=d))),
    ("k_batch", ValueError, r"k \(1, 3, 2, 8\) must match q", lambda d: _args(d, k_shape=(1, 3, 2, 8))),
    ("k_tokens", ValueError, r"k \(2, 4, 2, 8\) must match q", lambda d: _args(d, k_shape=(2, 4, 2, 8))),
    ("k_head_dim", ValueError, r"k \(2, 3, 2, 6\) must match q .*head_dim", lambda d: _args(d, k_shape=(2, 3, 2, 6))),
    ("head_dim_odd", ValueError, "head_dim must be even", lambda d: _args(d, D=7)),
    ("head_dim_huge", ValueError, "head_dim 70000 is over", lambda d: _args(d, B=1, T=1, Hq=1, Hk=1, D=70000)),
    ("q_weight_size", ValueError, r"q_weight must have shape \(8,\)", lambda d: _args(d, wq=torch.ones(6, device=d))),
    ("k_weight_2d", ValueError, r"k_weight must have shape \(8,\)",
     lambda d: _args(d, wk=torch.ones(1, 8, device=d))),
    ("q_weight_none", TypeError, "q_weight must be a torch.Tensor", lambda d: _with(_args(d), 2, None)),
    ("partial_rotary", ValueError, "rotary_dim == head_dim 8.*got rotary_dim 4", lambda d: _args(d, rd=4)),
    ("rotary_odd", ValueError, "cos rotary_dim 7", lambda d: _args(d, rd=7)),
    ("cos_batch", ValueError, r"cos must have shape \[1 or 2, 3, rotary_dim\]", lambda d: _args(d, Bc=3)),
    ("cos_2d", ValueError, "cos must have shape", lambda d: _with(_args(d), 4, torch.ones(3, 8, device=d))),
    ("sin_shape", ValueError, r"sin must have shape \(1, 3, 8\)", lambda d: _args(d, sin_rd=6)),
    ("q_int", TypeError, "q must be float32, float16 or bfloat16", lambda d: _args(d, dtype=torch.int32)),
    ("q_fp64", TypeError, "q must be float32, float16 or bfloat16", lambda d: _args(d, dtype=torch.float64)),
    ("k_weight_int", TypeError, "k_weight must be float",
     lambda d: _args(d, wk=torch.ones(8, dtype=torch.long, device=d))),
    ("cos_int", TypeError, "cos must be float",
     lambda d: _with(_args(d), 4, torch.ones(1, 3, 8, dtype=torch.int32, device=d))),
    ("q_list", TypeError, "q must be a torch.Tensor", lambda d: _with(_args(d), 0, [1.0] * 8)),
    ("k_weight_device", ValueError, "k_weight is on meta but q is on",
     lambda d: _args(d, wk=torch.ones(8, device="meta"))),
    ("sin_device", ValueError, "sin is on meta", lambda d: _with(_args(d), 5, torch.ones(1, 3, 8, device="meta"))),
]
# keyword arguments refused (argument pattern, kwargs)
REFUSED_KW = [
    ("eps_zero", ValueError, "eps", dict(eps=0.0)),
    ("eps_tensor", ValueError, "eps", dict(eps=torch.tensor(1e-6))),
    ("offset_str", TypeError, "offset", dict(offset="1")),
    ("offset_nan", ValueError, "offset", dict(offset=float("nan"))),
    ("casting_mode", ValueError, "casting_mode must be one of", dict(casting_mode="qwen3")),
    ("config_type", TypeError, "config must be a tigon.ops.QKNormRopeConfig or None, got RopeConfig",
     dict(config=RopeConfig())),
    ("config_ints", TypeError, "config must be .*got list", dict(config=[4096, 4, 4])),
]


def _raises(exc, arg, call):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"{OP}: "), msg
    assert re.search(arg, msg), msg


@pytest.mark.parametrize("name,exc,arg,make", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_input(path, name, exc, arg, make):
    args = make(path[0])
    _raises(exc, arg, lambda: ops.qk_norm_rope(*args))


@pytest.mark.parametrize("name,exc,arg,kw", REFUSED_KW, ids=[c[0] for c in REFUSED_KW])
def test_bad_keyword(path, name, exc, arg, kw):
    args = _args(path[0])
    _raises(exc, arg, lambda: ops.qk_norm_rope(*args, **kw))


def test_config_refuses_bad_fields():
    with pytest.raises(ValueError, match="QKNormRopeConfig: tile_elems must be a power of two"):
        QKNormRopeConfig(tile_elems=48)
    with pytest.raises(ValueError, match="QKNormRopeConfig: bwd_warps must be an int >= 0"):
        QKNormRopeConfig(bwd_warps=-1)


def test_reference_path_gives_the_kernels_results(path):
    # accepted input: the path runs (its dispatch count moves) and gives the kernel path's values
    device, expected = path
    torch.manual_seed(15)
    q, k, wq, wk, cos, sin = _inputs(1, 3, 3, 1, 8, torch.float32, layout="fused_qkv", device=device)
    before = ops.dispatch_counts[("qk_norm_rope", expected)]
    outs = ops.qk_norm_rope(q, k, wq, wk, cos, sin, offset=1.0, casting_mode="gemma")
    assert ops.dispatch_counts[("qk_norm_rope", expected)] == before + 1
    g = grads(outs, (q, k, wq, wk), (torch.ones_like(outs[0]), torch.ones_like(outs[1])))
    ref = reference.qk_norm_rope(*fp64_copy(q, k, wq, wk), cos.double(), sin.double(), offset=1.0,
                                 casting_mode="gemma")
    for a, b in zip(outs, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    assert all(t is not None and torch.isfinite(t).all() for t in g)


# 10. cos / sin that need a gradient: the reference runs


def test_cos_sin_requiring_grad_run_the_reference(device):
    torch.manual_seed(16)
    q, k, wq, wk, cos, sin = _inputs(1, 3, 2, 1, 8, torch.float32)
    r_q, r_k = torch.randn(q.shape), torch.randn(k.shape)
    cos.requires_grad_(True)
    sin.requires_grad_(True)
    before_r = ops.dispatch_counts[("qk_norm_rope", "reference")]
    before_t = ops.dispatch_counts[("qk_norm_rope", "triton")]
    qo, ko = ops.qk_norm_rope(q, k, wq, wk, cos, sin)
    assert ops.dispatch_counts[("qk_norm_rope", "reference")] == before_r + 1
    assert ops.dispatch_counts[("qk_norm_rope", "triton")] == before_t
    got = torch.autograd.grad((qo * r_q).sum() + (ko * r_k).sum(), (q, k, wq, wk, cos, sin))
    ins = fp64_copy(q, k, wq, wk, cos, sin)
    r = reference.qk_norm_rope(*ins)
    want = torch.autograd.grad((r[0] * r_q.double()).sum() + (r[1] * r_k.double()).sum(), ins)
    for name, a, b in zip(NAMES + ("dcos", "dsin"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():  # no graph to build: the kernel runs
        ops.qk_norm_rope(q, k, wq, wk, cos, sin)
    assert ops.dispatch_counts[("qk_norm_rope", "triton")] == before_t + 1
    assert ops.dispatch_counts[("qk_norm_rope", "reference")] == before_r + 1


def test_runs_the_kernel_on_this_device(device):
    args = _inputs(1, 2, 2, 1, 4, torch.float32, grad=False)
    before = ops.dispatch_counts[("qk_norm_rope", "triton")]
    ops.qk_norm_rope(*args)
    assert ops.dispatch_counts[("qk_norm_rope", "triton")] == before + 1


def test_inference_and_training_paths_give_the_same_bits(device):
    # no_grad: the plain launcher; grad: the autograd.Function; the custom op directly: its registered
    # autograd. The same launchers, the same bits, forward and backward.
    torch.manual_seed(17)
    q, k, wq, wk, cos, sin = _inputs(2, 3, 3, 1, 8, torch.bfloat16, layout="fused_qkv", grad=False)
    go = (randn(*q.shape, dtype=torch.bfloat16), randn(*k.shape, dtype=torch.bfloat16))
    with torch.no_grad():
        plain = ops.qk_norm_rope(q, k, wq, wk, cos, sin)
    xs = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
    function = ops.qk_norm_rope(*xs, cos, sin)
    g_function = grads(function, xs, go)
    xs = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
    custom = torch.ops.tigon.qk_norm_rope_fwd(xs[0].contiguous(), xs[1].contiguous(), *xs[2:], cos, sin, 1e-6, 0.0,
                                              0)
    g_custom = grads(custom, xs, go)
    for a, b, c in zip(plain, function, custom):
        assert torch.equal(a, b) and torch.equal(a, c.detach())
    for name, a, b in zip(NAMES, g_function, g_custom, strict=True):
        assert torch.equal(a, b), name


# 11. double backward: the reference's second derivative


def test_double_backward(path):
    # A gradient penalty |d loss / d(q, k, wq, wk)|^2 through the op (loss = <y, r> + |y|^2 / 2), differentiated
    # again: the kernel path's backward under create_graph=True builds its gradients from the reference's ops,
    # so its second derivatives are the fp64 reference's to fp32 accuracy.
    torch.manual_seed(18)
    args = _inputs(1, 3, 2, 1, 8, torch.float32, grad=False)
    cos, sin = args[4:]

    def penalty(fn, ins):
        leaves = [t.detach().clone().requires_grad_() for t in ins]
        outs = fn(*leaves)
        g = torch.Generator(device=DEV).manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=g).to(o) + o.square() / 2).sum() for o in outs)
        first = torch.autograd.grad(loss, leaves, create_graph=True)
        second = torch.autograd.grad(sum(f.pow(2).sum() for f in first), leaves)
        return tuple(f.detach() for f in first) + second

    got = penalty(lambda *a: ops.qk_norm_rope(*a, cos, sin, offset=1.0, casting_mode="gemma"), args[:4])
    want = penalty(lambda *a: reference.qk_norm_rope(*a, cos.double(), sin.double(), offset=1.0,
                                                     casting_mode="gemma"), [t.double() for t in args[:4]])
    for name, a, b in zip([f"first {n}" for n in NAMES] + [f"second {n}" for n in NAMES], got, want, strict=True):
        scale = b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= 1e-5 * max(scale, 1.0), name


# 12. torch.library: opcheck and torch.compile


def test_opcheck(device):
    torch.manual_seed(19)
    q, k, wq, wk, cos, sin = _inputs(2, 3, 3, 1, 8, torch.float32, layout="fused_qkv", Bc=2)
    torch.library.opcheck(torch.ops.tigon.qk_norm_rope_fwd, (q, k, wq, wk, cos, sin, 1e-6, 0.0, 0))
    qb, kb, wqb, wkb, cb, sb = _inputs(1, 3, 3, 1, 8, torch.bfloat16, layout="bhtd", w_dtype=torch.float32,
                                       strided_cs=True)
    torch.library.opcheck(torch.ops.tigon.qk_norm_rope_fwd, (qb, kb, wqb, wkb, cb, sb, 1e-5, 1.0, 1, [32, 4, 8]))
    torch.library.opcheck(torch.ops.tigon.qk_norm_rope_fwd, (qb, kb, wqb, wkb, cb, sb, 1e-5, 0.0, 0))
    for x, w, c, s in (((q, k), (wq, wk), cos, sin), ((qb, kb), (wqb, wkb), cb, sb)):
        x = [t.detach() for t in x]
        w = [t.detach() for t in w]
        do = [torch.randn(t.shape).to(t.dtype) for t in x]
        for compute_dw in (True, False):
            torch.library.opcheck(torch.ops.tigon.qk_norm_rope_bwd,
                                  (*do, *x, *w, c, s, 1e-6, 0.0, 0, compute_dw))
        # an output gradient with its own strides
        do_t = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in do]
        torch.library.opcheck(torch.ops.tigon.qk_norm_rope_bwd,
                              (*do_t, *x, *w, c, s, 1e-6, 1.0, 2, True, [16, 4, 8]))


def test_compile_fullgraph_aot_eager(device):
    # One custom-op node, no graph break; the eager bits forward and backward (the same launchers), for trained
    # and for frozen weights (the backward without dw) with q as a transposed view.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(20)
    for layout, train_w in (("fused_qkv", True), ("bhtd", False)):
        q, k, wq, wk, cos, sin = _inputs(2, 3, 3, 1, 8, torch.float32, layout=layout)
        wq.requires_grad_(train_w), wk.requires_grad_(train_w)
        inputs = (q, k, wq, wk)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        fn = lambda q, k, wq, wk: ops.qk_norm_rope(q, k, wq, wk, cos, sin, offset=1.0, casting_mode="gemma")  # noqa
        outs = torch.compile(fn, fullgraph=True, backend=counter)(*inputs)
        assert counter.frame_count == 1 and "tigon.qk_norm_rope_fwd" in counter.graphs[0].code
        eager = fn(*inputs)
        go = [torch.randn_like(o) for o in outs]
        for a, b in zip((*outs, *grads(outs, inputs, go)), (*eager, *grads(eager, inputs, go)), strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
