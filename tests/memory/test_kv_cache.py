"""RollingKVCache against Hugging Face's own caches on tiny random-init models (CPU, fp32).

Exactness is "the same greedy tokens and logits within fp32 reordering noise": the ring returns keys in slot
order and with masked empty slots, so attention sums in another order (measured |d logits| <= 5e-6)."""

import gc

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, PretrainedConfig

from tests.hf._tiny import greedy_with_scores as _greedy
from tests.hf._tiny import prompt_ids as _ids
from tests.hf._tiny import tiny_config, tiny_model
from tigon.memory.kv_cache import RollingKVCache

TOL = dict(rtol=1e-4, atol=1e-4)


def _assert_same_generation(ref, got):
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], **TOL)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2"])
def test_generate_matches_hf_while_it_fits(model_type, attn):
    # gemma2's local layers have window 16 < 7 + 13: they roll (ring = window) while its global layers fit.
    model = tiny_model(model_type, attn_implementation=attn).eval()
    ids = _ids(2, 7)
    ref = _greedy(model, ids, DynamicCache(config=model.config), 13)
    cache = RollingKVCache(model.config, batch_size=2, capacity=20)
    _assert_same_generation(ref, _greedy(model, ids, cache, 13))
    assert cache.get_seq_length() == 19


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_generate_left_padded_batch_while_it_fits(attn):
    model = tiny_model("llama", attn_implementation=attn).eval()
    ids = _ids(3, 9)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ref = _greedy(model, ids, DynamicCache(config=model.config), 6, attention_mask=mask)
    _assert_same_generation(ref, _greedy(model, ids, RollingKVCache(model.config, batch_size=3, capacity=15), 6,
                                         attention_mask=mask))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("capacity", [8, 24])
def test_mistral_sliding_window_past_capacity_matches_hf(attn, capacity):
    # window 8 < prompt 13: the prefill overflows the ring (chunk path), then every decode step wraps it.
    # capacity 24 > window: the sliding layers still get a ring of 8 (nothing outside the window is needed).
    model = tiny_model("mistral", attn_implementation=attn, sliding_window=8).eval()
    ids = _ids(2, 13)
    ref = _greedy(model, ids, DynamicCache(config=model.config), 12)
    cache = RollingKVCache(model.config, batch_size=2, capacity=capacity)
    _assert_same_generation(ref, _greedy(model, ids, cache, 12))
    assert all(layer.ring == 8 for layer in cache.layers)


def test_chat_continuation_past_capacity_matches_hf():
    # A second generate on the same cache feeds a multi-token chunk into an already wrapped ring.
    model = tiny_model("mistral", attn_implementation="sdpa", sliding_window=6).eval()
    ids = _ids(1, 5)
    ref_cache, cache = DynamicCache(config=model.config), RollingKVCache(model.config, batch_size=1, capacity=6)
    ref, got = _greedy(model, ids, ref_cache, 9), _greedy(model, ids, cache, 9)
    _assert_same_generation(ref, got)
    more = torch.cat((ref[0], _ids(1, 4, seed=3)), 1)
    _assert_same_generation(_greedy(model, more, ref_cache, 7), _greedy(model, more, cache, 7))


@pytest.mark.parametrize("model_type,overrides,capacity", [("llama", {}, 16), ("mistral", dict(sliding_window=5), 5)])
def test_beam_search_matches_hf(model_type, overrides, capacity):
    # Beam search reorders the cache rows every step: in place, on the fixed ring (wrapped for mistral).
    model = tiny_model(model_type, attn_implementation="sdpa", **overrides).eval()
    ids = _ids(2, 6)
    kw = dict(max_new_tokens=8, do_sample=False, num_beams=3, pad_token_id=0)
    ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    cache = RollingKVCache(model.config, batch_size=6, capacity=capacity, device="cpu")  # allocated here
    ptr = cache.layers[0].keys.data_ptr()
    assert torch.equal(model.generate(ids, past_key_values=cache, **kw), ref)
    assert cache.layers[0].keys.data_ptr() == ptr


