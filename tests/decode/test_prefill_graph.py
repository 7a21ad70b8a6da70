"""Recorded prefills (tigon.decode.prefill_graph): a short unpadded prompt prefills through a CUDA graph kept with
the model, padded on the right to a multiple of `DecodeSettings.prefill_graph_bucket` tokens (8 here: the
interpreter runs a kernel program in ~1 ms; 64 by default, the GPU test).

On the CPU the graph is a stand-in (`_fake_capture`) whose replay runs the recorded function again with its
static inputs: the padding, the last real row, the cache kept between calls, the host counters and every rule of
when a recording is made, reused, refused or dropped are checked here; the GPU test replays a real graph.
"""

import copy

import pytest
import torch

import tigon
from tests.hf._tiny import tiny_model
from tigon.decode import DecodeSettings, kept, prefill_graph
from tigon.decode import loop as gen
from tigon.memory import RollingKVCache


def _pair(model_type="llama", **overrides):
    ref = tiny_model(model_type, attn_implementation="sdpa", **overrides).eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    return ref, patched


def _ids(b, t, seed=1):  # no id 0: model.generate would take it for padding (the pad id) and mask it
    return torch.randint(1, 131, (b, t), generator=torch.Generator().manual_seed(seed))


def _fake_capture(prefill, memory, stream):
    """A 'graph' whose replay runs the recorded function again into its static logits (what a CUDA graph does
    on the device, its Python included: the host counters the replay sets afterwards are checked)."""
    logits = prefill()
    static = torch.full_like(logits, float("nan"))

    class Replay:
        replays = 0

        def replay(self):
            Replay.replays += 1
            static.copy_(prefill())

    return Replay(), static


@pytest.fixture
def graphs(monkeypatch):
    """CPU stand-ins for the CUDA graphs of the prefill and of the decode step."""
    from tests.decode.test_generate import _fake_capture as fake_decode_capture

    monkeypatch.setattr(gen, "_graphs_available", lambda device: True)
    monkeypatch.setattr(gen, "_capture", fake_decode_capture)
    monkeypatch.setattr(prefill_graph, "_capture", _fake_capture)


SMALL = DecodeSettings(prefill_graph_bucket=8)


def _run(model, ids, new=2, settings=SMALL, **kw):
    return tigon.generate(model, ids, max_new_tokens=new, return_stats=True, settings=settings, **kw)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # Qwen3: the q/k norms on the last real row too
def test_recorded_then_replayed_prefills_match_hf(graphs, model_type):
    # 2 tokens: the prefill's, then a decode step that reads the cache the recording kept. Prompts 6 and 5 share
    # the 8-token bucket and the 8-slot ring: the second call replays the first one's graph with other ids and
    # another real length.
    ref, patched = _pair(model_type)
    for p, seed, how in ((6, 1, "recorded"), (5, 2, "replayed"), (6, 3, "replayed")):
        ids = _ids(2, p, seed)
        got, stats = _run(patched, ids)
        assert stats["prefill_graph"] == how
        assert torch.equal(got, ref.generate(ids, max_new_tokens=2, do_sample=False))
    assert tigon.decode.release(patched) == 1
    assert tigon.decode.release(patched) == 0


def test_a_replay_leaves_the_cache_of_an_unpadded_prefill(graphs):
    # After a replay the kept cache holds what a prefill of the real prompt writes: its keys and values in slots
    # < p (the padded rows' slots emptied: position -1), next position p on the device, seen p on the host.
    _, patched = _pair()
    _run(patched, _ids(1, 7, seed=4), new=1)  # records (bucket 8, ring 8), leaving positions in 7 slots
    ids = _ids(1, 6, seed=5)
    _, stats = _run(patched, ids, new=1)
    assert stats["prefill_graph"] == "replayed"
    (recording,) = kept.kept(patched).recordings.values()
    kept_cache = recording.cache
    assert not recording.busy
    ref = RollingKVCache(patched.config, batch_size=1, capacity=kept_cache.capacity)
    from tigon.hf.attention import restore_attention, use_tigon_attention

    use_tigon_attention(patched)
    with torch.no_grad():
        patched(input_ids=ids, past_key_values=ref, use_cache=True, logits_to_keep=1)
    restore_attention(patched)
    for got, want in zip(kept_cache.layers, ref.layers):
        assert got.seen == want.seen == 6
        assert torch.equal(got.positions, want.positions) and int(got._next) == 6
        torch.testing.assert_close(got.keys[:, :, :6], want.keys[:, :, :6], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.values[:, :, :6], want.values[:, :, :6], rtol=1e-5, atol=1e-5)


def test_new_weights_record_again_and_the_lru_keeps_the_limit(graphs):
    ref, patched = _pair()
    settings = DecodeSettings(prefill_graphs=1, prefill_graph_bucket=8)
    assert _run(patched, _ids(1, 5), settings=settings)[1]["prefill_graph"] == "recorded"
    assert _run(patched, _ids(1, 10), new=1, settings=settings)[1]["prefill_graph"] == "recorded"  # bucket 16
    assert len(kept.kept(patched).recordings) == 1  # the 8-token one is out
    assert _run(patched, _ids(1, 5), settings=settings)[1]["prefill_graph"] == "recorded"
    # a weight replaced (not copied into): the graph would read the old storage, so the call records again
    weight = patched.lm_head.weight
    patched.lm_head.weight = torch.nn.Parameter(weight.detach() * 2)
    ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach() * 2)
    ids = _ids(1, 5, seed=7)
    got, stats = _run(patched, ids, settings=settings)
    assert stats["prefill_graph"] == "recorded"
    assert torch.equal(got, ref.generate(ids, max_new_tokens=2, do_sample=False))


