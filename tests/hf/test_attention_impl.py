"""The "tigon" attention implementation against Hugging Face's on tiny random-init models (CPU, fp32).

The reference is the same model and the same RollingKVCache with HF's attention ("sdpa"; "eager" for Gemma-2,
whose attention-logit softcapping sdpa ignores), so the only difference is the decode step's attention:
decode_attention over the ring, and RoPE on write for the Llama-style families. Exactness is "the same greedy
tokens and logits within fp32 reordering noise"."""

import pytest
import torch

import tigon
from tests.hf._tiny import greedy_with_scores as _greedy
from tests.hf._tiny import prompt_ids as _ids
from tests.hf._tiny import tiny_model
from tigon import ops
from tigon.hf.attention import NAME, restore_attention, use_tigon_attention
from tigon.memory.kv_cache import RollingKVCache

TOL = dict(rtol=1e-4, atol=1e-4)


def _counts():
    """Calls of each op, kernel or reference path (a CPU without the interpreter runs the reference)."""
    return {op: ops.dispatch_counts[(op, "triton")] + ops.dispatch_counts[(op, "reference")]
            for op in ("decode_attention", "rope_kv_append")}


def _compare(model, ids, new, cache_kw, **gen_kw):
    """Greedy generation with HF's attention, then with tigon's; returns how many times each kernel ran."""
    b = ids.shape[0]
    ref = _greedy(model, ids, RollingKVCache(model.config, batch_size=b, **cache_kw), new, **gen_kw)
    use_tigon_attention(model)
    before = _counts()
    got = _greedy(model, ids, RollingKVCache(model.config, batch_size=b, **cache_kw), new, **gen_kw)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], **TOL)
    return {op: n - before[op] for op, n in _counts().items()}


@pytest.mark.parametrize("model_type,overrides,ref_attn,prompt,capacity,rope_on_write", [
    ("llama", {}, "sdpa", 7, 16, True),
    ("qwen3", {}, "sdpa", 7, 16, True),  # q_norm / k_norm before RoPE
    # window 8 < prompt 13: the prefill overflows the ring, then every decode step wraps it
    ("mistral", dict(sliding_window=8), "sdpa", 13, 8, True),
    # local layers: window 8 < 7 + 5, they roll; softcap 2.0 so the capping changes the scores
    ("gemma2", dict(attn_logit_softcapping=2.0, sliding_window=8), "eager", 7, 16, False),
    # Llama-form by the rule, not by name: Gemma (embedding scale, its own norms), Granite (attention_multiplier
    # as the scaling), Mixtral (Mistral's window from the config, MoE MLP)
    ("gemma", {}, "sdpa", 7, 16, True),
    ("granite", {}, "sdpa", 7, 16, True),
    ("mixtral", dict(sliding_window=8), "sdpa", 9, 8, True),
])
def test_generate_matches_hf(model_type, overrides, ref_attn, prompt, capacity, rope_on_write):
    model = tiny_model(model_type, attn_implementation=ref_attn, **overrides).eval()
    new = 5
    ran = _compare(model, _ids(2, prompt), new, dict(capacity=capacity))
    steps = model.config.num_hidden_layers * (new - 1)  # every decode step of every layer, none of the prefill
    assert ran == {"decode_attention": steps, "rope_kv_append": steps if rope_on_write else 0}


def test_left_padded_batch():
    # The decode mask's padding columns become empty slots (-1) per row.
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    ids = _ids(3, 9)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ran = _compare(model, ids, 5, dict(capacity=14), attention_mask=mask)
    assert ran["decode_attention"] == 2 * 4


def test_full_attention_ring_wraps_with_sinks():
    # capacity 8 < 6 + 5 with 2 sink slots: decode steps overwrite the oldest non-sink slot.
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    ran = _compare(model, _ids(2, 6), 5, dict(capacity=8, sink_tokens=2))
    assert ran["rope_kv_append"] == 2 * 4


def test_tigon_generate_loop():
    # tigon.generate reads the query offset from the cache's device counter during decode.
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ref = tigon.generate(model, ids, attention_mask=mask, max_new_tokens=5, attention="hf")
    use_tigon_attention(model)
    before = _counts()
    assert torch.equal(tigon.generate(model, ids, attention_mask=mask, max_new_tokens=5), ref)
    assert _counts()["rope_kv_append"] - before["rope_kv_append"] == 2 * 4


def test_prefill_training_and_other_caches_are_sdpa():
    from transformers import DynamicCache

    model = tiny_model("llama", attn_implementation="sdpa")
    ids = _ids(2, 5)
    ref = model(ids, labels=ids)
    ref.loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    use_tigon_attention(model)
    before = _counts()
    got = model(ids, labels=ids)
    got.loss.backward()
    assert torch.equal(got.logits, ref.logits)
    for p, g in zip(model.parameters(), ref_grads):
        assert torch.equal(p.grad, g)
    with torch.no_grad():  # a decode step on a DynamicCache, and one on a ring with grad on: HF's path
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache)
        model(ids[:, :1], past_key_values=cache)
    ring = RollingKVCache(model.config, batch_size=2, capacity=8)
    model(ids, past_key_values=ring)
    model(ids[:, :1], past_key_values=ring)
    assert _counts() == before


def test_decode_logits_one_step():
    model = tiny_model("mistral", attn_implementation="sdpa", sliding_window=4).eval()
    ids = _ids(2, 6)

    def step(cache):
        with torch.no_grad():
            model(ids, past_key_values=cache)
            return model(ids[:, -1:], past_key_values=cache).logits

    ref = step(RollingKVCache(model.config, batch_size=2, capacity=4))
    use_tigon_attention(model)
    torch.testing.assert_close(step(RollingKVCache(model.config, batch_size=2, capacity=4)), ref, rtol=1e-5,
                               atol=1e-5)


