"""The fused decoder-layer decode step (tigon.decode.layer_step) inside tigon.generate and model.generate.

A patched model decodes with four `decode_linear` kernels per layer and step; the tokens must equal
Hugging Face's own generate on an unpatched copy (fp32, where the roundings agree), and anything the fused
step does not compute exactly (hooks, biases) must fall back to the module forward.
"""

import copy

import pytest
import torch

import tigon
from tests.hf._tiny import tiny_model
from tigon import ops
from tigon.memory import RollingKVCache

# head dims 16 and 32; Qwen3 with its per-head q/k norms between the projection and rope_kv_append
CASES = [("llama", {}), ("qwen3", {}), ("mistral", dict(sliding_window=8)), ("llama", dict(head_dim=32)),
         ("mistral", dict(sliding_window=8, head_dim=32)), ("qwen3", dict(head_dim=32))]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _calls(op):
    return ops.dispatch_counts[(op, "triton")] + ops.dispatch_counts[(op, "reference")]


def _fused_calls():
    """Projection launches: decode_linear's (4 a layer)."""
    return _calls("decode_linear")


def _pair(model_type, overrides, device):
    ref = tiny_model(model_type, attn_implementation="sdpa", **overrides).eval().to(device)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    return ref, patched


def _ids(b, t, device, seed=1):
    return torch.randint(0, 131, (b, t), generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type,overrides", CASES,
                         ids=[c[0] + ("-hd32" if c[1].get("head_dim") else "") for c in CASES])
def test_generate_uses_the_fused_layer_and_matches_hf(model_type, overrides, device):
    ref, patched = _pair(model_type, overrides, device)
    ids = _ids(2, 9, device)  # mistral: window 8 < 9, the prefill overflows the ring and every step wraps it
    # 2 decode steps: the second reads the K/V the first wrote and the ring position its attention kernel advanced
    # (on CPU a step of the 2 layers runs ~70 interpreted kernel programs, ~4 s).
    want = ref.generate(ids, max_new_tokens=3, do_sample=False)
    before, before_rope = _fused_calls(), _calls("rope_kv_append")
    got = tigon.generate(patched, ids, max_new_tokens=3, cuda_graph=False)
    layer_steps = patched.config.num_hidden_layers * 2
    assert _fused_calls() - before == 4 * layer_steps  # every layer of every decode step
    assert _calls("rope_kv_append") - before_rope >= layer_steps  # RoPE and the cache write after q/k/v
    assert torch.equal(got, want)


@pytest.mark.parametrize("b", [1, 2])
def test_the_norms_are_fused_below_separate_norm_rows_and_launched_from_it(monkeypatch, b):
    """One row: the RMSNorms run inside the q/k/v and gate/up projections; from SEPARATE_NORM_ROWS rows each runs
    as its own rms_norm_rows launch before a projection without one. The tokens equal HF's either way."""
    from tigon.decode import layer_step

    assert layer_step.SEPARATE_NORM_ROWS == 2  # the two cases below sit on either side of it
    ref, patched = _pair("llama", {}, "cpu")
    ids = _ids(b, 9, "cpu")
    want = ref.generate(ids, max_new_tokens=3, do_sample=False)
    rows, original = [], layer_step.rms_norm_rows

    def counting(x, *args, **kwargs):
        rows.append(x.shape[0])
        return original(x, *args, **kwargs)

    monkeypatch.setattr(layer_step, "rms_norm_rows", counting)
    got = tigon.generate(patched, ids, max_new_tokens=3, cuda_graph=False)
    assert torch.equal(got, want)
    # the prefill's norms see b * 9 rows, but for its last layer's second norm (the last position only: b rows)
    assert rows[:4] == [b * 9, b * 9, b * 9, b]
    decode_norms = rows[4:].count(b)
    assert decode_norms == (0 if b < 2 else 2 * patched.config.num_hidden_layers * 2)


def test_model_generate_with_a_rolling_cache_and_left_padding():
    ref, patched = _pair("llama", {}, "cpu")
    ids = _ids(3, 7, "cpu")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    from tigon.hf.attention import restore_attention, use_tigon_attention

    use_tigon_attention(patched)
    before = _fused_calls()
    cache = RollingKVCache(patched.config, batch_size=3, capacity=16)
    got = patched.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, past_key_values=cache)
    restore_attention(patched)
    assert _fused_calls() - before == 4 * 2 * 2
    assert torch.equal(got, want)


def test_hook_on_a_projection_falls_back_to_the_module_forward():
    ref, patched = _pair("llama", {}, "cpu")
    seen = []
    patched.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    ids = _ids(1, 5, "cpu")
    before = _fused_calls()
    got = tigon.generate(patched, ids, max_new_tokens=3)
    assert _fused_calls() - before == 4 * 2  # layer 0 only, the 2 decode steps
    assert len(seen) == 3  # the prefill and every decode step ran the hooked module
    assert torch.equal(got, ref.generate(ids, max_new_tokens=3, do_sample=False))


