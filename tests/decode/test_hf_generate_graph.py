"""HF's own `model.generate` with the CUDA-graph decode step (tigon.decode.hf_graph, tigon.patch(cuda_graph=True)).

On the CPU the capture is a test double (`EagerGraphs`: the "replay" runs the captured step again, eagerly,
over the same static buffers), so what is tested here is the selection logic and the bookkeeping a real replay
depends on: which step warms up, which captures, which replays, the static inputs (token, mask, position),
the cache's host counters, the fallbacks and their log line, and the install/uninstall record. The real
CUDA graph is tested by the GPU tests at the end (tokens against HF's eager generate and tigon.generate).
"""

import copy
import logging

import pytest
import torch

import tigon
from tests.hf._tiny import tiny_model
from tigon.decode import hf_graph
from tigon.memory import RollingKVCache

V = 131


class EagerGraphs:
    """CudaGraphs' interface on any device: warm runs the step, capture records it (without running it, as a
    CUDA capture), replay runs it again over the static inputs and writes the "graph output" in place."""

    def __init__(self, fail=None):
        self.fail, self.captures, self.replays = fail, 0, 0

    def available(self, device):
        return True

    def warm(self, fn):
        out = fn()
        self.template = out.logits
        return out

    def capture(self, fn):
        if self.fail is not None:
            raise self.fail
        self.captures += 1
        static = torch.empty_like(self.template)

        def replay():
            self.replays += 1
            static.copy_(fn())

        return replay, static


def _model(**overrides):
    model = tiny_model("llama", attn_implementation="sdpa", **overrides).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def pair():
    """(an unpatched reference, the same weights patched with the "tigon" attention)."""
    ref = _model()
    patched = copy.deepcopy(ref)
    tigon.patch(patched, attention=True)
    return ref, patched


@pytest.fixture
def graphed(pair):
    """The patched model with the graph step on EagerGraphs; taken off again after the test."""
    ref, model = pair
    graphs = EagerGraphs()
    hf_graph.install(model, graphs=graphs)
    yield ref, model, graphs
    hf_graph.uninstall(model)


def _ids(b, t, seed=1):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, new, mask=None, **kw):
    cache = RollingKVCache(model.config, batch_size=ids.shape[0], capacity=ids.shape[1] + new)
    kw.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new, past_key_values=cache, **kw)


@pytest.mark.parametrize("b,padded", [(1, False), (3, True)])
def test_greedy_tokens_equal_hf_generate(graphed, b, padded):
    ref, model, graphs = graphed
    ids = _ids(b, 5)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        mask[2, :1] = 0
    got = _generate(model, ids, 5, mask)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    # 4 decode steps: the warm-up, the capture (its step runs eagerly first), 2 replays
    assert hf_graph.graph_stats(model) == dict(captures=1, replays=2, eager_steps=0, last_fallback="")
    assert (graphs.captures, graphs.replays) == (1, 2)


def test_one_capture_per_generate_call_never_at_prefill(pair):
    _, model = pair
    events = []
    graphs = EagerGraphs()
    hf_graph.install(model, graphs=graphs, on_capture=lambda: events.append(graphs.replays))
    try:
        ids = _ids(1, 3)
        _generate(model, ids, 2)  # the prefill and one decode step: the warm-up only
        assert hf_graph.graph_stats(model)["captures"] == 0
        _generate(model, ids, 3)  # the warm-up and the capture
        assert (hf_graph.graph_stats(model)["captures"], graphs.replays) == (1, 0)
        _generate(model, ids, 4)  # a new call: a new warm-up, capture, and one replay
        assert (hf_graph.graph_stats(model)["captures"], graphs.replays) == (2, 1)
        assert events == [0, 0]  # on_capture after each capture, before its first replay
    finally:
        hf_graph.uninstall(model)


def test_sampling_with_a_seed_and_repetition_penalty_equal_the_eager_steps(pair):
    _, model = pair
    ids = _ids(2, 4, seed=3)
    kw = dict(do_sample=True, top_k=20, temperature=0.8, repetition_penalty=1.5)
    torch.manual_seed(7)
    want = _generate(model, ids, 5, **kw)  # the same model without the graph step
    hf_graph.install(model, graphs=EagerGraphs())
    try:
        torch.manual_seed(7)
        got = _generate(model, ids, 5, **kw)
        assert hf_graph.graph_stats(model)["replays"] == 2
    finally:
        hf_graph.uninstall(model)
    assert torch.equal(got, want)