def test_the_fingerprint_sees_every_tensor_and_each_kind_of_move():
    """The one-walk fingerprint holds the place of every parameter and buffer (as parameters() and buffers() list
    them, shared ones once more), and changes with a parameter or buffer replaced, a module added, a dtype move."""
    _, model = _pair()
    layers = prefill_graph._decoder_layers(model)
    first = prefill_graph._fingerprint(model, layers)
    assert set(first[1]) == {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert first == prefill_graph._fingerprint(model, layers)
    rotary = model.model.rotary_emb
    moves = (lambda: setattr(model.model.norm, "weight", torch.nn.Parameter(model.model.norm.weight.detach() + 0)),
             lambda: rotary.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False),
             lambda: model.model.layers[0].add_module("extra", torch.nn.Linear(2, 2)),
             lambda: model.double())
    for move in moves:
        before = prefill_graph._fingerprint(model, layers)
        move()
        assert prefill_graph._fingerprint(model, layers) != before


def test_when_no_recording_is_made(graphs):
    ref, patched = _pair()
    ids = _ids(1, 5)
    want = ref.generate(ids, max_new_tokens=2, do_sample=False)
    for kw in (dict(settings=DecodeSettings(prefill_graphs=0)),  # off
               dict(settings=DecodeSettings(prefill_graph_tokens=7, prefill_graph_bucket=8)),  # padded: 8 tokens
               dict(attention_mask=torch.ones_like(ids)),  # a mask: the padded prompt path is for unmasked prompts
               dict(attention="hf"), dict(cuda_graph=False)):
        got, stats = _run(patched, ids, **kw)
        assert stats["prefill_graph"] is None and torch.equal(got, want), kw
    assert not kept.kept(patched).recordings
    # a recording in use by another call: this one prefills eagerly
    _run(patched, ids)
    (recording,) = kept.kept(patched).recordings.values()
    recording.busy = True
    got, stats = _run(patched, ids)
    assert stats["prefill_graph"] is None and torch.equal(got, want)


def test_a_model_without_the_fused_layer_step_is_refused_and_prefills_eagerly(graphs, monkeypatch):
    # Unpatched, the layers run HF's forward: the padded rows would reach a last layer that takes the last row by
    # shape, so the warm-up's result is dropped, the cache reset and the prompt prefilled eagerly; the shape is
    # then refused while the model stays as it is.
    ref, _ = _pair()
    model = copy.deepcopy(ref)
    for p in (5, 6):
        ids = _ids(1, p)
        got, stats = _run(model, ids)
        assert stats["prefill_graph"] is None
        assert torch.equal(got, ref.generate(ids, max_new_tokens=2, do_sample=False))
    pool = kept.kept(model)
    assert not pool.recordings and len(pool.refused) == 1
    tigon.patch(model)  # now every layer runs the fused step: the same shape records
    assert _run(model, _ids(1, 5))[1]["prefill_graph"] == "recorded"


def test_a_sliding_window_shorter_than_the_padded_prompt_prefills_eagerly(graphs):
    ref, patched = _pair("mistral", sliding_window=8)
    ids = _ids(1, 9)  # padded to 16 > the window
    got, stats = _run(patched, ids)
    assert stats["prefill_graph"] is None
    assert torch.equal(got, ref.generate(ids, max_new_tokens=2, do_sample=False))


@pytest.mark.parametrize("name", ["prefill_graphs", "prefill_graph_tokens", "prefill_graph_bucket"])
def test_settings_are_checked(name):
    for bad in (-1, 1.5, True) + ((0,) if name == "prefill_graph_bucket" else ()):
        with pytest.raises((ValueError, TypeError), match=f"DecodeSettings: {name}"):
            DecodeSettings(**{name: bad})


@pytest.mark.gpu
def test_gpu_replayed_prefill_matches_the_eager_one():
    # A real CUDA graph: a call records, the next (another prompt of the bucket) replays; greedy tokens equal the
    # eager prefill's (bf16 GEMMs over 64 rows instead of p may round differently: the tokens of a random tiny
    # model are far apart).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, patched = _pair()
    patched = patched.to("cuda", torch.bfloat16)
    off = DecodeSettings(prefill_graphs=0)
    for p, how in ((40, "recorded"), (33, "replayed"), (60, "replayed")):  # 64 slots: the call's 4 tokens fit
        ids = _ids(1, p, seed=p).cuda()
        got, stats = _run(patched, ids, new=4, settings=DecodeSettings())  # the default bucket, 64
        want, _ = _run(patched, ids, new=4, settings=off)
        assert stats["prefill_graph"] == how and torch.equal(got, want), p
    tigon.decode.release(patched)