def test_biased_projections_fall_back():
    ref, patched = _pair("qwen2", {}, "cpu")  # Qwen2: q/k/v carry a bias
    ids = _ids(2, 6, "cpu")
    before = _fused_calls()
    got = tigon.generate(patched, ids, max_new_tokens=3)
    assert _fused_calls() == before
    assert torch.equal(got, ref.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_graph_decode_close_to_hf():
    # bf16: the fused kernels sum in another order than cuBLAS, so compare the first tokens and the logits.
    ref, patched = _pair("llama", {}, "cuda")
    ref, patched = ref.bfloat16(), patched.bfloat16()
    ids = _ids(2, 9, "cuda")
    want = ref.generate(ids, max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    got = tigon.generate(patched, ids, max_new_tokens=3)
    assert torch.equal(got[:, :10], want.sequences[:, :10])
    eager = tigon.generate(patched, ids, max_new_tokens=12, cuda_graph=False)
    graph = tigon.generate(patched, ids, max_new_tokens=12)
    assert torch.equal(eager, graph)


def _count_prefill(monkeypatch):
    from tigon.decode import layer_step

    ran = []
    original = layer_step.prefill_layer_step

    def counting(*args):
        out = original(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(layer_step, "prefill_layer_step", counting)
    return ran


@pytest.mark.parametrize("model_type,overrides", CASES, ids=[c[0] for c in CASES])
def test_direct_prefill_runs_for_a_first_unpadded_chunk(monkeypatch, model_type, overrides):
    ref, patched = _pair(model_type, overrides, "cpu")
    ids = _ids(2, 7, "cpu")  # 7 < mistral's window 8: the direct prefill applies to every family here
    ran = _count_prefill(monkeypatch)
    got = tigon.generate(patched, ids, max_new_tokens=2)  # the prefill's token, and one decode step that reads it
    assert ran == [True] * patched.config.num_hidden_layers
    assert torch.equal(got, ref.generate(ids, max_new_tokens=2, do_sample=False))


@pytest.mark.parametrize("model_type,overrides", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_last_position_only_prefill_computes_the_last_row_of_the_last_layer(monkeypatch, model_type, overrides):
    # RollingKVCache.last_position_only: the last layer computes q, attention, o_proj and the MLP for the last
    # position only. Its logits equal the full prefill's last row up to fp32 summation order (the GEMMs see 1 row
    # instead of t: hidden 64, intermediate 96, two layers, so a few hundred roundings of 2**-24 relative, far below
    # 1e-4), every layer's cache holds the same keys and values, and the model's output has one position.
    from tigon.hf.attention import use_tigon_attention

    _, patched = _pair(model_type, overrides, "cpu")
    use_tigon_attention(patched)  # as tigon.generate switches it for its call
    ids = _ids(2, 7, "cpu")
    ran = _count_prefill(monkeypatch)
    outs, caches = [], []
    for last_only in (False, True):
        cache = RollingKVCache(patched.config, batch_size=2, capacity=12)
        cache.last_position_only = last_only
        with torch.no_grad():
            outs.append(patched(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits)
        caches.append(cache)
    assert ran == [True] * (2 * patched.config.num_hidden_layers)
    assert outs[0].shape == outs[1].shape == (2, 1, patched.config.vocab_size)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for full, last in zip(caches[0].layers, caches[1].layers):
        assert full.seen == last.seen == 7
        assert torch.equal(full.keys[:, :, :7], last.keys[:, :, :7])
        assert torch.equal(full.values[:, :, :7], last.values[:, :, :7])
    with torch.no_grad():  # the whole hidden sequence without the setting
        full = patched.model(input_ids=ids, past_key_values=RollingKVCache(patched.config, batch_size=2, capacity=12),
                             use_cache=True).last_hidden_state
        cache = RollingKVCache(patched.config, batch_size=2, capacity=12)
        cache.last_position_only = True
        last = patched.model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state
    assert full.shape == (2, 7, 64) and last.shape == (2, 1, 64)
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-4, atol=1e-4)


def test_generate_prefills_the_last_layer_for_the_last_position_and_clears_the_setting(monkeypatch):
    from tigon.decode import layer_step

    ref, patched = _pair("llama", {}, "cpu")
    shapes, caches = [], []
    original = layer_step.prefill_layer_step

    def recording(layer, hidden, mask, cache, pos):
        out = original(layer, hidden, mask, cache, pos)
        shapes.append(tuple(out.shape))
        caches.append(cache)
        return out

    monkeypatch.setattr(layer_step, "prefill_layer_step", recording)
    ids = _ids(2, 7, "cpu")
    got = tigon.generate(patched, ids, max_new_tokens=2)
    assert shapes == [(2, 7, 64), (2, 1, 64)]
    assert caches[0].last_position_only is False  # set back after the prefill
    assert torch.equal(got, ref.generate(ids, max_new_tokens=2, do_sample=False))


def test_model_generate_prefills_the_last_position_only_unless_hidden_states_are_asked(monkeypatch):
    # HF's generate keeps one logits row (logits_to_keep=1): tigon's CausalLM forward tells the RollingKVCache, so
    # the fused prefill's last layer computes the last position only. Asked for hidden states, the whole sequence
    # goes through, and the prefill's hidden states equal the unpatched model's.
    from tigon.decode import layer_step
    from tigon.hf.attention import restore_attention, use_tigon_attention

    ref, patched = _pair("llama", {}, "cpu")
    ids = _ids(2, 7, "cpu")
    shapes, original = [], layer_step.prefill_layer_step

    def recording(*args):
        out = original(*args)
        shapes.append(None if out is None else tuple(out.shape))
        return out

    monkeypatch.setattr(layer_step, "prefill_layer_step", recording)
    kw = dict(max_new_tokens=3, do_sample=False)
    want = ref.generate(ids, **kw, output_hidden_states=True, return_dict_in_generate=True)
    use_tigon_attention(patched)
    try:
        cache = RollingKVCache(patched.config, batch_size=2, capacity=16)
        got = patched.generate(ids, **kw, past_key_values=cache)
        assert shapes == [(2, 7, 64), (2, 1, 64)] and cache.last_position_only is False
        shapes.clear()
        cache = RollingKVCache(patched.config, batch_size=2, capacity=16)
        full = patched.generate(ids, **kw, past_key_values=cache, output_hidden_states=True,
                                return_dict_in_generate=True)
        assert len(shapes) == 2 and (2, 1, 64) not in shapes  # (the direct prefill or the module forward)
    finally:
        restore_attention(patched)
    assert torch.equal(got, want.sequences) and torch.equal(full.sequences, want.sequences)
    for mine, theirs in zip(full.hidden_states[0], want.hidden_states[0]):  # the prefill's, every layer
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_direct_prefill_declines_padding_and_a_prompt_past_the_window(monkeypatch):
    ref, patched = _pair("mistral", dict(sliding_window=8), "cpu")
    ran = _count_prefill(monkeypatch)
    ids = _ids(2, 11, "cpu")  # 11 > window 8
    assert torch.equal(tigon.generate(patched, ids, max_new_tokens=2), ref.generate(ids, max_new_tokens=2,
                                                                                    do_sample=False))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    assert torch.equal(tigon.generate(patched, ids[:, :7], max_new_tokens=2, attention_mask=mask[:, :7]),
                       ref.generate(ids[:, :7], max_new_tokens=2, do_sample=False, attention_mask=mask[:, :7]))
    assert not any(ran)


def test_the_step_is_installed_by_patch_and_held_by_generate():
    # tigon.patch(model) puts the step on the instance's layers (HF's generate reaches it); tigon.unpatch takes it
    # away; tigon.generate holds it for its call, also on a class-level patched model, and leaves nothing behind.
    from tigon.decode import layer_step

    ref, patched = _pair("llama", {}, "cpu")
    layers = patched.model.layers
    assert all(layer.__dict__[layer_step.LAYER_STEP] is layer_step.layer_step for layer in layers)
    with layer_step.fused_decode(patched) as installed:
        assert installed == 0  # patch put it there: generate neither walks the modules nor takes it off
    assert all(layer_step.LAYER_STEP in layer.__dict__ for layer in layers)
    tigon.unpatch(patched)
    assert not any(layer_step.LAYER_STEP in m.__dict__ for m in patched.modules())
    ids = _ids(1, 5, "cpu")
    tigon.patch(model_type="llama")
    try:
        model = tiny_model("llama", attn_implementation="sdpa").eval()
        model.load_state_dict(ref.state_dict())
        model.generation_config.eos_token_id = None
        before = _fused_calls()
        got = tigon.generate(model, ids, max_new_tokens=3)
        assert _fused_calls() - before == 4 * 2 * 2
        assert not any(layer_step.LAYER_STEP in m.__dict__ for m in model.modules())
        before = _fused_calls()
        off = tigon.generate(model, ids, max_new_tokens=3, settings=tigon.DecodeSettings(fused_layers=False))
        assert _fused_calls() == before and torch.equal(got, off)
    finally:
        tigon.unpatch(model_type="llama")
    assert torch.equal(got, ref.generate(ids, max_new_tokens=3, do_sample=False))


def test_the_direct_prefill_checks_the_rotary_tables_it_writes_with():
    # prefill_rope skips rope_kv_append's checks, so the layer step declines (the module forward runs) unless
    # cos/sin are [1 or b, t, rd], rd even and <= head_dim, floating, on the hidden states' device.
    from tigon.decode.layer_step import _rotary_ok

    cos = torch.zeros(1, 7, 16)
    assert _rotary_ok((cos, cos), 2, 7, 16, cos.device)
    assert _rotary_ok((torch.zeros(2, 7, 8),) * 2, 2, 7, 16, cos.device)
    shapes = [(3, 7, 16), (1, 6, 16), (1, 7, 18), (1, 7, 5)]  # batch, tokens, rd > head_dim, odd rd
    bad_tables = [(torch.zeros(shape),) * 2 for shape in shapes] + [(torch.zeros(1, 7, 16, dtype=torch.int64),) * 2]
    for bad in bad_tables + [(cos,), (cos, torch.zeros(1, 7, 14)), (cos, cos.double()), None]:
        assert not _rotary_ok(bad, 2, 7, 16, cos.device), bad
    assert not _rotary_ok((cos, cos), 2, 7, 16, torch.device("meta"))