def test_eos_and_repetition_penalty_stop_like_hf(graphed):
    ref, model, _ = graphed
    ids = _ids(2, 4, seed=4)
    free = ref.generate(ids, max_new_tokens=8, do_sample=False, repetition_penalty=1.3)
    eos = int(free[0, 4 + 4])  # row 0 emits it at its 5th new token
    kw = dict(repetition_penalty=1.3, eos_token_id=eos, pad_token_id=0)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, **kw)
    got = _generate(model, ids, 8, **kw)
    assert torch.equal(got, want)
    assert hf_graph.graph_stats(model)["replays"] >= 1


@torch.no_grad()
def test_the_returned_logits_are_the_callers(graphed):
    # A manual decode loop (the forward called directly): each step's logits stay as they were after later
    # replays, and equal the eager forward's over a second cache.
    ref, model, _ = graphed
    ids = _ids(1, 4)
    from transformers import DynamicCache

    cache, ref_cache = RollingKVCache(model.config, batch_size=1, capacity=10), DynamicCache(config=ref.config)
    tok = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    ref(ids, past_key_values=ref_cache)
    kept = []
    for _ in range(4):
        out = model(input_ids=tok, past_key_values=cache, logits_to_keep=1)
        want = ref(input_ids=tok, past_key_values=ref_cache).logits
        torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
        assert out.past_key_values is cache
        kept.append((out.logits, out.logits.clone()))
        tok = out.logits.argmax(-1)
    assert hf_graph.graph_stats(model)["replays"] == 2
    assert all(torch.equal(a, b) for a, b in kept)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 8  # the replays counted on the host


@torch.no_grad()
def test_a_new_layout_warms_up_and_captures_again(graphed):
    _, model, graphs = graphed
    cache = RollingKVCache(model.config, batch_size=1, capacity=12)
    tok = model(_ids(1, 3), past_key_values=cache).logits[:, -1:].argmax(-1)
    for step in range(6):
        kw = {} if step < 3 else dict(position_ids=torch.tensor([[cache.get_seq_length()]]))
        tok = model(input_ids=tok, past_key_values=cache, **kw).logits.argmax(-1)
    # steps 0-2: warm-up, capture, replay; position_ids from step 3 on: warm-up, capture, replay again
    assert (graphs.captures, graphs.replays) == (2, 2)


def test_tigon_generate_passes_by_the_graph_step(graphed):
    # tigon.generate captures its own graph: the HF graph step lets its calls through untouched.
    ref, model, graphs = graphed
    ids = _ids(1, 4)
    got = tigon.generate(model, ids, max_new_tokens=4, cuda_graph=False)
    assert hf_graph.graph_stats(model) == dict(captures=0, replays=0, eager_steps=0, last_fallback="")
    assert graphs.captures == 0 and hf_graph.GraphForward(model).state.paused == 0
    assert torch.equal(got, ref.generate(ids, max_new_tokens=4, do_sample=False))


def test_dynamic_cache_runs_eagerly_with_one_log_line(graphed, caplog):
    ref, model, _ = graphed
    ids = _ids(1, 4)
    with caplog.at_level(logging.WARNING, logger="tigon"):
        got = model.generate(ids, max_new_tokens=4, do_sample=False)  # HF's DynamicCache
    # the graph step's lines only: on a CUDA machine these CPU tensors also log that the kernels are off for them
    lines = [r.getMessage() for r in caplog.records if r.name == "tigon" and "cuda_graph" in r.getMessage()]
    assert lines == ["tigon cuda_graph: decode steps run eagerly: past_key_values is DynamicCache, not a "
                     "tigon.memory.RollingKVCache"]
    stats = hf_graph.graph_stats(model)
    assert (stats["captures"], stats["eager_steps"]) == (0, 3)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=4, do_sample=False))


def test_a_hook_keeps_the_steps_eager_and_runs_every_step(graphed):
    ref, model, _ = graphed
    calls = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        ids = _ids(1, 4)
        got = _generate(model, ids, 4)
    finally:
        handle.remove()
    stats = hf_graph.graph_stats(model)
    assert stats["captures"] == 0 and stats["last_fallback"] == "model.layers.1.mlp has a forward hook"
    assert len(calls) == 4  # the prefill and the three decode steps
    assert torch.equal(got, ref.generate(ids, max_new_tokens=4, do_sample=False))


def test_a_failed_capture_falls_back_to_eager_steps(pair, caplog):
    ref, model = pair
    hf_graph.install(model, graphs=EagerGraphs(fail=RuntimeError("operation not permitted when stream is "
                                                                 "capturing\nmore")))
    try:
        ids = _ids(2, 4)
        with caplog.at_level(logging.WARNING, logger="tigon"):
            got = _generate(model, ids, 5)
        stats = hf_graph.graph_stats(model)
    finally:
        hf_graph.uninstall(model)
    assert torch.equal(got, ref.generate(ids, max_new_tokens=5, do_sample=False))
    why = "the capture failed (RuntimeError: operation not permitted when stream is capturing)"
    assert stats == dict(captures=0, replays=0, eager_steps=3, last_fallback=why)  # the 2 steps after the capture
    # (the graph step's lines only: on a GPU machine the process's one "kernels are off for cpu tensors" note may
    # land in whichever test first runs a CPU op)
    assert [r.getMessage() for r in caplog.records if r.name == "tigon" and "cuda_graph" in r.getMessage()] == [
        f"tigon cuda_graph: decode steps run eagerly: {why}"]