def _stepwise_logits(model, ids, cache, chunks):
    out, start = [], 0
    for size in chunks:
        out.append(model(ids[:, start:start + size], past_key_values=cache, use_cache=True).logits)
        start += size
    assert start == ids.shape[1]
    return torch.cat(out, 1)


@pytest.mark.parametrize("model_type,overrides,capacity,chunks", [
    ("llama", {}, 16, [1] * 12),
    ("qwen3", {}, 12, [5, 1, 1, 4, 1]),
    ("mistral", dict(sliding_window=5), 5, [1] * 14),      # every step after the 5th wraps the ring
    ("mistral", dict(sliding_window=5), 5, [3, 4, 1, 6]),  # chunks that overflow a partly filled, wrapped ring
    ("gemma2", dict(sliding_window=4), 14, [2, 1, 3, 1, 1, 1, 5]),
])
def test_token_by_token_equals_one_prefill(model_type, overrides, capacity, chunks):
    model = tiny_model(model_type, attn_implementation="sdpa", **overrides).eval()
    ids = _ids(2, sum(chunks))
    with torch.no_grad():
        ref = model(ids).logits  # no cache: HF's own full or sliding-window mask over the whole sequence
        got = _stepwise_logits(model, ids, RollingKVCache(model.config, batch_size=2, capacity=capacity), chunks)
    torch.testing.assert_close(got, ref, **TOL)


def _llama_as_mistral(window):
    """The same weights as a Mistral with `window`: a full-attention model whose cache keeps the last `window`
    tokens must decode exactly like the model trained with that window."""
    llama = tiny_model("llama", attn_implementation="sdpa").eval()
    from transformers import AutoModelForCausalLM

    mistral = AutoModelForCausalLM.from_config(tiny_config("mistral", sliding_window=window,
                                                           attn_implementation="sdpa")).float().eval()
    mistral.load_state_dict(llama.state_dict())
    return llama, mistral


def test_a_chunk_attends_to_the_written_slots_and_a_decode_step_to_the_ring():
    """A prefill that fits sees only what was written (kv_length == q for the first one, so HF may drop the
    mask and SDPA run its causal kernels); a decode step sees the whole ring, one shape for CUDA graphs."""
    cache = RollingKVCache(tiny_config("llama"), batch_size=2, capacity=12, dtype=torch.float32)
    layer = cache.layers[0]
    h, d = layer.num_heads, layer.head_dim
    assert layer.get_mask_sizes(5) == (5, 0)
    k, v = (torch.randn(2, h, 5, d) for _ in range(2))
    got_k, got_v = cache.update(k, v, 0)
    assert got_k.shape == (2, h, 5, d) and torch.equal(got_k, k) and torch.equal(got_v, v)
    assert layer.get_mask_sizes(3) == (8, 0) and layer.get_mask_sizes(1) == (12, 0)
    k2, v2 = (torch.randn(2, h, 3, d) for _ in range(2))
    got_k, _ = cache.update(k2, v2, 0)
    assert got_k.shape == (2, h, 8, d) and torch.equal(got_k[:, :, 5:], k2)
    got_k, _ = cache.update(*(torch.randn(2, h, 1, d) for _ in range(2)), 0)
    assert got_k.shape == (2, h, 12, d)


def test_eviction_on_a_full_attention_model_is_a_sliding_window():
    llama, mistral = _llama_as_mistral(7)
    ids = _ids(2, 6)  # the prompt fits; the 14 decode steps evict
    ref = _greedy(mistral, ids, DynamicCache(config=mistral.config), 14)
    cache = RollingKVCache(llama.config, batch_size=2, capacity=7, sliding=True)  # the window, asked for
    _assert_same_generation(ref, _greedy(llama, ids, cache, 14))


