"""decode_qkv_rope: the q/k/v projection with RoPE and the ring-cache write in the epilogue, against the two
ops it fuses (decode_linear, then rope_kv_append) and the fp64 reference."""

import pytest
import torch

from tests._grid import DTYPES, assert_bound
from tigon import ops
from tigon.ops.decode_linear import decode_qkv_rope, decode_qkv_rope_reference


def _inputs(dtype, M=3, K=40, hq=4, hkv=2, hd=32, C=7, B=4, cos_batch=1, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    x = r(M, K)
    ws = [r(hq * hd, K, scale=K ** -0.5), r(hkv * hd, K, scale=K ** -0.5), r(hkv * hd, K, scale=K ** -0.5)]
    nw = r(K, scale=0.1) + 1
    ang = torch.rand(cos_batch, 1, hd // 2, generator=g) * 6
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(device=device, dtype=dtype)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(device=device, dtype=dtype)
    kc = torch.full((B, hkv, C, hd), float("nan"), dtype=dtype, device=device)  # poisoned: unwritten slots stay NaN
    vc = torch.full((B, hkv, C, hd), float("nan"), dtype=dtype, device=device)
    pos = torch.full((C,), -1, dtype=torch.int64, device=device)
    return x, ws, nw, cos, sin, kc, vc, pos


def _unfused(x, ws, nw, cos, sin, kc, vc, pos, nxt, sink):
    M, hd = x.shape[0], kc.shape[-1]
    nq, nk = ws[0].shape[0], ws[1].shape[0]
    y = ops.decode_linear(x, ws, norm_weight=nw, eps=1e-5)
    q = y[:, :nq].view(M, 1, -1, hd).transpose(1, 2)
    k = y[:, nq:nq + nk].view(M, 1, -1, hd).transpose(1, 2)
    v = y[:, nq + nk:].view(M, 1, -1, hd).transpose(1, 2)
    q = ops.rope_kv_append(k, v, cos, sin, kc[:M], vc[:M], pos, nxt, sink=sink, query=q)
    return q.transpose(1, 2).reshape(M, nq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,hd,cos_batch,sink,next_pos", [(1, 32, 1, 0, 3), (3, 64, 3, 2, 12), (3, 32, 1, 0, 9)])
def test_matches_the_unfused_ops(device, dtype, M, hd, cos_batch, sink, next_pos):
    """Bit for bit the q of decode_linear + rope_kv_append, the same cache contents and slot positions; the
    rotated k and v in the output are the cache's new slot (wrapped past C = 7 slots: next 9, 12)."""
    args = _inputs(dtype, M=M, hd=hd, cos_batch=cos_batch, device=device)
    x, ws, nw, cos, sin, kc, vc, pos = args
    kc2, vc2, pos2 = kc.clone(), vc.clone(), pos.clone()
    nxt = torch.tensor([next_pos], device=device)
    with torch.no_grad():
        y = decode_qkv_rope(x, ws, norm_weight=nw, eps=1e-5, cos=cos, sin=sin, k_cache=kc, v_cache=vc,
                            positions=pos, next_position=nxt, sink=sink)
        q_ref = _unfused(x, ws, nw, cos, sin, kc2, vc2, pos2, nxt, sink)
    nq, nk = ws[0].shape[0], ws[1].shape[0]
    if device.type == "cuda" and dtype == torch.float32:
        # fp32 on a GPU: the two kernels' dot tiles and multiply-add contractions differ (a few ulps); the cache
        # is compared to this kernel's own output below, exactly
        torch.testing.assert_close(y[:, :nq], q_ref, rtol=1e-5, atol=1e-6)
        kc2, vc2 = kc2.nan_to_num(), vc2.nan_to_num()
        torch.testing.assert_close(kc.nan_to_num(), kc2, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(vc.nan_to_num(), vc2, rtol=1e-5, atol=1e-6)
        kc2, vc2 = kc, vc
    else:
        assert torch.equal(y[:, :nq], q_ref)
    assert torch.equal(kc.isnan(), kc2.isnan()) and torch.equal(kc.nan_to_num(), kc2.nan_to_num())
    assert torch.equal(vc.isnan(), vc2.isnan()) and torch.equal(vc.nan_to_num(), vc2.nan_to_num())
    assert torch.equal(pos, pos2) and int((pos >= 0).sum()) == 1
    slot = int((pos >= 0).nonzero())
    assert torch.equal(y[:, nq:nq + nk], kc[:M, :, slot].reshape(M, nk))
    assert torch.equal(y[:, nq + nk:], vc[:M, :, slot].reshape(M, nk))
    assert torch.isnan(kc[M:]).all() and nxt.item() == next_pos  # other sequences untouched, next not advanced


@pytest.mark.parametrize("dtype", DTYPES)
def test_within_the_contract_of_the_fp64_reference(device, dtype):
    x, ws, nw, cos, sin, kc, vc, pos = _inputs(dtype, M=2, hd=64, device=device, seed=1)
    nxt = torch.tensor([4], device=device)
    with torch.no_grad():
        y = decode_qkv_rope(x, ws, norm_weight=nw, eps=1e-5, cos=cos, sin=sin, k_cache=kc, v_cache=vc, positions=pos,
                            next_position=nxt)
        in_dtype = decode_qkv_rope_reference(x, ws, norm_weight=nw, eps=1e-5, cos=cos, sin=sin, k_cache=kc.clone(),
                                             v_cache=vc.clone(), positions=pos.clone(), next_position=nxt)
        d = lambda t: t.double()  # noqa: E731
        exact = decode_qkv_rope_reference(d(x), [d(w) for w in ws], norm_weight=d(nw), eps=1e-5, cos=d(cos),
                                          sin=d(sin), k_cache=d(kc), v_cache=d(vc), positions=pos.clone(),
                                          next_position=nxt)
    assert_bound(f"decode_qkv_rope {dtype}", y, in_dtype, exact, dtype, ulps=8)


def test_without_norm_and_odd_k(device):
    x, ws, _, cos, sin, kc, vc, pos = _inputs(torch.float32, M=2, K=77, device=device, seed=2)
    nxt = torch.tensor([0], device=device)
    with torch.no_grad():
        y = decode_qkv_rope(x, ws, cos=cos, sin=sin, k_cache=kc, v_cache=vc, positions=pos, next_position=nxt)
        ref = decode_qkv_rope_reference(x, ws, cos=cos, sin=sin, k_cache=kc.clone(), v_cache=vc.clone(),
                                        positions=pos.clone(), next_position=nxt)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_runs_the_kernel_on_this_device(device):
    x, ws, nw, cos, sin, kc, vc, pos = _inputs(torch.float32, M=1, device=device)
    before = ops.dispatch_counts[("decode_qkv_rope", "triton")]
    with torch.no_grad():
        decode_qkv_rope(x, ws, cos=cos, sin=sin, k_cache=kc, v_cache=vc, positions=pos,
                        next_position=torch.tensor([0], device=device))
    assert ops.dispatch_counts[("decode_qkv_rope", "triton")] == before + 1


def _call(**over):
    x, ws, nw, cos, sin, kc, vc, pos = _inputs(torch.float32, M=2)
    kw = dict(norm_weight=nw, cos=cos, sin=sin, k_cache=kc, v_cache=vc, positions=pos,
              next_position=torch.tensor([0]))
    a = dict(x=x, weights=ws, **kw)
    a.update({k: (v(a) if callable(v) else v) for k, v in over.items()})
    return decode_qkv_rope(a.pop("x"), a.pop("weights"), **a)


@pytest.mark.parametrize("over,exc,match", [
    (dict(weights=lambda a: a["weights"][:2]), TypeError, "weights must be the three tensors"),
    (dict(weights=lambda a: a["weights"][0]), TypeError, "weights must be the three tensors"),
    (dict(x=lambda a: a["x"][None]), ValueError, r"x must have shape \[M, K\]"),
    (dict(k_cache=lambda a: a["k_cache"][:1]), ValueError, "k_cache must be"),
    (dict(v_cache=lambda a: a["v_cache"][..., :16]), ValueError, "v_cache must have shape"),
    (dict(k_cache=lambda a: torch.ones(4, 2, 7, 16), v_cache=lambda a: torch.ones(4, 2, 7, 16)), ValueError,
     "head dim 16 must be a multiple of 32"),
    (dict(weights=lambda a: [a["weights"][0], a["weights"][1][:32], a["weights"][2]]), ValueError,
     "weights must have"),
    (dict(cos=lambda a: a["cos"][..., :16]), ValueError, "cos must be"),
    (dict(sin=lambda a: a["sin"].expand(2, 2, 32)), ValueError, "sin must be"),
    (dict(cos=lambda a: a["cos"].half()), TypeError, "cos has dtype"),
    (dict(positions=lambda a: a["positions"].int()), TypeError, "positions must be int64"),
    (dict(positions=lambda a: a["positions"][:5]), ValueError, "positions must be a contiguous int64"),
    (dict(next_position=torch.tensor([0, 1])), ValueError, "next_position must be one"),
    (dict(next_position=torch.tensor([0.0])), TypeError, "next_position must be int64"),
    (dict(sink=7), ValueError, "sink must be an int"),
    (dict(x=lambda a: a["x"].requires_grad_()), RuntimeError, "inference only"),
])
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(**over)


def test_opcheck_and_compile(device):
    x, ws, nw, cos, sin, kc, vc, pos = _inputs(torch.float32, M=2, device=device)
    nxt = torch.tensor([3], device=device)
    torch.library.opcheck(torch.ops.tigon.decode_qkv_rope, (x, ws, nw, 1e-5, cos, sin, kc, vc, pos, nxt, 0))
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    kc1, vc1, pos1 = kc.clone(), vc.clone(), pos.clone()
    fn = lambda x, kc, vc, pos: decode_qkv_rope(x * 1, ws, norm_weight=nw, eps=1e-5, cos=cos, sin=sin,  # noqa: E731
                                                k_cache=kc, v_cache=vc, positions=pos, next_position=nxt)
    with torch.no_grad():
        got = torch.compile(fn, fullgraph=True, backend=backend)(x, kc, vc, pos)
        want = fn(x, kc1, vc1, pos1)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc.nan_to_num(), kc1.nan_to_num()) and torch.equal(pos, pos1)
