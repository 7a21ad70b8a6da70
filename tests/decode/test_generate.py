"""tigon.generate (tigon.decode.loop) against Hugging Face `model.generate` on tiny random-init models (CPU, fp32)."""

import dataclasses

import pytest
import torch

from tests.hf._tiny import tiny_model
from tigon.decode import DecodeSettings, sampling
from tigon.decode import loop as gen
from tigon.decode.request import GenerationRequest
from tigon.decode.stats import TTFT_PHASES

# Tests of the loop itself (EOS, sampling) pass attention=HF: the same loop without the interpreter's cost of
# the "tigon" decode kernels, which the attention tests below cover.
HF = "hf"


def _ids(b, t, seed=1):
    return torch.randint(0, 131, (b, t), generator=torch.Generator().manual_seed(seed))


def _model(model_type, attn="sdpa"):
    model = tiny_model(model_type, attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None  # no EOS unless a test asks: compare all max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def _hf(model, ids, new, **kw):
    return model.generate(ids, max_new_tokens=new, do_sample=False, **kw)


# Cost: on CPU every decode step of the tigon attention runs its Triton kernels through the interpreter (~1 s a
# step for the 2 layers at batch 2), so the tests below decode only as many steps as their case needs. The batch-2
# greedy comparison with model.generate of each family (Llama, Qwen3, Mistral's wrapping window, Gemma-2's rolling
# local ring) is in test_tigon_attention_matches_hf_attention; here the batch of one.
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_greedy_matches_hf(model_type):
    model = _model(model_type)
    ids = _ids(1, 6)
    ref = _hf(model, ids, 6)
    got = gen.generate(model, ids, max_new_tokens=6)
    assert got.shape == ref.shape == (1, 12) and got.dtype == torch.int64
    assert torch.equal(got, ref)


def test_greedy_left_padding_and_eager_attention_match_hf():
    model = _model("llama", attn="eager")
    ids = _ids(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert torch.equal(gen.generate(model, ids, max_new_tokens=5, attention_mask=mask),
                       _hf(model, ids, 5, attention_mask=mask))


def test_single_new_token_and_larger_capacity():
    model = _model("llama")
    ids = _ids(2, 5)
    assert torch.equal(gen.generate(model, ids, max_new_tokens=1), _hf(model, ids, 1))
    assert torch.equal(gen.generate(model, ids, max_new_tokens=4, capacity=30), _hf(model, ids, 4))


def test_eos_stops_a_row_and_pads_it():
    model = _model("llama")
    ids = _ids(2, 6, seed=4)
    greedy = gen.generate(model, ids, max_new_tokens=12, attention=HF)
    eos = int(greedy[0, 6 + 3])  # row 0 emits it at step 3
    first = [int((row[6:] == eos).nonzero()[0]) if (row[6:] == eos).any() else None for row in greedy]
    assert first[0] == 3
    got = gen.generate(model, ids, max_new_tokens=12, eos_token_id=eos, pad_token_id=127, attention=HF)
    ref = _hf(model, ids, 12, eos_token_id=eos, pad_token_id=127)
    assert torch.equal(got, ref)
    assert torch.equal(got[0, :10], greedy[0, :10]) and bool((got[0, 10:] == 127).all())
    if first[1] is None:  # row 1 never stops: the full length, row 1 as greedy
        assert torch.equal(got[1], greedy[1])
    # Both rows stopped: trimmed to the longest row, like model.generate. Without a pad id (argument or
    # generation_config) the first EOS id pads.
    model.generation_config.pad_token_id = None
    both = gen.generate(model, ids, max_new_tokens=12, eos_token_id=[eos, int(greedy[1, 6 + 1])], attention=HF)
    assert both.shape == (2, 6 + 4) and int(both[1, -1]) == eos  # row 1 stopped at step 1, padded with eos


def test_eos_checked_on_host_every_n_steps():
    model = _model("llama")
    ids = _ids(1, 6, seed=4)
    greedy = gen.generate(model, ids, max_new_tokens=20, attention=HF)
    eos = int(greedy[0, 6 + 3])
    seqs, stats = gen.generate(model, ids, max_new_tokens=20, eos_token_id=eos, return_stats=True, attention=HF)
    assert torch.equal(seqs, greedy[:, :10]) and stats["new_tokens"] == 4
    assert len(stats["step_s"]) == 15  # EOS at step 3, seen by the host at step 16: steps 1..15 ran
    seqs, stats = gen.generate(model, ids, max_new_tokens=20, eos_token_id=eos, return_stats=True, attention=HF,
                               settings=DecodeSettings(eos_check_every=2))
    assert torch.equal(seqs, greedy[:, :10]) and stats["new_tokens"] == 4
    assert len(stats["step_s"]) == 3  # the check before step 4 stops it: steps 1..3 ran


def test_sampling_reproducible_and_top_k_1_is_greedy():
    model = _model("qwen3")
    ids = _ids(2, 5)
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, attention=HF)
    a = gen.generate(model, ids, generator=torch.Generator().manual_seed(7), **kw)
    b = gen.generate(model, ids, generator=torch.Generator().manual_seed(7), **kw)
    c = gen.generate(model, ids, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = gen.generate(model, ids, max_new_tokens=10, attention=HF)
    one = gen.generate(model, ids, max_new_tokens=10, do_sample=True, top_k=1, temperature=3.0,
                       generator=torch.Generator().manual_seed(0), attention=HF)
    assert torch.equal(one, greedy)
    tiny_p = gen.generate(model, ids, max_new_tokens=10, do_sample=True, top_p=1e-6,
                          generator=torch.Generator().manual_seed(0), attention=HF)
    assert torch.equal(tiny_p, greedy)  # top-p keeps at least the top token


def test_top_k_top_p_filter_the_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(4000, -1)
    draws = sampling.choose(logits, True, 1.0, 3, 1.0, g)
    assert set(draws.tolist()) == {0, 1, 2}
    probs = logits[0].softmax(-1)  # [0.636, 0.234, 0.086, ...]: top_p 0.8 keeps tokens 0 and 1
    draws = sampling.choose(logits, True, 1.0, 0, 0.8, g)
    assert set(draws.tolist()) == {0, 1}
    share = (draws == 0).float().mean()
    assert abs(share - probs[0] / probs[:2].sum()) < 0.03


def test_stats():
    model = _model("llama")
    seqs, stats = gen.generate(model, _ids(2, 5), max_new_tokens=4, return_stats=True)
    assert seqs.shape == (2, 9)
    assert stats["ttft_s"] > 0 and len(stats["step_s"]) == 3 and all(s > 0 for s in stats["step_s"])
    assert min(stats["step_s"]) <= stats["p50_step_s"] <= stats["p99_step_s"] <= max(stats["step_s"])
    assert stats["tokens_per_s"] > 0 and stats["decode_tokens_per_s"] > 0
    assert stats["new_tokens"] == 4 and stats["batch_size"] == 2
    assert stats["peak_memory_bytes"] is None and stats["cuda_graph"] is False and stats["attention"] == "tigon"


def test_bad_input():
    model = _model("llama")
    ids = _ids(1, 5)
    with pytest.raises(ValueError, match="generate: max_new_tokens"):
        gen.generate(model, ids, max_new_tokens=0)
    with pytest.raises(TypeError, match="generate: max_new_tokens must be an int"):
        gen.generate(model, ids, max_new_tokens=2.0)
    with pytest.raises(ValueError, match=r"generate: capacity \(4\).*prompt \(5"):
        gen.generate(model, ids, max_new_tokens=2, capacity=4)
    with pytest.raises(ValueError, match="generate: temperature"):
        gen.generate(model, ids, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="generate: top_k"):
        gen.generate(model, ids, max_new_tokens=2, do_sample=True, top_k=-1)
    with pytest.raises(ValueError, match="generate: top_p"):
        gen.generate(model, ids, max_new_tokens=2, do_sample=True, top_p=-0.1)
    with pytest.raises(ValueError, match="generate: top_p"):
        gen.generate(model, ids, max_new_tokens=2, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="generate: eos_token_id"):
        gen.generate(model, ids, max_new_tokens=2, eos_token_id=[])
    with pytest.raises(ValueError, match="generate: input_ids"):
        gen.generate(model, ids[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="generate: attention_mask"):
        gen.generate(model, ids, max_new_tokens=2, attention_mask=torch.ones(1, 4))
    for bad in ("sdpa", "HF", None, 1):
        with pytest.raises(ValueError, match="generate: attention must be one of 'auto', 'tigon', 'hf'"):
            gen.generate(model, ids, max_new_tokens=2, attention=bad)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kw,error,message", [
    (dict(do_sample=True, temperature=float("nan")), ValueError, r"generate: temperature must be a finite float > 0"),
    (dict(do_sample=True, temperature=-1.0), ValueError, r"generate: temperature must be a finite float > 0"),
    (dict(do_sample=True, temperature=float("inf")), ValueError, r"generate: temperature must be a finite float > 0"),
    (dict(do_sample=True, temperature="0.7"), TypeError, r"generate: temperature must be a float > 0, got str"),
    (dict(do_sample=True, temperature=True), TypeError, r"generate: temperature must be a float"),
    (dict(do_sample=True, top_k=2.5), TypeError, r"generate: top_k must be an int"),
    (dict(do_sample=True, top_p="0.9"), TypeError, r"generate: top_p must be a float in \(0, 1\]"),
    (dict(do_sample=True, top_p=0), ValueError, r"generate: top_p must be in \(0, 1\] \(1.0 = off\), got 0 \(for "
                                                r"the top token only pass top_k=1"),
    (dict(do_sample=True, top_p=0.0), ValueError, r"generate: top_p must be in \(0, 1\]"),
    (dict(do_sample=True, top_p=float("nan")), ValueError, r"generate: top_p must be in \(0, 1\] .*got nan"),
    (dict(do_sample=True, top_p=True), TypeError, r"generate: top_p must be a float"),
    (dict(do_sample=True, top_k=-1), ValueError, r"generate: top_k must be >= 0, got -1"),
    (dict(do_sample=True, generator=1), TypeError, r"generate: generator must be a torch.Generator on the model's"),
    (dict(do_sample=1), TypeError, r"generate: do_sample must be True or False, got int"),
    (dict(cuda_graph="no"), TypeError, r"generate: cuda_graph must be True or False"),
    (dict(return_stats=None), TypeError, r"generate: return_stats must be True or False"),
    (dict(max_new_tokens=-3), ValueError, r"generate: max_new_tokens must be >= 1, got -3"),
    (dict(capacity=0), ValueError, r"generate: capacity must be >= 1"),
    (dict(capacity=8.0), TypeError, r"generate: capacity must be an int"),
    (dict(eos_token_id=131), ValueError, r"generate: eos_token_id \[131\] is outside the model's vocabulary \(ids 0"),
    (dict(eos_token_id=[3, -1]), ValueError, r"generate: eos_token_id must be a token id >= 0"),
    (dict(eos_token_id=True), ValueError, r"generate: eos_token_id must be a token id >= 0"),
    (dict(eos_token_id=torch.tensor([2.0])), ValueError, r"generate: eos_token_id must be a token id"),
    (dict(pad_token_id=-1), ValueError, r"generate: pad_token_id must be >= 0"),
    (dict(pad_token_id=500), ValueError, r"generate: pad_token_id 500 is outside the model's vocabulary"),
    (dict(eos_token_id=[200]), ValueError, r"generate: eos_token_id \[200\] is outside"),
])
def test_bad_arguments_name_the_function_and_the_argument(kw, error, message):
    model = _model("llama")
    kw = dict(dict(max_new_tokens=2), **kw)
    with pytest.raises(error, match=message):  # messages start with "generate: " (a "cuda..." one marks a CUDA test)
        gen.generate(model, _ids(1, 5), **kw)


def test_sampling_arguments_are_ignored_without_do_sample():
    # As in model.generate: greedy decoding neither reads nor checks them (HF warns, generates greedily).
    model = _model("llama")
    ids = _ids(1, 5)
    greedy = gen.generate(model, ids, max_new_tokens=3, attention=HF)
    assert torch.equal(gen.generate(model, ids, max_new_tokens=3, temperature=0.0, top_k=-1, top_p=2.0,
                                    attention=HF), greedy)


def test_bad_models_and_prompts():
    model = _model("llama")
    ids = _ids(2, 5)
    with pytest.raises(TypeError, match=r"generate: model must be a Hugging Face causal LM .*got Linear"):
        gen.generate(torch.nn.Linear(2, 2), ids, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"generate: model must be a Hugging Face causal LM .*got str"):
        gen.generate("meta-llama/Llama-3.2-1B", ids, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: model LlamaModel has no LM head .*not `model.model`"):
        gen.generate(model.model, ids, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: input_ids .*got \(2, 0\) torch.int64"):
        gen.generate(model, ids[:, :0], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: input_ids .*batch >= 1.*got \(0, 5\)"):
        gen.generate(model, ids[:0], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: input_ids .*got \(2, 5\) torch.float32"):
        gen.generate(model, ids.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: input_ids .*got \(1, 2, 5\)"):
        gen.generate(model, ids[None], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: input_ids .*got list"):
        gen.generate(model, ids.tolist(), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: input_ids must be token ids in 0..130 .*got values in 0..131"):
        gen.generate(model, torch.tensor([[0, 131]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"generate: input_ids must be token ids in 0..130 .*-1..4"):
        gen.generate(model, torch.tensor([[-1, 4]]), max_new_tokens=2)
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match=r"generate: attention_mask must be a \[2, 5\] tensor"):
        gen.generate(model, ids, max_new_tokens=2, attention_mask=mask[:1])
    with pytest.raises(ValueError, match=r"generate: attention_mask must be a \[2, 5\] tensor.*list"):
        gen.generate(model, ids, max_new_tokens=2, attention_mask=mask.tolist())
    right = mask.clone()
    right[1, -2:] = 0
    with pytest.raises(ValueError, match=r"generate: attention_mask: every row must end with a real token"):
        gen.generate(model, ids, max_new_tokens=2, attention_mask=right)
    with pytest.raises(ValueError, match=r"generate: attention_mask: every row must end with a real token"):
        gen.generate(model, ids, max_new_tokens=2, attention_mask=torch.zeros_like(ids))
    with pytest.raises(ValueError, match=r"generate: attention_mask must hold only 0 \(padding\) and 1"):
        gen.generate(model, ids, max_new_tokens=2, attention_mask=mask * 2)
    # bool and float masks of 0/1 are masks too
    left = mask.clone()
    left[0, :2] = 0
    want = gen.generate(model, ids, max_new_tokens=2, attention_mask=left, attention=HF)
    for m in (left.bool(), left.float()):
        assert torch.equal(gen.generate(model, ids, max_new_tokens=2, attention_mask=m, attention=HF), want)


def test_tiny_temperatures_tend_to_greedy():
    # logits / 1e-300 would be +-inf (NaN after softmax, token 0 forever); shifted by the max they are <= 0.
    model = _model("qwen3")
    ids = _ids(2, 5)
    greedy = gen.generate(model, ids, max_new_tokens=6, attention=HF)
    for t in (1e-300, 5e-324, 1e-40, 1e-6):
        got = gen.generate(model, ids, max_new_tokens=6, do_sample=True, temperature=t,
                           generator=torch.Generator().manual_seed(0), attention=HF)
        assert torch.equal(got, greedy), t
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 7.0, 7.0, -30.0, 7.0 - 2**-20]]).expand(2000, -1)  # a tie for the top
    for t in (1e-300, 1e-30):
        draws = sampling.choose(logits, True, t, 0, 1.0, g)
        assert set(draws.tolist()) == {1, 2}  # the tie shares the draws, nothing else is drawn
        assert abs((draws == 1).float().mean() - 0.5) < 0.05
    # large logits and a small temperature: still a distribution, not an overflow
    assert set(sampling.choose(torch.tensor([[3e38, 1e38]]), True, 0.5, 0, 0.9, g).tolist()) == {0}
    assert set(sampling.choose(torch.tensor([[1.0, 0.0]]).expand(500, -1), True, 1e300, 0, 1.0, g).tolist()) == {0, 1}


def test_sliding_window_model_may_use_a_capacity_below_the_prompt():
    model = tiny_model("mistral", attn_implementation="sdpa", sliding_window=4).eval()
    model.generation_config.eos_token_id = None
    ids = _ids(2, 9)
    got = gen.generate(model, ids, max_new_tokens=4, capacity=4)
    assert torch.equal(got, _hf(model, ids, 4, pad_token_id=0))


# The "tigon" attention (attention="auto") against HF's (attention="hf") through the same loop, and both against
# model.generate, fp32, batch 2. A ring that wraps: Mistral's window 8 < 9 + 6 (the prefill overflows it, every
# decode step wraps it), Gemma-2's rolling local ring (window 8 < 7 + 6; global rings of 13: a mask per layer
# type) with attention-logit softcapping 2.0.
TIGON_CASES = [("llama", {}, 7), ("qwen3", {}, 7), ("mistral", dict(sliding_window=8), 9),
               ("gemma2", dict(attn_logit_softcapping=2.0, sliding_window=8), 7)]


def _attn_model(model_type, overrides):
    model = tiny_model(model_type, attn_implementation="eager" if model_type == "gemma2" else "sdpa",
                       **overrides).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("model_type,overrides,prompt", TIGON_CASES, ids=[c[0] for c in TIGON_CASES])
def test_tigon_attention_matches_hf_attention(model_type, overrides, prompt):
    from tigon import ops

    model = _attn_model(model_type, overrides)
    impl = model.config._attn_implementation
    ids = _ids(2, prompt)
    ref, ref_stats = gen.generate(model, ids, max_new_tokens=6, attention="hf", return_stats=True)
    before = ops.dispatch_counts[("decode_attention", "triton")] + ops.dispatch_counts[("decode_attention",
                                                                                         "reference")]
    got, stats = gen.generate(model, ids, max_new_tokens=6, return_stats=True)
    ran = ops.dispatch_counts[("decode_attention", "triton")] + ops.dispatch_counts[("decode_attention",
                                                                                     "reference")] - before
    assert ran == model.config.num_hidden_layers * 5  # every decode step of every layer
    assert torch.equal(got, ref) and torch.equal(ref, _hf(model, ids, 6, pad_token_id=0))
    assert (stats["attention"], ref_stats["attention"]) == ("tigon", "hf")
    # Restored: the implementation and the class forwards; nothing of tigon's left on the instance.
    assert model.config._attn_implementation == impl
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_tigon_left_padding_past_the_ring_is_exact():
    # Row 0 has 3 padding tokens that stay in the ring (window 8) for the first 2 steps, then leave it as it wraps:
    # the tigon masks drop them by slot, so row 0 decodes as the unpadded prompt alone does. (HF's mask past
    # the ring applies the padding by position, not slot, its documented limit: with attention="hf" row 0 of
    # this prompt parts from the unpadded one.)
    model = _attn_model("mistral", dict(sliding_window=8))
    ids = _ids(2, 9, seed=1)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    got = gen.generate(model, ids, max_new_tokens=5, attention_mask=mask)
    alone = gen.generate(model, ids[:1, 3:], max_new_tokens=5)
    assert torch.equal(got[0, 9:], alone[0, 6:])
    assert torch.equal(got[1], gen.generate(model, ids[1:], max_new_tokens=5)[0])


def test_attention_switch_and_restore():
    from tigon.hf.attention import NAME, restore_attention, use_tigon_attention

    model = _model("llama")
    ids = _ids(1, 5)
    # Restored when the call fails after the switch (the capacity check needs the cache).
    with pytest.raises(ValueError, match="capacity"):
        gen.generate(model, ids, max_new_tokens=2, capacity=4)
    assert model.config._attn_implementation == "sdpa" and "forward" not in model.model.layers[0].self_attn.__dict__
    # A model already on "tigon" stays there; attention="hf" switches it back to sdpa for the call only.
    use_tigon_attention(model)
    _, stats = gen.generate(model, ids, max_new_tokens=2, return_stats=True)
    assert stats["attention"] == "tigon" and model.config._attn_implementation == NAME
    _, stats = gen.generate(model, ids, max_new_tokens=2, attention="hf", return_stats=True)
    assert stats["attention"] == "hf" and model.config._attn_implementation == NAME
    assert "forward" in model.model.layers[1].self_attn.__dict__
    restore_attention(model)
    assert model.config._attn_implementation == "sdpa"
    # A family tigon does not cover whole (here: another library's forward on layer 0): auto runs HF's
    # attention, attention="tigon" is refused.
    attn = model.model.layers[0].self_attn
    attn.forward = attn.forward
    _, stats = gen.generate(model, ids, max_new_tokens=2, return_stats=True)
    assert stats["attention"] == "hf" and model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"generate: attention='tigon'.* covers 1 of the 2 attention layers"):
        gen.generate(model, ids, max_new_tokens=2, attention="tigon")
    assert model.config._attn_implementation == "sdpa" and attn.__dict__["forward"] is not None


def _fake_capture(forward, cache):
    """The graph path's bookkeeping on CPU: a 'replay' runs the forward with the host counters frozen at their
    capture-time values, as a real replay re-runs the kernels HF's Python chose at capture."""
    logits = forward()
    frozen = [layer.seen for layer in cache.layers]
    graph_logits = torch.zeros_like(logits)

    class Replay:
        def replay(self):
            real = [layer.seen for layer in cache.layers]
            for layer, count in zip(cache.layers, frozen):
                layer.seen = count
            graph_logits.copy_(forward())
            for layer, count in zip(cache.layers, real):
                layer.seen = count

    return Replay(), graph_logits, logits


@pytest.mark.parametrize("do_sample", [False, True])
def test_graph_path_with_frozen_host_state_matches_eager(monkeypatch, do_sample):
    # The query positions of the decode mask come from the cache's device counter, not the host count baked
    # at capture: a left-padded batch decodes the same through the replay path.
    # 5 new tokens: the capture at step 1, then 3 replays whose host counters lag the device's by 1 to 3.
    # Greedy, the reference is model.generate itself (the eager tigon loop equals it: the tests above); sampled,
    # the eager tigon loop with the same generator.
    model = _model("llama")
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(max_new_tokens=5, attention_mask=mask, do_sample=do_sample, top_k=30, return_stats=True)
    if do_sample:
        ref, ref_stats = gen.generate(model, ids, generator=torch.Generator().manual_seed(5), **kw)
        assert not ref_stats["cuda_graph"]
    else:
        ref = _hf(model, ids, 5, attention_mask=mask)
    monkeypatch.setattr(gen, "_graphs_available", lambda device: True)
    monkeypatch.setattr(gen, "_capture", _fake_capture)
    got, stats = gen.generate(model, ids, generator=torch.Generator().manual_seed(5), **kw)
    assert stats["cuda_graph"] and stats["attention"] == "tigon" and len(stats["step_s"]) == 4
    assert torch.equal(got, ref)


def test_on_capture_runs_once_after_the_capture(monkeypatch):
    # The profiler's hook (benchmarks/decode_profile.py): after the capture, before the first replay.
    model = _model("llama")
    events = []

    def capture(forward, cache):
        events.append("capture")
        return _fake_capture(forward, cache)

    monkeypatch.setattr(gen, "_graphs_available", lambda device: True)
    monkeypatch.setattr(gen, "_capture", capture)
    settings = DecodeSettings(on_capture=lambda: events.append("hook"))
    _, stats = gen.generate(model, _ids(1, 5), max_new_tokens=3, return_stats=True, settings=settings)
    assert stats["cuda_graph"] and events == ["capture", "hook"]


@pytest.mark.parametrize("attention", ["auto", "hf"])
def test_graph_path_past_the_ring(monkeypatch, attention):
    # With the tigon attention a ring that wraps takes the graph path, and a replay with the capture-time host
    # counters decodes as the eager loop; HF's attention falls back to eager steps there.
    model = _attn_model("mistral", dict(sliding_window=8))
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kw = dict(max_new_tokens=5, attention_mask=mask, attention=attention, return_stats=True)
    ref, ref_stats = gen.generate(model, ids, **kw)
    monkeypatch.setattr(gen, "_graphs_available", lambda device: True)
    monkeypatch.setattr(gen, "_capture", _fake_capture)
    got, stats = gen.generate(model, ids, **kw)
    assert not ref_stats["cuda_graph"] and stats["cuda_graph"] == (attention == "auto")
    assert torch.equal(got, ref)


def _gpu_model():
    from transformers import AutoModelForCausalLM

    from tests.hf._tiny import tiny_config

    torch.manual_seed(0)
    # Llama-3-8B attention and width (32 heads, 8 kv heads of 128, hidden 4096), 4 layers, bf16.
    cfg = tiny_config("llama", num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, hidden_size=4096, intermediate_size=4096, vocab_size=32000,
                      max_position_embeddings=4096, attn_implementation="sdpa")
    model = AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # every new token: the step counts below are exact
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("do_sample", [False, True])
def test_gpu_cuda_graph_matches_eager(do_sample):
    model = _gpu_model()
    ids = torch.randint(0, 32000, (4, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(max_new_tokens=64, do_sample=do_sample, top_p=0.9, temperature=0.7, return_stats=True)
    runs = [gen.generate(model, ids, cuda_graph=graph, generator=torch.Generator("cuda").manual_seed(3), **kw)
            for graph in (True, False, True)]
    (a, sa), (b, sb), (c, _) = runs
    assert sa["cuda_graph"] and not sb["cuda_graph"]
    assert torch.equal(a, b) and torch.equal(a, c)
    assert sa["peak_memory_bytes"] > 0 and sa["p50_step_s"] > 0


def _sync_checked_replays(monkeypatch):
    """From the first CUDA-graph replay on, sync-debug mode "error" (any host sync raises). Returns the list that
    counts the replays; the caller resets the mode."""
    replay = torch.cuda.CUDAGraph.replay
    calls = []

    def checked_replay(self):
        calls.append(1)
        torch.cuda.set_sync_debug_mode("error")
        replay(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", checked_replay)
    return calls


@pytest.mark.gpu
def test_gpu_replayed_steps_do_not_sync(monkeypatch):
    # Every replayed step (replay + token choice + bookkeeping) runs under sync-debug "error", switched on at
    # the first replay; test_gpu_capture_leaves_the_gpu_running covers the capture.
    model = _gpu_model()
    ids = torch.randint(0, 32000, (2, 50), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    calls = _sync_checked_replays(monkeypatch)
    try:
        seqs = gen.generate(model, ids, max_new_tokens=40, do_sample=True, top_k=50, top_p=0.9,
                            generator=torch.Generator("cuda").manual_seed(1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) == 38 and seqs.shape == (2, 90)



@pytest.mark.gpu
def test_gpu_capture_leaves_the_gpu_running(monkeypatch):
    # The decode graph is captured without torch.cuda.graph's device synchronize and cache release
    # (decode/capture.py): the queued prefill keeps the GPU busy while the host records. Tokens as eager.
    model = _gpu_model()
    ids = torch.randint(0, 32000, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    eager = gen.generate(model, ids, max_new_tokens=12, cuda_graph=False)
    calls = []
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))
    graphed, stats = gen.generate(model, ids, max_new_tokens=12, return_stats=True)
    monkeypatch.undo()
    assert stats["cuda_graph"] and calls == []
    assert torch.equal(graphed, eager)


@pytest.mark.gpu
def test_gpu_ttft_phases_sum_to_ttft():
    # CUDA events at the phase boundaries: their intervals add up to the TTFT interval (event times resolve
    # ~0.5 us each), and the host's wall time of every phase is there beside them.
    model = _gpu_model()
    ids = torch.randint(0, 32000, (2, 100), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    gen.generate(model, ids, max_new_tokens=4)  # Triton JIT outside the timed call
    _, stats = gen.generate(model, ids, max_new_tokens=4, return_stats=True)
    dev, host = stats["ttft_phases_s"], stats["ttft_host_phases_s"]
    assert tuple(dev) == tuple(host) == TTFT_PHASES
    assert sum(dev.values()) == pytest.approx(stats["ttft_s"], abs=2e-5)
    assert all(v >= 0 for v in host.values()) and dev["prefill"] > 0

# Rings that wrap on the GPU with the tigon attention (fp32 tiny models): Mistral's sliding window 16 < 40 + 40,
# Gemma-2's local layers (window 16, global rings of 80: one mask per layer type, softcap 2.0), Llama with
# capacity 48 < 80 (the full-attention ring rolls).
GPU_WRAP = [("mistral", dict(sliding_window=16), None), ("gemma2", dict(attn_logit_softcapping=2.0, sliding_window=16),
                                                           None), ("llama", {}, 48)]


def _gpu_wrap_model(model_type, overrides):
    model = _attn_model(model_type, dict(overrides, max_position_embeddings=128)).cuda()
    ids = torch.randint(0, 131, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    return model, ids, mask


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,overrides,capacity", GPU_WRAP, ids=[c[0] for c in GPU_WRAP])
def test_gpu_tigon_graph_past_the_ring(model_type, overrides, capacity):
    model, ids, mask = _gpu_wrap_model(model_type, overrides)
    kw = dict(max_new_tokens=40, capacity=capacity, return_stats=True)
    graph, gs = gen.generate(model, ids, **kw)
    eager, es = gen.generate(model, ids, cuda_graph=False, **kw)
    hf, hs = gen.generate(model, ids, attention="hf", **kw)
    assert (gs["cuda_graph"], gs["attention"]) == (True, "tigon") and not es["cuda_graph"]
    assert (hs["cuda_graph"], hs["attention"]) == (False, "hf")  # HF's mask past the ring: eager steps
    assert torch.equal(graph, eager) and torch.equal(graph, hf)
    # Left padding (the per-step mask gather) through the replay, and a second graph call (a fresh capture).
    padded = [gen.generate(model, ids, attention_mask=mask, cuda_graph=g, **kw) for g in (True, False, True)]
    assert [st["cuda_graph"] for _, st in padded] == [True, False, True]
    assert torch.equal(padded[0][0], padded[1][0]) and torch.equal(padded[0][0], padded[2][0])
    assert model.config._attn_implementation == ("eager" if model_type == "gemma2" else "sdpa")


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,overrides,capacity", GPU_WRAP, ids=[c[0] for c in GPU_WRAP])
def test_gpu_tigon_replay_past_the_ring_does_not_sync(monkeypatch, model_type, overrides, capacity):
    # As test_gpu_replayed_steps_do_not_sync, on rings that wrap, with left padding (the mask gather runs).
    model, ids, mask = _gpu_wrap_model(model_type, overrides)
    gen.generate(model, ids, max_new_tokens=4, attention_mask=mask, capacity=capacity)  # Triton JIT, outside
    calls = _sync_checked_replays(monkeypatch)
    try:
        seqs = gen.generate(model, ids, max_new_tokens=40, attention_mask=mask, capacity=capacity, do_sample=True,
                            top_k=50, generator=torch.Generator("cuda").manual_seed(1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) == 38 and seqs.shape == (2, 80)


def test_ttft_counts_from_the_call(monkeypatch):
    # The first clock mark comes before the cache is built: a slow cache allocation shows up in TTFT.
    import time

    model = _model("llama")
    make = gen._cache_class

    def slow():
        cls = make()

        def build(*args, **kw):
            time.sleep(0.2)
            return cls(*args, **kw)

        return build

    monkeypatch.setattr(gen, "_cache_class", slow)
    _, stats = gen.generate(model, _ids(1, 5), max_new_tokens=3, return_stats=True, attention=HF)
    assert stats["ttft_s"] >= 0.2
    # ... and in its phase, on the device clock and on the host's.
    assert stats["ttft_phases_s"]["cache_alloc"] >= 0.2 and stats["ttft_host_phases_s"]["cache_alloc"] >= 0.2


@pytest.mark.parametrize("attention", ["auto", HF])
def test_ttft_phases_sum_to_ttft(attention):
    model = _model("llama")
    _, stats = gen.generate(model, _ids(2, 5), max_new_tokens=2, attention=attention, return_stats=True)
    for key in ("ttft_phases_s", "ttft_host_phases_s"):
        phases = stats[key]
        assert tuple(phases) == TTFT_PHASES  # in call order
        assert all(s >= 0 for s in phases.values())
        assert sum(phases.values()) == pytest.approx(stats["ttft_s"], rel=1e-6, abs=1e-6)
    assert stats["ttft_phases_s"]["prefill"] > 0


@pytest.mark.parametrize("v", [128256, 8192 * 3, 8209])  # 8209 is prime: one pass
def test_two_pass_argmax_is_argmax_with_first_index_ties(v):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, v, generator=g).to(torch.bfloat16)  # bf16: many ties
    x[1, 7] = x[1, v - 5] = 100.0  # a tie of the maximum across groups: the first index wins
    x[2, :] = 0.0  # all equal: index 0
    assert torch.equal(sampling.argmax(x, two_pass=True), x.float().argmax(-1))
    assert sampling.argmax(x, two_pass=True)[1] == 7


def test_stop_ids_come_from_the_generation_config_unless_given():
    # As model.generate: eos/pad left None are read from model.generation_config; an explicit argument wins.
    model = _model("llama")
    ids = _ids(2, 6, seed=4)
    greedy = gen.generate(model, ids, max_new_tokens=12, attention=HF)
    eos = int(greedy[0, 6 + 3])
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 127
    got = gen.generate(model, ids, max_new_tokens=12, attention=HF)
    assert torch.equal(got, model.generate(ids, max_new_tokens=12, do_sample=False))
    assert bool((got[0, 10:] == 127).all())
    assert torch.equal(gen.generate(model, ids, max_new_tokens=12, eos_token_id=[130], pad_token_id=5,
                                    attention=HF), greedy)  # 130 never comes: the explicit id wins
    model.generation_config.eos_token_id = [eos, 500]
    with pytest.raises(ValueError, match=r"generate: generation_config.eos_token_id \[500\] is outside"):
        gen.generate(model, ids, max_new_tokens=2, attention=HF)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 300
    with pytest.raises(ValueError, match=r"generate: generation_config.pad_token_id 300 is outside"):
        gen.generate(model, ids, max_new_tokens=2, attention=HF)


def test_settings_are_one_checked_value():
    with pytest.raises(ValueError, match="DecodeSettings: eos_check_every must be an int >= 1, got 0"):
        DecodeSettings(eos_check_every=0)
    with pytest.raises(TypeError, match="DecodeSettings: rotary_table must be True or False, got int"):
        DecodeSettings(rotary_table=1)
    with pytest.raises(TypeError, match="DecodeSettings: on_capture must be a callable or None"):
        DecodeSettings(on_capture="start")
    with pytest.raises(AttributeError):
        DecodeSettings().eos_check_every = 2  # frozen: passed in, never flipped
    with pytest.raises(TypeError, match="generate: settings must be a tigon.decode.DecodeSettings, got dict"):
        gen.generate(_model("llama"), _ids(1, 5), max_new_tokens=2, settings={"rotary_table": False})


def _request(model, ids, **kw):
    args = dict(max_new_tokens=3, attention_mask=None, capacity=None, cuda_graph=True, attention="auto",
                return_stats=False, do_sample=False, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                pad_token_id=None, generator=None, settings=DecodeSettings())
    return GenerationRequest.build(model, ids, **dict(args, **kw))


def test_request_is_checked_resolved_and_frozen():
    model = _model("llama")
    ids = _ids(2, 5)
    request = _request(model, ids)
    assert (request.batch, request.prompt, request.total, request.ring) == (2, 5, 8, 8) and request.input_ids is ids
    assert request.eos is None and request.pad == 0  # the generation_config's: no EOS, pad 0
    assert _request(model, ids, capacity=6).ring == 6
    model.generation_config.eos_token_id = [5, 7]
    assert (_request(model, ids).eos, _request(model, ids, pad_token_id=3).pad) == ((5, 7), 3)
    # greedy: the sampling arguments are neither checked nor kept; sampled, None is "off"
    greedy = _request(model, ids, temperature=0.0, top_k=-1, top_p=2.0, generator=torch.Generator())
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.generator) == (1.0, 0, 1.0, None)
    g = torch.Generator()
    sampled = _request(model, ids, do_sample=True, temperature=None, top_k=None, top_p=None, generator=g)
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.generator) == (1.0, 0, 1.0, g)
    assert greedy.choose(torch.tensor([[0.0, 3.0, 1.0]])).tolist() == [1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.max_new_tokens = 4
    with pytest.raises(ValueError, match=r"generate: top_p must be in \(0, 1\]"):
        _request(model, ids, do_sample=True, top_p=0)


def test_generate_hands_the_loop_one_request(monkeypatch):
    model = _model("llama")
    ids = _ids(1, 5)
    calls = []

    def loop(model_, request, clock, scope, *, tigon):
        calls.append((request, tigon))
        return request.input_ids, None

    monkeypatch.setattr(gen, "_decode_loop", loop)
    assert gen.generate(model, ids, max_new_tokens=2, attention=HF, do_sample=True, top_k=5) is ids
    ((request, tigon),) = calls
    assert isinstance(request, GenerationRequest) and not tigon
    assert (request.max_new_tokens, request.attention, request.do_sample, request.top_k) == (2, HF, True, 5)


def test_nearest_rank_percentile():
    from tigon.decode.stats import percentile

    values = list(range(1, 101))  # 1..100: the q-quantile is the ceil(100 q)-th value
    assert [percentile(values, q) for q in (0.01, 0.5, 0.99, 1.0)] == [1, 50, 99, 100]
    assert percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) is None
    steps = sorted(range(255))  # the benchmark's 255 steps: the peer benchmarks' sorted[int(q n)] picks the same
    assert all(percentile(steps, q) == steps[min(254, int(255 * q))] for q in (0.5, 0.99))


def test_public_names_are_the_decode_wings():
    """tigon.generate and tigon.DecodeSettings are tigon.decode's objects (tigon.decode.metrics:
    tests/decode/test_metrics.py)."""
    import tigon

    assert tigon.generate is gen.generate
    assert tigon.DecodeSettings is DecodeSettings