def _step_kwargs(model, **kw):
    cache = RollingKVCache(model.config, batch_size=1, capacity=8, dtype=torch.float32, device="cpu")
    return dict(dict(input_ids=torch.zeros((1, 1), dtype=torch.int64), past_key_values=cache, use_cache=True,
                     return_dict=True, logits_to_keep=1), **kw)


@pytest.mark.parametrize("change,why", [
    (dict(output_attentions=True), "output_attentions=True"),
    (dict(output_hidden_states=True), "output_hidden_states=True"),
    (dict(return_dict=False), "return_dict=False or use_cache=False"),
    (dict(inputs_embeds=torch.zeros(1, 1, 64)), "the forward is called with inputs_embeds"),
    (dict(labels=torch.zeros((1, 1), dtype=torch.int64)), "the forward is called with labels"),
    (dict(attention_mask=torch.ones((1, 5), dtype=torch.int64)), "the attention mask is not 4-D"),
    (dict(past_key_values=None), "past_key_values is not given, not a tigon.memory.RollingKVCache"),
])
def test_what_is_not_graphable(pair, change, why):
    _, model = pair
    with torch.no_grad():  # as generate runs
        assert hf_graph._not_graphable(model, _step_kwargs(model), EagerGraphs()) == ""
        assert hf_graph._not_graphable(model, _step_kwargs(model, **change), EagerGraphs()).startswith(why)


@torch.no_grad()
def test_not_graphable_model_states(pair):
    _, model = pair
    kw = _step_kwargs(model)
    assert "CUDA graphs need a CUDA device" in hf_graph._not_graphable(model, kw, hf_graph.CudaGraphs())
    with torch.enable_grad():
        assert hf_graph._not_graphable(model, kw, EagerGraphs()) == "autograd or training mode is on"
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert hf_graph._not_graphable(model, kw, EagerGraphs()) == "a global module forward hook is registered"
    finally:
        handle.remove()
    plain = _model()
    tigon.patch(plain, attention=False)
    assert "\"tigon\" attention" in hf_graph._not_graphable(plain, _step_kwargs(plain), EagerGraphs())


def test_patch_arguments():
    model = _model()
    with pytest.raises(TypeError, match="tigon.patch: cuda_graph must be True or False, got str 'yes'"):
        tigon.patch(model, cuda_graph="yes")
    with pytest.raises(ValueError, match="cuda_graph=True puts the CUDA-graph decode step on a model instance"):
        tigon.patch(model_type="llama", cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph=True needs the \"tigon\" attention"):
        tigon.patch(model, cuda_graph=True, attention=False)
    assert "forward" not in model.__dict__  # refused before anything changed
    with pytest.raises(TypeError, match="on_capture must be a callable or None"):
        hf_graph.install(model, on_capture=3)
    with pytest.raises(TypeError, match=r"graphs \(object\) has no available, warm, capture method"):
        hf_graph.install(model, graphs=object())
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        hf_graph.install("llama")
    assert hf_graph.graph_stats(model) is None and not hf_graph.installed(model) and not hf_graph.installed(3)


def test_patch_installs_and_unpatch_restores():
    import inspect

    model = _model()
    report = tigon.patch(model, cuda_graph=True)
    assert model.config._attn_implementation == "tigon"  # "auto" became True
    forward = model.__dict__["forward"]
    assert isinstance(forward, hf_graph.GraphForward)
    fused = forward.state.previous
    assert "logits_to_keep" in inspect.signature(model.forward).parameters  # generate() reads it
    tigon.patch(model)  # again: the graph step stays outermost, over the same HF-patched forward
    assert isinstance(model.__dict__["forward"], hf_graph.GraphForward)
    assert model.__dict__["forward"].state.previous.__func__ is fused.__func__
    assert report.model_type == "llama"
    clone = copy.deepcopy(model)  # the copy gets its own graph step, without the original's graph or counts
    assert clone.__dict__["forward"].__self__ is clone and hf_graph.graph_stats(clone)["captures"] == 0
    tigon.unpatch(model)
    assert not {"forward", hf_graph.STATE, "_valid_auto_compile_criteria"} & set(model.__dict__)
    assert model.config._attn_implementation == "sdpa"


