"""What tigon.generate keeps with a model between calls (tigon.decode.kept): the last call's cache, taken back
emptied by the next call of the same shape; `tigon.decode.release` drops it."""

import copy

import torch

import tigon
from tests.hf._tiny import tiny_model
from tigon.decode import DecodeSettings, kept


def _pair():
    ref = tiny_model("llama", attn_implementation="sdpa").eval()
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    return ref, patched


def _ids(b, t, seed):  # no id 0: model.generate would take it for padding
    return torch.randint(1, 131, (b, t), generator=torch.Generator().manual_seed(seed))


def test_the_next_call_of_a_shape_reuses_the_last_cache_emptied():
    ref, patched = _pair()
    caches = []
    # 9 + 2 and 8 + 3 tokens: one ring of 11 slots, so the second call takes the first one's cache; then another
    # shape (a new cache, the kept one dropped) and a left-padded batch over the kept ring
    cases = [(_ids(2, 9, 1), 2, None), (_ids(2, 8, 2), 3, None), (_ids(2, 5, 3), 2, None)]
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    cases.append((_ids(2, 5, 4), 2, mask))
    for ids, new, mask in cases:
        got = tigon.generate(patched, ids, max_new_tokens=new, attention_mask=mask)
        assert torch.equal(got, ref.generate(ids, max_new_tokens=new, do_sample=False, attention_mask=mask))
        caches.append(kept.kept(patched).cache[1])
    assert caches[0] is caches[1] and caches[2] is not caches[1] and caches[3] is caches[2]
    assert all(layer.seen == 6 for layer in caches[3].layers)  # the prompt and one decode step
    assert tigon.decode.release(patched) == 1 and kept._KEPT not in patched.__dict__


def test_clear_empties_the_cache_by_its_counters():
    _, patched = _pair()
    tigon.generate(patched, _ids(1, 6, 5), max_new_tokens=2)
    cache = kept.kept(patched).cache[1]
    assert int(cache.layers[0]._next) == 7 and cache.layers[0].seen == 7
    cache.clear()
    for layer in cache.layers:
        assert layer.seen == 0 and int(layer._next) == 0 and bool((layer.positions == -1).all())


def test_hf_attention_gets_a_fresh_zeroed_cache():
    # HF's attention over the whole ring multiplies masked slots by 0: those rings start zeroed, not kept
    ref, patched = _pair()
    ids = _ids(1, 6, 6)
    got = tigon.generate(patched, ids, max_new_tokens=2, attention="hf")
    assert torch.equal(got, ref.generate(ids, max_new_tokens=2, do_sample=False))
    assert kept._KEPT not in patched.__dict__ or kept.kept(patched).cache is None


def test_a_copy_or_pickle_of_the_model_keeps_nothing(monkeypatch):
    # TRL deep-copies a policy into its reference model: the copy gets neither the kept cache nor a recording's
    # CUDA graph (which would not copy or pickle).
    import pickle

    from tests.decode.test_prefill_graph import _fake_capture
    from tigon.decode import loop as gen
    from tigon.decode import prefill_graph

    _, patched = _pair()
    tigon.generate(patched, _ids(1, 5, 7), max_new_tokens=2)
    assert kept.kept(patched).cache is not None
    monkeypatch.setattr(gen, "_graphs_available", lambda device: True)
    monkeypatch.setattr(prefill_graph, "_capture", _fake_capture)
    tigon.generate(patched, _ids(1, 5, 7), max_new_tokens=1, settings=DecodeSettings(prefill_graph_bucket=8))
    assert kept.kept(patched).recordings

    class Unpicklable:  # what a torch.cuda.CUDAGraph is to pickle
        def __reduce__(self):
            raise TypeError("cannot pickle a graph")

    next(iter(kept.kept(patched).recordings.values())).graph = Unpicklable()
    twin = copy.deepcopy(patched)
    state = kept.kept(twin)
    assert state.cache is None and not state.recordings and not state.rotary
    loaded = pickle.loads(pickle.dumps(kept.kept(patched)))  # (transformers' models themselves do not pickle)
    assert loaded.cache is None and not loaded.recordings
