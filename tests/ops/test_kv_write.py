import pytest
import torch

from tests._grid import DTYPES, assert_bound, assert_no_sync_and_deterministic, randn
from tigon import ops
from tigon.ops import reference
from tigon.ops.kv_write import rope_kv_append, rope_kv_write


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
    q_ref = reference.rope_kv_write(key, value, cos, sin, kc_ref, vc_ref, slots, query=query)
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


# ----------------------------------------------------------------------------------------------------------
# rope_kv_append: rope_kv_write at ring slots computed in the kernel from next_position


def _ring_slot(p, C, sink):
    """The documented rule stated as the ring fills, independently of reference.ring_slot's arithmetic: the
    first C positions take slots 0..C-1; later, position p takes the slot of the oldest rolling position still
    held, p - (C - sink)."""
    return p if p < C else _ring_slot(p - (C - sink), C, sink)


@pytest.mark.parametrize("C,sink", [(1, 0), (8, 0), (8, 2), (8, 7), (5, 1)])
def test_ring_slot_formula(device, C, sink):
    """reference.ring_slot (the one formula: the kernel, the reference and RollingKVCache use it) against the
    fill rule, functional and in place from device constants, for positions up to several laps."""
    p = torch.arange(4 * C + 3, device=device)
    want = [_ring_slot(int(i), C, sink) for i in p]
    assert reference.ring_slot(p, sink, C - sink).tolist() == want
    consts = torch.tensor([sink, C - sink], device=device)
    out = torch.empty(1, dtype=torch.int64, device=device)
    for i in (0, C - 1, C, 3 * C + 2):
        reference.ring_slot(p[i:i + 1], consts[0:1], consts[1:2], out=out)
        assert out.item() == want[i]


def _append_inputs(dtype, *, C=8, T=1, next_pos=0, device, **kw):
    """_inputs' tensors (NaN-poisoned ring), positions all -1 (empty) and next_position int64 [1]."""
    key, value, cos, sin, k_cache, v_cache, _, query = _inputs(dtype, T=T, C=C, slots=(0,) * T, device=device, **kw)
    positions = torch.full((C,), -1, dtype=torch.int64, device=device)
    return key, value, cos, sin, k_cache, v_cache, positions, torch.tensor([next_pos], device=device), query