def test_patch_keyword_unpatch_and_restore():
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    impl_piece = f"attention implementation '{NAME}'"
    assert not any(impl_piece in piece for piece in tigon.patch(model, attention=False).replaced)
    assert model.config._attn_implementation == "sdpa"
    tigon.unpatch(model)
    assert any(impl_piece in piece for piece in tigon.patch(model).replaced)  # "auto": sdpa switches everywhere
    assert model.config._attn_implementation == NAME
    tigon.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    report = tigon.patch(model, attention=True)
    assert report.replaced["LlamaAttention decode (RoPE on write)"] == 2
    assert model.config._attn_implementation == NAME
    assert use_tigon_attention(model)["LlamaAttention decode (RoPE on write)"] == 2  # idempotent
    attn = model.model.layers[0].self_attn
    assert "forward" in attn.__dict__
    tigon.unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert "forward" not in attn.__dict__ and "_tigon_rope_on_write" not in attn.__dict__
    use_tigon_attention(model)
    restore_attention(model)
    restore_attention(model)
    assert model.config._attn_implementation == "sdpa" and "forward" not in attn.__dict__
    class_report = tigon.patch(model_type="llama", rms_norm=False, rope=False, swiglu=False,
                               fused_linear_cross_entropy=False, attention=True)
    assert ("attention", "the 'tigon' attention implementation is set on a model instance") in class_report.skipped
    tigon.unpatch()


def test_other_forward_on_the_instance_is_left_alone():
    model = tiny_model("gemma2", attn_implementation="eager").eval()
    attn = model.model.layers[1].self_attn
    theirs = attn.forward
    attn.forward = theirs  # an instance forward another library installed
    counts = use_tigon_attention(model)
    assert counts["Gemma2Attention decode (decode_attention)"] == 1 and attn.__dict__["forward"] is theirs
    restore_attention(model)
    assert attn.__dict__["forward"] is theirs


@pytest.mark.gpu
@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("gemma2", dict(attn_logit_softcapping=2.0))])
def test_cuda_graph_generate_and_no_host_sync_gpu(model_type, overrides):
    """tigon.generate captures the decode forward in a CUDA graph with the tigon attention: the same tokens as
    HF's attention, and one eager decode step runs without a host sync."""
    ref_attn = "eager" if model_type == "gemma2" else "sdpa"
    model = tiny_model(model_type, attn_implementation=ref_attn, **overrides).cuda().eval()
    ids = _ids(2, 6).cuda()
    # The reference runs eagerly: HF's eager mask (Gemma-2's reference) copies a host scalar, which capture refuses.
    ref = tigon.generate(model, ids, max_new_tokens=8, cuda_graph=False, attention="hf")
    use_tigon_attention(model)
    got, stats = tigon.generate(model, ids, max_new_tokens=8, return_stats=True)
    assert stats["cuda_graph"] and torch.equal(got, ref)
    cache = RollingKVCache(model.config, batch_size=2, capacity=16, device="cuda")
    tok = ids[:, -1:]
    with torch.no_grad():
        model(ids, past_key_values=cache)
        model(tok, past_key_values=cache)  # warm-up: Triton compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(tok, past_key_values=cache, use_cache=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_rope_on_write_is_read_from_the_forward():
    # No table of class names: a class gets RoPE on write when its forward reads as Llama's (up to a sliding
    # window and Qwen3's head-dim q/k norms) and its apply_rotary_pos_emb is rotate-half.
    import importlib

    from tigon.hf.forward_source import rope_on_write_form
    from tigon.hf.registry import FAMILIES

    forms = {}
    for fam in FAMILIES.values():
        cls = getattr(importlib.import_module(fam.modeling), f"{fam.prefix}Attention", None)
        forms[fam.model_type] = rope_on_write_form(cls) if cls is not None else None
    assert forms["llama"] == (None, False) and forms["mistral"] == ("config", False)
    assert forms["qwen2"] == ("module", False) and forms["qwen3"] == ("module", True)
    for kept in ("gemma2", "gemma3_text", "phi3", "smollm3", "olmo2", "glm", "glm4", "helium"):
        assert forms[kept] is None, kept  # softcap, fused qkv, NoPE layers, whole-projection norms, interleaved RoPE
    replaced = type("LlamaAttention", (), {"forward": lambda self, *a, **k: None})  # not transformers' forward
    assert rope_on_write_form(replaced) is None


def test_rope_on_write_reads_through_the_kernels_function_module():
    # With `kernels` installed, transformers 5.17 holds apply_rotary_pos_emb as an instance of a class kernels
    # makes for it; Tigon reads it as the function it wraps, so the Llama-form families keep RoPE on write.
    from transformers.models.glm import modeling_glm
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    from tigon.hf.forward_source import rope_on_write_form

    if not isinstance(modeling_llama.apply_rotary_pos_emb, torch.nn.Module):
        pytest.skip("without the `kernels` package transformers' apply_rotary_pos_emb is a plain function")
    assert rope_on_write_form(modeling_llama.LlamaAttention) == (None, False)
    assert rope_on_write_form(modeling_qwen3.Qwen3Attention) == ("module", True)
    assert rope_on_write_form(modeling_glm.GlmAttention) is None  # interleaved RoPE (a plain function there)
    model = tiny_model("llama", num_hidden_layers=1)
    use_tigon_attention(model)
    assert model.model.layers[0].self_attn._tigon_rope_on_write
    restore_attention(model)