def test_a_prompt_past_a_full_attention_ring_is_refused_unless_a_window_is_asked_for():
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    ids = _ids(1, 6)
    cache = RollingKVCache(model.config, batch_size=1, capacity=4)
    msg = (r"RollingKVCache: a 6-token chunk \(a prompt\) on 0 cached tokens needs 6 slots, but capacity is 4: layer 0 "
           r"is a full-attention layer.*Pass capacity >= 6, or RollingKVCache\(\.\.\., sliding=True\) \(or "
           r"sink_tokens=\)")
    with pytest.raises(ValueError, match=msg):
        model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == 0 and bool((cache.layers[0].positions == -1).all())  # nothing written
    for opt_in in (dict(sliding=True), dict(sink_tokens=1)):
        cache = RollingKVCache(model.config, batch_size=1, capacity=4, **opt_in)
        assert model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False).shape == (1, 8)
        assert cache.get_seq_length() == 7
    with pytest.raises(TypeError, match="RollingKVCache: sliding must be True or False"):
        RollingKVCache(model.config, batch_size=1, capacity=4, sliding=1)


def test_an_overflowing_chunk_is_refused_on_full_layers_only():
    # Gemma-2: local layers (window 4) roll on their own; its global layers refuse a continuation past capacity.
    cache = RollingKVCache(tiny_config("gemma2", sliding_window=4), batch_size=1, capacity=8, dtype=torch.float32)
    local, full = (next(layer for layer in cache.layers if layer.is_sliding == s) for s in (True, False))
    k = torch.randn(1, full.num_heads, 6, full.head_dim)
    local.update(k, k)
    local.update(k, k)  # 12 tokens through a 4-slot ring: its window
    full.update(k, k)
    full.update(k[:, :, :1], k[:, :, :1])  # a decode step fits
    with pytest.raises(ValueError, match=r"a 2-token chunk \(a continuation\) on 7 cached tokens needs 9 slots, but "
                                         r"capacity is 8: layer \d+ is a full-attention layer"):
        full.update(k[:, :, :2], k[:, :, :2])
    assert full.get_seq_length() == 7


def test_attention_sinks_keep_the_first_tokens():
    # capacity 8 with 3 sinks: position p attends {0, 1, 2} and its last 5 tokens. The reference is one
    # no-cache forward of the generated sequence with that mask spelled out as a 4-D boolean mask.
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    ids = _ids(2, 6)
    cache = RollingKVCache(model.config, batch_size=2, capacity=8, sink_tokens=3)
    seq, scores = _greedy(model, ids, cache, 15)
    p = torch.arange(seq.shape[1])
    allowed = (p[None, :] <= p[:, None]) & ((p[None, :] < 3) | (p[None, :] > p[:, None] - 5))
    with torch.no_grad():
        ref = model(seq, attention_mask=allowed.expand(2, 1, -1, -1)).logits[:, 5:-1]
    ref[..., model.generation_config.eos_token_id] = float("-inf")  # min_new_tokens masks EOS in the scores
    torch.testing.assert_close(scores, ref, **TOL)
    layer = cache.layers[0]
    held = sorted(layer.positions.tolist())
    assert held == [0, 1, 2] + list(range(seq.shape[1] - 1 - 5, seq.shape[1] - 1))


def test_sinks_survive_an_overflowing_prefill():
    cfg = tiny_config("llama")
    cache = RollingKVCache(cfg, batch_size=1, capacity=6, sink_tokens=2)
    k = torch.arange(11, dtype=torch.float32).view(1, 1, 11, 1).expand(1, 2, 11, 16).contiguous()
    cache.update(k, k + 100, 0)
    layer = cache.layers[0]
    assert layer.positions.tolist() == [0, 1, 10, 7, 8, 9]  # slot 2 + (p - 2) % 4
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 10, 7, 8, 9]
    assert layer.values[0, 1, :, 0].tolist() == [100, 101, 110, 107, 108, 109]