def test_hf_auto_compile_is_off_for_a_rolling_cache_only(pair, monkeypatch):
    from transformers import GenerationConfig, StaticCache

    _, model = pair
    monkeypatch.setattr(type(model), "_valid_auto_compile_criteria", lambda self, kw, config: True)
    hf_graph.install(model, graphs=EagerGraphs())
    try:
        ring = RollingKVCache(model.config, batch_size=1, capacity=8)
        static = StaticCache(config=model.config, max_cache_len=8)
        assert model._valid_auto_compile_criteria({"past_key_values": ring}, GenerationConfig()) is False
        assert model._valid_auto_compile_criteria({"past_key_values": static}, GenerationConfig()) is True
    finally:
        hf_graph.uninstall(model)
    assert model._valid_auto_compile_criteria({"past_key_values": ring}, GenerationConfig()) is True


# GPU: the real CUDA graph. Each model is compared with itself without the graph step (HF's eager generate:
# disable_compile=True, or HF would compile the decode step itself on CUDA) and with tigon.generate.

def _gpu_model(model_type, dtype):
    model = tiny_model(model_type, attn_implementation="sdpa").eval().to("cuda", dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    tigon.patch(model, cuda_graph=True)
    return model


def _gpu_ids(b, t, seed=0):
    # No id 0: generate would read it as padding (pad_token_id=0) and mask it, tigon.generate would not.
    return torch.randint(1, V, (b, t), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


def _both(model, ids, new, mask=None, seed=None, **kw):
    """(with the graph, eager, the graph run's graph_stats): HF's generate over a fresh RollingKVCache each."""
    if seed is not None:
        torch.manual_seed(seed)
    graph = _generate(model, ids, new, mask, disable_compile=True, **kw)
    stats = hf_graph.graph_stats(model)
    hf_graph.uninstall(model)
    if seed is not None:
        torch.manual_seed(seed)
    eager = _generate(model, ids, new, mask, disable_compile=True, **kw)
    hf_graph.install(model)
    return graph, eager, stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_gpu_greedy_equals_eager_and_tigon_generate(model_type, dtype):
    model = _gpu_model(model_type, dtype)
    ids = _gpu_ids(1, 12)
    graph, eager, stats = _both(model, ids, 24)
    assert (stats["captures"], stats["replays"], stats["eager_steps"]) == (1, 21, 0), stats
    assert torch.equal(graph, eager)
    assert torch.equal(graph, tigon.generate(model, ids, max_new_tokens=24))  # passes by the graph step
    assert hf_graph.graph_stats(model)["captures"] == 0
    for _ in range(2):
        assert torch.equal(_generate(model, ids, 24, disable_compile=True), graph)
    assert hf_graph.graph_stats(model)["captures"] == 2  # one per generate call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("b", [1, 3])
def test_gpu_left_padding(b):
    model = _gpu_model("llama", torch.bfloat16)
    ids = _gpu_ids(b, 10, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    graph, eager, stats = _both(model, ids, 20, mask)
    assert (stats["captures"], stats["replays"]) == (1, 17)
    assert torch.equal(graph, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sampling_processors_and_stopping():
    model = _gpu_model("qwen3", torch.bfloat16)
    ids = _gpu_ids(3, 8, seed=2)
    kw = dict(do_sample=True, top_k=30, top_p=0.9, temperature=0.9, repetition_penalty=1.4)
    graph, eager, stats = _both(model, ids, 30, seed=11, **kw)
    assert torch.equal(graph, eager) and stats["replays"] == 27
    eos = int(graph[1, 8 + 6])
    graph, eager, stats = _both(model, ids, 30, seed=11, eos_token_id=eos, **kw)
    assert torch.equal(graph, eager) and stats["captures"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_hf_auto_compile_does_not_wrap_the_graph():
    # Without disable_compile HF would compile the decode forward for a compileable cache; the graph step
    # takes that over for a RollingKVCache.
    model = _gpu_model("llama", torch.bfloat16)
    ids = _gpu_ids(2, 8)
    got = _generate(model, ids, 12)
    assert hf_graph.graph_stats(model)["captures"] == 1 and not hasattr(model, "_compiled_call")
    assert torch.equal(got, _both(model, ids, 12)[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_replayed_steps_do_not_sync(monkeypatch):
    # A replayed step (the checks, the input copies, the replay, the logits copy) never waits for the device.
    model = _gpu_model("llama", torch.bfloat16)
    call = hf_graph.GraphForward.__call__

    def checked(self, *args, **kwargs):
        if self.state.replay is None:  # the capture synchronizes (torch.cuda.graph does)
            return call(self, *args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return call(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(hf_graph.GraphForward, "__call__", checked)
    _generate(model, _gpu_ids(2, 8), 8, disable_compile=True)
    assert hf_graph.graph_stats(model)["replays"] == 5