def _same(a, b):
    """Bitwise equal, NaN (the unwritten poison) included."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _check_append(dtype, key, value, cos, sin, k_cache, v_cache, positions, next_position, *, sink=0, query=None):
    """rope_kv_append against its reference, against rope_kv_write at the slots the rule gives, and the rotated
    keys against fp64; positions records the chunk, next_position is left as it was."""
    C, T = k_cache.shape[2], key.shape[2]
    ps = [int(next_position.item()) + t for t in range(T)]
    slots = [_ring_slot(p, C, sink) for p in ps]
    assert len(set(slots)) == T, "test precondition: no two tokens of the chunk share a slot"
    assert reference.ring_slot(torch.tensor(ps), sink, C - sink).tolist() == slots
    kc_ref, vc_ref, pos_ref = k_cache.clone(), v_cache.clone(), positions.clone()
    kc_w, vc_w = k_cache.clone(), v_cache.clone()
    pos_before, next_before = positions.clone(), next_position.clone()

    q_embed = rope_kv_append(key, value, cos, sin, k_cache, v_cache, positions, next_position, sink=sink,
                             query=query)
    q_ref = reference.rope_kv_append(key, value, cos, sin, kc_ref, vc_ref, pos_ref, next_position.clone(),
                                     sink=sink, query=query)
    q_w = rope_kv_write(key, value, cos, sin, kc_w, vc_w, torch.tensor(slots, device=key.device), query=query)

    assert torch.equal(next_position, next_before), "next_position must not be advanced"
    expected = pos_before.clone()
    expected[slots] = torch.tensor(ps, device=expected.device)
    assert torch.equal(positions, expected), (positions.tolist(), expected.tolist())
    assert torch.equal(pos_ref, expected)
    # The same kernel as rope_kv_write given the slots: the same bits, written at the same places only.
    assert _same(k_cache, kc_w) and _same(v_cache, vc_w)
    assert torch.equal(k_cache.isnan(), kc_ref.isnan()) and torch.equal(v_cache.isnan(), vc_ref.isnan())
    assert torch.isfinite(k_cache[:, :, slots]).all() and torch.isfinite(v_cache[:, :, slots]).all()
    assert torch.equal(v_cache.nan_to_num(), vc_ref.nan_to_num())
    q_or_k = query if query is not None else key
    q64, k64 = reference.apply_rope(q_or_k.double(), key.double(), cos.double(), sin.double())
    q_dt, k_dt = _torch_rope(q_or_k, key, cos, sin)
    assert_bound("k", k_cache[:, :, slots], k_dt, k64, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(k_cache.nan_to_num(), kc_ref.nan_to_num())
    if query is None:
        assert q_embed is None and q_ref is None and q_w is None
    else:
        assert torch.equal(q_embed, q_w) and q_embed.stride() == query.stride()
        assert_bound("q", q_embed, q_dt, q64, dtype)
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink", [0, 2])
@pytest.mark.parametrize("next_pos", [0, 5, 7, 8, 13])
@pytest.mark.parametrize("T", [1, 3])
def test_append_ring_slots(device, dtype, sink, next_pos, T):
    """C = 8: a chunk before the ring is full, at its end, wrapping within the chunk (7, 8, 9), one lap on (8),
    and several (13); with 2 sink slots the wrap lands on slot 2, never on the sinks."""
    args = _append_inputs(dtype, C=8, T=T, next_pos=next_pos, B=2, device=device, seed=next_pos + T)
    slots = _check_append(dtype, *args[:-1], sink=sink, query=args[-1])
    assert all(s >= sink for s, p in zip(slots, range(next_pos, next_pos + T)) if p >= sink)


@pytest.mark.parametrize("next_pos,T", [(0, 3), (4, 3), (6, 1), (7, 1), (12, 1)])
def test_append_all_but_one_slot_are_sinks(device, next_pos, T):
    # sink = C - 1: positions 0..6 keep their slots, every later one lands on slot 7 (p - sink is down to -7
    # here: more than one lap below zero, which must still count as no lap).
    args = _append_inputs(torch.bfloat16, C=8, T=T, next_pos=next_pos, B=2, device=device, seed=next_pos)
    slots = _check_append(torch.bfloat16, *args[:-1], sink=7, query=args[-1])
    assert slots == [min(p, 7) for p in range(next_pos, next_pos + T)]


@pytest.mark.parametrize("with_query", [True, False])
def test_append_rows_equals_the_checked_op(device, with_query):
    # rope_kv_append_rows: the same launch without the argument checks (the fused prefill's write): bitwise the
    # public op's cache, positions and rotated query, on a chunk that wraps past 1 sink slot, partial rotary.
    from tigon.ops.kv_write import rope_kv_append_rows

    args = _append_inputs(torch.bfloat16, C=5, T=3, next_pos=3, B=2, D=10, rd=6, device=device)
    key, value, cos, sin, kc, vc, pos, nxt, query = args
    query = query if with_query else None
    kc2, vc2, pos2 = kc.clone(), vc.clone(), pos.clone()
    want = rope_kv_append(key, value, cos, sin, kc, vc, pos, nxt, sink=1, query=query)
    before = ops.dispatch_counts[("rope_kv_append", "triton")] + ops.dispatch_counts[("rope_kv_append", "reference")]
    got = rope_kv_append_rows(key, value, cos, sin, kc2, vc2, pos2, nxt, 1, query)
    after = ops.dispatch_counts[("rope_kv_append", "triton")] + ops.dispatch_counts[("rope_kv_append", "reference")]
    assert after == before + 1  # counted like the op (tests count the prefill's writes)
    assert (got is None) == (query is None) and (got is None or _same(got, want))
    assert _same(kc2, kc) and _same(vc2, vc) and torch.equal(pos2, pos)


def test_rolling_cache_prefill_rope_equals_update_rope(device):
    """RollingKVLayer.prefill_rope (the fused prefill's unchecked write) leaves the ring, positions and counters
    as update_rope does, and takes only a first chunk that fits."""
    from tests.hf._tiny import tiny_config
    from tigon.memory.kv_cache import RollingKVCache

    config = tiny_config("llama", num_hidden_layers=1)
    ours, ref = (RollingKVCache(config, batch_size=2, capacity=7, dtype=torch.float32, device=device).layers[0]
                 for _ in range(2))
    k, v, q = (randn(2, n, 5, 16, device=device) for n in (2, 2, 4))
    ang = torch.rand(1, 5, 8, device=device) * 6.0
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    got, want = ours.prefill_rope(k, v, cos, sin, q), ref.update_rope(k, v, cos, sin, q)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert ours.seen == ref.seen == 5 and torch.equal(ours.positions, ref.positions)
    assert torch.equal(ours._next, ref._next)
    with pytest.raises(ValueError, match=r"prefill_rope: the first chunk of a layer that holds nothing, at most 7 "
                                         r"tokens; this layer holds 5 and the chunk has 1"):
        ours.prefill_rope(k[:, :, :1], v[:, :, :1], cos[:, :1], sin[:, :1])


def test_append_without_query_partial_rotary_and_per_batch_cos(device):
    # fp16, B = 3 with one cos row per sequence, rotary dim 6 of D = 10, no query; the chunk wraps past C.
    args = _append_inputs(torch.float16, C=5, T=2, next_pos=4, B=3, D=10, rd=6, cos_batch=3, device=device)
    _check_append(torch.float16, *args[:-1], sink=1, query=None)


def test_append_contiguous_inputs_and_a_zero_dim_next_position(device):
    key, value, cos, sin, kc, vc, pos, nxt, query = _append_inputs(torch.float32, C=8, T=2, next_pos=6,
                                                                   device=device)
    nxt0 = nxt.reshape(())
    _check_append(torch.float32, key.contiguous(), value.contiguous(), cos, sin, kc, vc, pos, nxt0, sink=3,
                  query=query.contiguous())
    assert nxt0.shape == () and nxt0.item() == 6


def test_append_decode_sequence_wraps_the_ring(device):
    """A prefill chunk, then decode steps and a second chunk, the caller advancing next_position by T: the ring
    of C = 8 with 2 sinks wraps twice; cache and positions equal the reference run step for step."""
    C, sink, B = 8, 2, 2
    _, _, _, _, kc, vc, pos, nxt, _ = _append_inputs(torch.bfloat16, C=C, B=B, device=device)
    kc_ref, vc_ref, pos_ref = kc.clone(), vc.clone(), pos.clone()
    for step, T in enumerate((5, 1, 1, 1, 1, 3, 1, 4, 1)):
        key, value, cos, sin, _, _, _, query = _inputs(torch.bfloat16, B=B, T=T, C=C, slots=(0,) * T,
                                                       device=device, seed=step)
        q = rope_kv_append(key, value, cos, sin, kc, vc, pos, nxt, sink=sink, query=query)
        q_ref = reference.rope_kv_append(key, value, cos, sin, kc_ref, vc_ref, pos_ref, nxt, sink=sink,
                                         query=query)
        nxt += T
        assert torch.equal(pos, pos_ref)
        assert _same(vc, vc_ref)
        torch.testing.assert_close(kc.nan_to_num(), kc_ref.nan_to_num(), rtol=2**-7, atol=2**-7)
        torch.testing.assert_close(q, q_ref.to(q.dtype), rtol=2**-7, atol=2**-7)
    n = int(nxt.item())
    assert n == 18
    # Each slot holds the latest position that maps to it: sinks 0, 1; the rolling slots the last lap.
    latest = {_ring_slot(p, C, sink): p for p in range(n)}
    assert pos.tolist() == [latest[s] for s in range(C)]
    assert not kc.isnan().any() and not vc.isnan().any()


@pytest.mark.parametrize("B", [1, 4])
def test_append_records_positions_once_for_the_batch(device, B):
    # positions is shared by the batch (one [C] row); a slot outside the chunk keeps what it had.
    args = list(_append_inputs(torch.float32, C=8, T=2, next_pos=9, B=B, device=device))
    args[6] = torch.arange(100, 108, device=device)
    _check_append(torch.float32, *args[:-1], sink=0, query=None)
    assert args[6].tolist() == [100, 9, 10, 103, 104, 105, 106, 107]


def test_append_runs_the_kernel_on_this_device(device):
    args = _append_inputs(torch.float32, device=device)
    before = ops.dispatch_counts[("rope_kv_append", "triton")]
    ref_before = ops.dispatch_counts[("rope_kv_append", "reference")]
    rope_kv_append(*args[:-1])
    assert ops.dispatch_counts[("rope_kv_append", "triton")] == before + 1
    assert ops.dispatch_counts[("rope_kv_append", "reference")] == ref_before


def _bad_append(**over):
    def call(d):
        names = ("key", "value", "cos", "sin", "k_cache", "v_cache", "positions", "next_position", "query")
        a = dict(zip(names, _append_inputs(torch.float32, C=8, T=2, device=d)), sink=2)
        a.update({n: (f(a) if callable(f) else f) for n, f in over.items()})
        kw = {n: a.pop(n) for n in ("sink", "query")}
        return rope_kv_append(*a.values(), **kw)
    return call


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (_bad_append(positions=lambda a: a["positions"].int()), TypeError,
         "rope_kv_append: positions must be int64, got torch.int32"),
        (_bad_append(positions=lambda a: a["positions"].float()), TypeError, "rope_kv_append: positions must be"),
        (_bad_append(positions=lambda a: a["positions"][:7]), ValueError,
         r"rope_kv_append: positions must be a contiguous int64 \[8\] tensor .* got torch.int64 \(7,\)"),
        (_bad_append(positions=lambda a: a["positions"].view(1, 8)), ValueError, "rope_kv_append: positions must"),
        (_bad_append(positions=lambda a: torch.arange(16, device=a["positions"].device)[::2]), ValueError,
         "rope_kv_append: positions must be a contiguous"),
        (_bad_append(positions=[0] * 8), TypeError, "rope_kv_append: positions must be a torch.Tensor"),
        (_bad_append(next_position=lambda a: torch.tensor([3, 4], device=a["key"].device)), ValueError,
         r"rope_kv_append: next_position must be one int64 element, got torch.int64 \(2,\)"),
        (_bad_append(next_position=lambda a: a["next_position"][:0]), ValueError,
         "rope_kv_append: next_position must be one int64 element"),
        (_bad_append(next_position=lambda a: a["next_position"].int()), TypeError,
         "rope_kv_append: next_position must be int64, got torch.int32"),
        (_bad_append(next_position=lambda a: a["next_position"].float()), TypeError,
         "rope_kv_append: next_position must be int64"),
        (_bad_append(next_position=5), TypeError, "rope_kv_append: next_position must be a torch.Tensor"),
        (_bad_append(sink=8), ValueError, r"rope_kv_append: sink must be an int in \[0, 8\), got 8"),
        (_bad_append(sink=9), ValueError, r"rope_kv_append: sink must be an int in \[0, 8\)"),
        (_bad_append(sink=-1), ValueError, r"rope_kv_append: sink must be an int in \[0, 8\), got -1"),
        (_bad_append(sink=True), ValueError, r"rope_kv_append: sink must be an int in \[0, 8\), got True"),
        (_bad_append(sink=2.0), ValueError, "rope_kv_append: sink must be an int"),
        (_bad_append(sink=None), ValueError, "rope_kv_append: sink must be an int"),
        (_bad_append(sink=lambda a: torch.tensor(2)), ValueError, "rope_kv_append: sink must be an int"),
        # The tensors' own checks (shared with rope_kv_write, naming rope_kv_append).
        (_bad_append(key=lambda a: a["key"][0]), ValueError, r"key must have shape \[B, Hkv, T, D\]"),
        (_bad_append(k_cache=lambda a: a["k_cache"][:, :, :7]), ValueError, "v_cache must have shape"),
        (_bad_append(v_cache=lambda a: a["v_cache"].half()), TypeError, "v_cache has dtype"),
        (_bad_append(key=lambda a: a["key"].requires_grad_()), RuntimeError, "inference only"),
    ],
)
def test_append_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=match):
        call(device)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "reference"])
def test_append_negative_next_position(monkeypatch, kernels):
    """Where next_position's value is on the host (CPU, or TIGON_VALIDATE=1), a negative one is a ValueError on
    both paths; a device value is not read (no sync in a decode step): both paths then skip the tokens whose
    position is negative and write the others (-1 + t for t = 0, 1, 2: positions 0 and 1)."""
    from tigon.ops import _library

    on_gpu = kernels and torch.cuda.is_available()  # natively there; on a CPU the kernels run in the interpreter
    if not on_gpu:
        monkeypatch.setattr(_library, "interpreter_on", lambda: kernels)
    monkeypatch.setattr(_library, "host_checks", lambda device: True)  # CPU, or TIGON_VALIDATE=1 on CUDA
    path = "triton" if kernels else "reference"
    args = _append_inputs(torch.float32, C=8, T=3, next_pos=-1, device=torch.device("cuda" if on_gpu else "cpu"))
    with pytest.raises(ValueError, match=r"^tigon.ops.rope_kv_append: next_position must be >= 0 .*, got -1$"):
        rope_kv_append(*args[:-1], sink=2)
    monkeypatch.setattr(_library, "host_checks", lambda device: False)  # as on CUDA without TIGON_VALIDATE
    before = ops.dispatch_counts[("rope_kv_append", path)]
    key, value, cos, sin, k_cache, v_cache, positions, nxt, query = args
    rope_kv_append(key, value, cos, sin, k_cache, v_cache, positions, nxt, sink=2, query=query)
    assert ops.dispatch_counts[("rope_kv_append", path)] == before + 1
    assert positions.tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    assert not k_cache[:, :, :2].isnan().any() and k_cache[:, :, 2:].isnan().all()
    assert torch.equal(v_cache[:, :, :2], value[:, :, 1:])


def test_append_bad_tensor_names_the_op(device):
    with pytest.raises(ValueError, match="rope_kv_append: key must have shape"):
        _bad_append(key=lambda a: a["key"][0])(device)


def test_append_opcheck(device):
    key, value, cos, sin, kc, vc, pos, nxt, query = _append_inputs(torch.bfloat16, B=1, Hq=2, Hkv=1, C=8, T=1,
                                                                   next_pos=9, device=device)
    kc.zero_()
    vc.zero_()
    args = (key.contiguous(), value.contiguous(), cos, sin, kc, vc, pos, nxt, 2, query.contiguous())
    torch.library.opcheck(torch.ops.tigon.rope_kv_append, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_append_compile_fullgraph_uses_the_custom_op(device):
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    key, value, cos, sin, kc, vc, pos, nxt, query = _append_inputs(torch.float32, C=8, T=2, next_pos=7,
                                                                   device=device)
    kc.zero_()
    vc.zero_()
    kc2, vc2, pos2 = kc.clone(), vc.clone(), pos.clone()

    def fn(k, v, kc, vc, pos, q):
        return rope_kv_append(k * 1, v, cos, sin, kc, vc, pos, nxt, sink=2, query=q) + 1

    before = ops.dispatch_counts[("rope_kv_append", "triton")]
    got = torch.compile(fn, fullgraph=True, backend=backend)(key, value, kc, vc, pos, query)
    assert ops.dispatch_counts[("rope_kv_append", "triton")] == before  # traced, not run eagerly
    torch.testing.assert_close(got, fn(key, value, kc2, vc2, pos2, query))
    torch.testing.assert_close(kc, kc2)
    torch.testing.assert_close(vc, vc2)
    assert torch.equal(pos, pos2) and pos.tolist() == [-1, -1, 8, -1, -1, -1, -1, 7]
    assert nxt.item() == 7