def _formula(cache):
    return sum(2 * layer.batch_size * layer.num_heads * layer.ring * layer.head_dim * layer.dtype.itemsize
               for layer in cache.layers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_is_fixed(dtype):
    model = tiny_model("llama", attn_implementation="sdpa").to(dtype).eval()
    cache = RollingKVCache(model.config, batch_size=2, capacity=9, sink_tokens=2, dtype=dtype)
    assert cache.nbytes() == 2 * 2 * 2 * 2 * 9 * 16 * dtype.itemsize == _formula(cache)
    ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr()) for layer in cache.layers]
    with torch.no_grad():
        model(_ids(2, 12), past_key_values=cache, use_cache=True)  # overflowing prefill
        for i in range(30 if dtype == torch.float32 else 8):
            model(_ids(2, 1, seed=i), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == (42 if dtype == torch.float32 else 20) and cache.nbytes() == _formula(cache)
    assert ptrs == [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.positions.data_ptr())
                    for layer in cache.layers]


def test_gemma2_ring_per_layer_type():
    cfg = tiny_config("gemma2", sliding_window=4)
    cache = RollingKVCache(cfg, batch_size=3, capacity=10, sink_tokens=2, dtype=torch.float32)
    assert [layer.ring for layer in cache.layers] == [4, 10] and cache.is_sliding == [True, False]
    assert [layer.sink for layer in cache.layers] == [0, 2]
    assert cache.nbytes() == _formula(cache) == 2 * 3 * 2 * (4 + 10) * 16 * 4


