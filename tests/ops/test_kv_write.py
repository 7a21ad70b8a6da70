import pytest
import torch

from tests._grid import DTYPES, assert_bound, assert_no_sync_and_deterministic, randn
from tigon import ops
from tigon.ops import reference
from tigon.ops.kv_write import rope_kv_write, rope_kv_write_reference


def _inputs(dtype, B=3, Hq=6, Hkv=3, T=2, D=16, rd=None, C=7, slots=(5, 1), device="cpu", cos_batch=1, seed=0):
    """HF layouts: key/value/query as transposed views of [B, T, H, D]; a NaN-poisoned ring."""
    torch.manual_seed(seed)
    rd = D if rd is None else rd
    key = randn(B, T, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
    value = randn(B, T, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
    query = randn(B, T, Hq, D, dtype=dtype, device=device).transpose(1, 2)
    ang = torch.rand(cos_batch, T, rd // 2, device=device) * 6.0
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    k_cache = torch.full((B, Hkv, C, D), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full((B, Hkv, C, D), float("nan"), dtype=dtype, device=device)
    return key, value, cos, sin, k_cache, v_cache, torch.tensor(slots, device=device), query


def _check(dtype, key, value, cos, sin, k_cache, v_cache, slots, query):
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    q_embed = rope_kv_write(key, value, cos, sin, k_cache, v_cache, slots, query=query)
    q_ref = rope_kv_write_reference(key, value, cos, sin, kc_ref, vc_ref, slots, query=query)
    # Slots not written keep their NaN poison; the written ones are finite.
    assert torch.equal(k_cache.isnan(), kc_ref.isnan()) and torch.equal(v_cache.isnan(), vc_ref.isnan())
    written = [s for s in slots.tolist() if 0 <= s < k_cache.shape[2]]
    assert len(written) == 0 or torch.isfinite(k_cache[:, :, written]).all()
    # The value is a copy; the rotation is within the op contract's bound (fp64 reference, torch in dtype).
    assert torch.equal(v_cache.nan_to_num(), vc_ref.nan_to_num())
    idx = [t for t, s in enumerate(slots.tolist()) if 0 <= s < k_cache.shape[2]]
    q_or_k = query if query is not None else key
    q64, k64 = reference.apply_rope(q_or_k.double(), key.double(), cos.double(), sin.double())
    _, k_dt = _torch_rope(q_or_k, key, cos, sin)
    assert_bound("k", k_cache[:, :, written], k_dt[:, :, idx], k64[:, :, idx], dtype)
    if query is not None:
        assert q_embed.stride() == query.stride()
        assert_bound("q", q_embed, _torch_rope(query, key, cos, sin)[0], q64, dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(q_embed, q_ref)
    else:
        assert q_embed is None


def _torch_rope(q, k, cos, sin):
    """transformers' formula in the input dtype (the baseline of the bound)."""
    c, s = cos.to(q.dtype).unsqueeze(1), sin.to(q.dtype).unsqueeze(1)
    rd = cos.shape[-1]

    def one(x):
        xr = x[..., :rd]
        return torch.cat((xr * c + reference.rotate_half(xr) * s, x[..., rd:]), -1)

    return one(q), one(k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", [(16, 16), (72, 72), (10, 6)])  # (head dim, rotary dim): odd blocks, partial
def test_matches_reference(device, dtype, dims):
    D, rd = dims
    _check(dtype, *_inputs(dtype, D=D, rd=rd, device=device))


def test_wrapped_and_skipped_slots_without_query(device):
    # slots 6 and 0: the ring wrapped between the two tokens; -1 and 7 (= C) are skipped, not written.
    args = _inputs(torch.float32, B=1, Hkv=1, Hq=1, T=4, slots=(6, -1, 0, 7), device=device, cos_batch=1)
    _check(torch.float32, *args[:-1], None)


def test_per_batch_cos_and_one_token_decode(device):
    # cos [B, T, rd] (positions differ per row, as with left padding) and T = 1, the decode step.
    for T, slots in ((1, (3,)), (3, (2, 3, 4))):
        _check(torch.bfloat16, *_inputs(torch.bfloat16, B=3, T=T, slots=slots, device=device, cos_batch=3))


def test_contiguous_inputs_and_a_batch_view_of_the_cache(device):
    key, value, cos, sin, k_cache, v_cache, slots, query = _inputs(torch.float32, device=device)
    big_k = torch.full((5, *k_cache.shape[1:]), float("nan"), device=device)
    big_v = big_k.clone()
    _check(torch.float32, key.contiguous(), value.contiguous(), cos, sin, big_k[:3], big_v[:3], slots,
           query.contiguous())
    assert big_k[3:].isnan().all() and big_v[3:].isnan().all()


def test_runs_the_kernel_on_this_device(device):
    before = ops.dispatch_counts[("rope_kv_write", "triton")]
    rope_kv_write(*_inputs(torch.float32, device=device)[:-1])
    assert ops.dispatch_counts[("rope_kv_write", "triton")] == before + 1


def test_empty_batch(device):
    key, value, cos, sin, kc, vc, slots, query = _inputs(torch.float32, device=device)
    out = rope_kv_write(key[:0], value[:0], cos, sin, kc[:0], vc[:0], slots, query=query[:0])
    assert out.shape == (0, *query.shape[1:])


def _bad(**over):
    def call(d):
        names = ("key", "value", "cos", "sin", "k_cache", "v_cache", "slots", "query")
        a = dict(zip(names, _inputs(torch.float32, device=d)))
        a.update({n: (f(a) if callable(f) else f) for n, f in over.items()})
        query = a.pop("query")
        return rope_kv_write(*a.values(), query=query)
    return call


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (_bad(key=lambda a: a["key"][0]), ValueError, r"rope_kv_write: key must have shape \[B, Hkv, T, D\]"),
        (_bad(value=lambda a: a["value"][:, :, :1]), ValueError, "rope_kv_write: value must have shape"),
        (_bad(k_cache=lambda a: a["k_cache"][:, :2]), ValueError, "rope_kv_write: k_cache must have shape"),
        (_bad(v_cache=lambda a: a["v_cache"][:, :, :3]), ValueError, "rope_kv_write: v_cache must have shape"),
        (_bad(k_cache=lambda a: a["k_cache"].half()), TypeError, "rope_kv_write: k_cache has dtype"),
        (_bad(query=lambda a: a["query"][:, :, :1]), ValueError, "rope_kv_write: query must have shape"),
        (_bad(cos=lambda a: a["cos"][:, :1]), ValueError, "rope_kv_write: cos must have shape"),
        (_bad(sin=lambda a: a["sin"][..., :8]), ValueError, "rope_kv_write: sin must have shape"),
        (_bad(cos=lambda a: a["cos"][..., :5], sin=lambda a: a["sin"][..., :5]), ValueError, "rotary_dim 5"),
        (_bad(slots=lambda a: a["slots"].int()), TypeError, "rope_kv_write: slots must be int64"),
        (_bad(slots=lambda a: a["slots"][:1]), ValueError, r"rope_kv_write: slots must have shape \(2,\)"),
        (_bad(slots=[5, 1]), TypeError, "rope_kv_write: slots must be a torch.Tensor"),
        (_bad(key=lambda a: a["key"].long()), TypeError, "rope_kv_write: key must be float32"),
        (_bad(k_cache=lambda a: a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
         "rope_kv_write: k_cache must have unit stride"),
        (_bad(key=lambda a: a["key"].requires_grad_()), RuntimeError, "rope_kv_write: inference only"),
    ],
)
def test_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=match):
        call(device)


def test_opcheck(device):
    key, value, cos, sin, kc, vc, slots, query = _inputs(torch.bfloat16, B=1, Hq=2, Hkv=1, T=1, slots=(3,),
                                                          device=device)
    kc.zero_()
    vc.zero_()
    args = (key.contiguous(), value.contiguous(), cos, sin, kc, vc, slots)
    # aot_dispatch is left to the fullgraph compile test below (it alone takes seconds on the interpreter)
    torch.library.opcheck(torch.ops.tigon.rope_kv_write, (*args, query.contiguous()),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_compile_fullgraph_uses_the_custom_op(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    key, value, cos, sin, kc, vc, slots, query = _inputs(torch.float32, device=device)
    kc.zero_()
    vc.zero_()
    kc2, vc2 = kc.clone(), vc.clone()

    def fn(k, v, kc, vc, q):
        return rope_kv_write(k * 1, v, cos, sin, kc, vc, slots, query=q) + 1

    got = torch.compile(fn, fullgraph=True, backend=backend)(key, value, kc, vc, query)
    torch.testing.assert_close(got, fn(key, value, kc2, vc2, query))
    torch.testing.assert_close(kc, kc2)
    torch.testing.assert_close(vc, vc2)


@pytest.mark.gpu
def test_llama_8b_decode_shape_no_sync_deterministic_gpu():
    """Llama-3-8B decode in bf16: B = 8, 32 q heads, 8 kv heads, D = 128, a 4096-slot ring; no host sync."""
    key, value, cos, sin, kc, vc, slots, query = _inputs(torch.bfloat16, B=8, Hq=32, Hkv=8, T=1, D=128, C=4096,
                                                          slots=(4095,), device="cuda")
    _check(torch.bfloat16, key, value, cos, sin, kc, vc, slots, query)

    def run():
        q = rope_kv_write(key, value, cos, sin, kc, vc, slots, query=query)
        return q, kc[:, :, 4095].clone(), vc[:, :, 4095].clone()

    assert_no_sync_and_deterministic(run)


def test_rolling_cache_update_rope_equals_rope_then_update(device):
    """RollingKVLayer.update_rope (the decode step's user) leaves the ring as apply_rope + update does: a prefill
    chunk that overflows the ring, then decode steps that wrap it past 2 sink slots."""
    from tests.hf._tiny import tiny_config
    from tigon.memory.kv_cache import RollingKVCache

    config = tiny_config("llama", num_hidden_layers=1)
    ours, ref = (RollingKVCache(config, batch_size=2, capacity=6, sink_tokens=2, dtype=torch.float32, device=device)
                 for _ in range(2))
    torch.manual_seed(0)
    for t in (7, 1, 1, 1):
        k, v, q = (randn(2, n, t, 16, device=device) for n in (2, 2, 4))
        ang = torch.rand(2, t, 8, device=device) * 6.0
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
        keys, values, q_embed = ours.layers[0].update_rope(k, v, cos, sin, q)
        q_ref, k_ref = ops.apply_rope(q, k, cos, sin)
        ref_keys, ref_values = ref.layers[0].update(k_ref, v)
        torch.testing.assert_close(q_embed, q_ref)
        torch.testing.assert_close(keys, ref_keys)
        torch.testing.assert_close(values, ref_values)
    for a, b in zip((ours.layers[0].keys, ours.layers[0].positions, ours.layers[0]._next),
                    (ref.layers[0].keys, ref.layers[0].positions, ref.layers[0]._next)):
        torch.testing.assert_close(a, b)
    assert ours.get_seq_length() == ref.get_seq_length() == 10