def test_decode_step_allocates_nothing():
    cache = RollingKVCache(tiny_config("llama"), batch_size=2, capacity=5, sink_tokens=1)
    k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    for _ in range(7):  # wrapped
        cache.update(k, v, 0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keys, values = cache.update(k, v, 0)
    assert [e.name for e in prof.events() if e.cpu_memory_usage > 0] == []
    assert keys is cache.layers[0].keys and values is cache.layers[0].values


def test_decode_update_compiles_fullgraph():
    cfg = tiny_config("llama")
    eager, compiled = (RollingKVCache(cfg, batch_size=2, capacity=5, sink_tokens=1) for _ in range(2))

    def step(cache, k, v):
        keys, values = cache.update(k, v, 1)
        return keys * 1, values * 1

    fn = torch.compile(step, fullgraph=True, backend="aot_eager")
    for _ in range(9):
        k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
        torch.testing.assert_close(fn(compiled, k, v), step(eager, k, v), rtol=0, atol=0)
    assert torch.equal(compiled.layers[1].positions, eager.layers[1].positions)
    assert compiled.get_seq_length(1) == eager.get_seq_length(1) == 9


def test_compiled_model_decode_settles_after_three_graphs():
    # HF branches on the host count (position_ids, mask sizes): one graph specialized on the first step, one
    # dynamic graph while the ring fills, one once it wraps; no recompile after that, same logits as eager.
    model = tiny_model("mistral", attn_implementation="sdpa", sliding_window=6).eval()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    fn = torch.compile(model.forward, fullgraph=True, backend=count)
    eager, compiled = (RollingKVCache(model.config, batch_size=1, capacity=6) for _ in range(2))
    ids = _ids(1, 14)
    with torch.no_grad():
        for cache in (eager, compiled):
            model(ids[:, :4], past_key_values=cache, use_cache=True)
        for t in range(4, 14):
            step = ids[:, t:t + 1]
            ref = model(step, past_key_values=eager, use_cache=True).logits
            torch.testing.assert_close(fn(step, past_key_values=compiled, use_cache=True).logits, ref, **TOL)
    assert len(graphs) <= 3


def test_reset_and_reorder_keep_storage():
    cfg = tiny_config("llama")
    cache = RollingKVCache(cfg, batch_size=3, capacity=4, sliding=True)  # the 6-token chunk overflows the ring
    k = torch.randn(3, 2, 6, 16)
    cache.update(k, k, 0)
    ptr = cache.layers[0].keys.data_ptr()
    before = cache.layers[0].keys.clone()
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    assert torch.equal(cache.layers[0].keys, before[[2, 0, 0]]) and cache.layers[0].keys.data_ptr() == ptr
    cache.reset()
    assert cache.get_seq_length() == 0 and bool((cache.layers[0].positions == -1).all())
    assert cache.layers[0].keys.data_ptr() == ptr


def test_bad_input():
    cfg = tiny_config("llama")
    with pytest.raises(ValueError, match="RollingKVCache.*capacity"):
        RollingKVCache(cfg, batch_size=1, capacity=0)
    with pytest.raises(ValueError, match="RollingKVCache.*sink_tokens"):
        RollingKVCache(cfg, batch_size=1, capacity=4, sink_tokens=4)
    with pytest.raises(ValueError, match="RollingKVCache.*batch_size"):
        RollingKVCache(cfg, batch_size=0, capacity=4)
    with pytest.raises(TypeError, match="RollingKVCache.*capacity"):
        RollingKVCache(cfg, batch_size=1, capacity=4.0)
    with pytest.raises(TypeError, match="RollingKVCache.*dtype"):
        RollingKVCache(cfg, batch_size=1, capacity=4, dtype=torch.int32)
    with pytest.raises(TypeError, match="RollingKVCache.*config"):
        RollingKVCache({"num_hidden_layers": 2}, batch_size=1, capacity=4)
    with pytest.raises(ValueError, match="RollingKVCache: config .* has no num_hidden_layers"):
        RollingKVCache(PretrainedConfig(), batch_size=1, capacity=4)
    with pytest.raises(ValueError, match="RollingKVCache: config .* hidden_size 10 is not a multiple"):
        RollingKVCache(PretrainedConfig(num_hidden_layers=1, num_attention_heads=4, hidden_size=10), batch_size=1,
                       capacity=4)
    with pytest.raises(ValueError, match="RollingKVCache: device 'tpu'"):
        RollingKVCache(cfg, batch_size=1, capacity=4, device="tpu")
    with pytest.raises(TypeError, match="RollingKVCache: device must be"):
        RollingKVCache(cfg, batch_size=1, capacity=4, device=1.5)
    with pytest.raises(ValueError, match="RollingKVCache: sink_tokens must be >= 0"):
        RollingKVCache(cfg, batch_size=1, capacity=4, sink_tokens=-1)
    with pytest.raises(TypeError, match="RollingKVCache: batch_size must be an int"):
        RollingKVCache(cfg, batch_size=True, capacity=4)
    assert RollingKVCache(cfg, batch_size=1, capacity=4, dtype="float16").dtype == torch.float16
    cache = RollingKVCache(cfg, batch_size=2, capacity=4, dtype=torch.float32)
    ok = torch.randn(2, 2, 1, 16)
    with pytest.raises(ValueError, match="RollingKVCache.*batch 3.*batch_size 2"):
        cache.update(torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16), 0)
    with pytest.raises(ValueError, match="RollingKVCache.*kv_heads=4"):
        cache.update(torch.randn(2, 4, 1, 16), torch.randn(2, 4, 1, 16), 0)
    with pytest.raises(ValueError, match="RollingKVCache.*head_dim=8"):
        cache.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8), 0)
    with pytest.raises(ValueError, match="RollingKVCache.*layer_idx 2"):
        cache.update(ok, ok, 2)
    with pytest.raises(TypeError, match="RollingKVCache.*dtype torch.bfloat16"):
        cache.update(ok.bfloat16(), ok.bfloat16(), 0)
    with pytest.raises(ValueError, match="RollingKVCache.*is on meta"):
        cache.update(ok.to("meta"), ok.to("meta"), 0)
    with pytest.raises(ValueError, match="RollingKVCache.*value_states"):
        cache.update(ok, torch.randn(2, 2, 2, 16), 0)
    assert cache.get_seq_length() == 0  # nothing was written by the rejected calls
    # A cache built for another model: 3 layers of 4 kv heads, used with the 2-layer, 2-kv-head tiny llama.
    other = RollingKVCache(tiny_config("llama", num_hidden_layers=3, num_key_value_heads=4), batch_size=1,
                           capacity=8)
    with pytest.raises(ValueError, match="RollingKVCache.*kv_heads"):
        tiny_model("llama")(_ids(1, 3), past_key_values=other, use_cache=True)
    short = RollingKVCache(tiny_config("llama", num_hidden_layers=1), batch_size=1, capacity=8)
    with pytest.raises(ValueError, match="RollingKVCache.*layer_idx 1.*1 layers"):
        tiny_model("llama")(_ids(1, 3), past_key_values=short, use_cache=True)
    chunked = tiny_config("qwen3", layer_types=["full_attention", "chunked_attention"])
    chunked.attention_chunk_size = 4
    with pytest.raises(ValueError, match="RollingKVCache.*layer types.*chunked_attention"):
        RollingKVCache(chunked, batch_size=1, capacity=4)
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="RollingKVCache.*dtype"):
        model(_ids(1, 3), past_key_values=RollingKVCache(model.config, batch_size=1, capacity=8,
                                                         dtype=torch.bfloat16), use_cache=True)


def test_without_dtype_and_device_the_cache_follows_the_model():
    # A float64 model (not the config's, not torch's default dtype): the rings take key_states' dtype and device
    # at the first update, and the generation equals HF's own cache.
    model = tiny_model("llama", attn_implementation="sdpa").to(torch.float64).eval()
    ids = _ids(2, 5)
    ref = _greedy(model, ids, DynamicCache(config=model.config), 6)
    cache = RollingKVCache(model.config, batch_size=2, capacity=11)
    assert not cache.is_initialized and cache.dtype is None and cache.device is None and cache.nbytes() == 0
    _assert_same_generation(ref, _greedy(model, ids, cache, 6))
    assert cache.is_initialized and cache.dtype == torch.float64 and cache.device == torch.device("cpu")
    for layer in cache.layers:
        assert layer.keys.dtype == layer.values.dtype == torch.float64
        assert layer.positions.device == layer.keys.device == torch.device("cpu")
    assert cache.nbytes() == _formula(cache) == 2 * 2 * 2 * 2 * 11 * 16 * 8
    ptrs = [layer.keys.data_ptr() for layer in cache.layers]
    cache.reset()  # a second generation reuses the rings
    _assert_same_generation(ref, _greedy(model, ids, cache, 6))
    assert ptrs == [layer.keys.data_ptr() for layer in cache.layers]


def test_lazy_rings_take_each_layers_device_and_refuse_a_second_dtype():
    cfg = tiny_config("llama")
    cache = RollingKVCache(cfg, batch_size=2, capacity=4)
    with pytest.raises(RuntimeError, match="RollingKVCache: decode_positions of layer 0 before its first update"):
        cache.layers[0].decode_positions()
    cache.reorder_cache(torch.tensor([1, 0]))  # nothing to reorder yet
    cache.reset()
    with pytest.raises(TypeError, match="RollingKVCache.update: key_states must be floating point"):
        cache.update(torch.ones(2, 2, 1, 16, dtype=torch.int64), torch.ones(2, 2, 1, 16, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="RollingKVCache.*kv_heads=3"):
        cache.update(torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16), 0)
    assert not cache.layers[0].is_initialized  # rejected updates allocate nothing
    half = torch.randn(2, 2, 3, 16, dtype=torch.float16)
    cache.update(half, half, 0)
    meta = torch.empty(2, 2, 1, 16, dtype=torch.bfloat16, device="meta")  # another device for layer 1
    cache.update(meta, meta, 1)
    assert [(layer.dtype, layer.device.type) for layer in cache.layers] == [(torch.float16, "cpu"),
                                                                            (torch.bfloat16, "meta")]
    assert cache.layers[1].keys.device.type == "meta" and cache.layers[1].positions.device.type == "meta"
    with pytest.raises(TypeError, match="RollingKVCache.*dtype torch.float32 does not match the cache dtype "
                                        "torch.float16"):
        cache.update(half.float(), half.float(), 0)
    assert cache.get_seq_length() == 3
    early = RollingKVCache(cfg, batch_size=2, capacity=4)
    early.early_initialization(batch_size=2, num_heads=2, head_dim=16, dtype=torch.bfloat16, device="cpu")
    assert early.is_initialized and early.dtype == torch.bfloat16 and early.get_seq_length() == 0
    assert early.nbytes() == 2 * 2 * 2 * 2 * 4 * 16 * 2


@pytest.mark.parametrize("prompt", [1, 5])
def test_lazy_cache_under_the_fused_decode_layer(prompt):
    # A patched bf16 model on the "tigon" attention: a 1-token prompt's first forward is already a decode step
    # (decode_layer_step writes the ring through update_rope), a longer one goes through the direct prefill.
    import tigon
    from tigon import ops
    from tigon.hf.attention import restore_attention, use_tigon_attention

    model = tiny_model("llama", attn_implementation="sdpa").to(torch.bfloat16).eval()
    tigon.patch(model)
    use_tigon_attention(model)
    try:
        ids = _ids(2, prompt)
        # 2 new tokens: the first forward (which initializes the lazy cache) and one decode step over what it wrote
        kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)
        want = model.generate(ids, past_key_values=RollingKVCache(model.config, batch_size=2, capacity=9,
                                                                  dtype=torch.bfloat16), **kw)
        before = ops.dispatch_counts[("decode_linear", "triton")] + ops.dispatch_counts[("decode_linear", "reference")]
        cache = RollingKVCache(model.config, batch_size=2, capacity=9)
        got = model.generate(ids, past_key_values=cache, **kw)
        assert torch.equal(got, want) and cache.dtype == torch.bfloat16
        after = ops.dispatch_counts[("decode_linear", "triton")] + ops.dispatch_counts[("decode_linear", "reference")]
        assert after > before  # the fused decode layer ran
    finally:
        restore_attention(model)
        tigon.unpatch(model)


@pytest.mark.gpu
def test_gpu_decode_no_host_sync_fixed_memory_deterministic():
    # Llama-3-8B attention shapes (8 kv heads of 128) in bf16, 4 layers, a 256-token ring with 4 sinks that
    # wraps during the 300-token prefill. Two caches fed the same tokens must hold the same bits.
    cfg = tiny_config("llama", num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      hidden_size=4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    prefill = torch.randn(4, 8, 300, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    steps = torch.randn(20, 4, 8, 1, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    value_steps = steps + 1

    def fill(check):
        cache = RollingKVCache(cfg, batch_size=4, capacity=256, sink_tokens=4, dtype=torch.bfloat16,
                               device="cuda")  # "cuda", not "cuda:0": the cache must normalize it
        for layer in range(4):
            cache.update(prefill, prefill, layer)
        gc.collect()  # garbage of earlier tests freed now, not between the two readings
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        if check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            for step, value_step in zip(steps, value_steps, strict=True):
                for layer in range(4):
                    cache.update(step, value_step, layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.cuda.memory_allocated() == allocated
        return cache

    a, b = fill(True), fill(False)
    assert a.get_seq_length() == 320
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        assert torch.equal(la.positions, lb.positions)
    assert sorted(a.layers[0].positions.tolist()) == [0, 1, 2, 3] + list(range(320 - 252, 320))


def test_decode_loop_accessors_read_the_device_counters():
    """next_position is the layer's own counter (advanced in place: what a captured graph reads each replay);
    positions_after_append is the ring's positions once the next token lands, the ring itself unchanged."""
    cache = RollingKVCache(tiny_config("llama"), batch_size=1, capacity=4, sliding=True, dtype=torch.float32)
    layer = cache.layers[0]
    kv = torch.randn(1, layer.num_heads, 1, layer.head_dim)
    counter = layer.next_position
    assert layer.positions_after_append().tolist() == [0, -1, -1, -1] and layer.positions.tolist() == [-1] * 4
    for _ in range(5):  # past the ring: position 4 took slot 0
        cache.update(kv, kv, 0)
    assert layer.next_position is counter and counter.tolist() == [5]
    assert layer.positions.tolist() == [4, 1, 2, 3] and layer.positions_after_append().tolist() == [4, 5, 2, 3]
    lazy = RollingKVCache(tiny_config("llama"), batch_size=1, capacity=4)
    with pytest.raises(RuntimeError, match="RollingKVCache: next_position of layer 0 before its first update"):
        _ = lazy.layers[0].next_position
