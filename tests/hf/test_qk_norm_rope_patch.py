"""tigon.patch runs Qwen3's q/k norms and RoPE as one kernel (ops.qk_norm_rope) where the attention forward is
Llama's with the norms, and the class forward (norms and RoPE apart) everywhere else."""

import copy

import pytest
import torch

import tigon
from tigon.hf import forward_source, qk_norm_rope_forward, rope_routing

from ._tiny import batch, op_calls, tiny_model

FUSED = "Qwen3Attention q/k norms + RoPE in one kernel (this instance)"


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _norm_weights_off_one(model):
    """q_norm / k_norm weights away from HF's ones, so their gradients and scaling are seen."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)


@pytest.mark.parametrize("overrides", [{}, dict(use_sliding_window=True, sliding_window=4, max_window_layers=0)],
                         ids=["full", "sliding_window"])
def test_patched_qwen3_fuses_and_trains_like_hf(overrides):
    hf = tiny_model("qwen3", **overrides)
    _norm_weights_off_one(hf)
    model = copy.deepcopy(hf)
    report = tigon.patch(model)
    assert report.replaced[FUSED] == 2, str(report)
    attn = model.model.layers[0].self_attn
    assert attn.__dict__[qk_norm_rope_forward.QK_NORM_ROPE] == "module"  # Qwen3 passes self.sliding_window
    assert attn.sliding_window == (4 if overrides else None)
    ids, labels = batch()
    before = op_calls("qk_norm_rope")
    loss, grads = _loss_and_grads(model, ids, labels)
    assert op_calls("qk_norm_rope") - before == 2  # one call a layer
    ref_loss, ref_grads = _loss_and_grads(hf, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:  # fp32 model: the kernels agree with HF's ops to fp32 rounding
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    assert ref_grads["model.layers.0.self_attn.q_norm.weight"].abs().max() > 0


def test_generate_matches_hf():
    hf = tiny_model("qwen3")
    _norm_weights_off_one(hf)
    model = copy.deepcopy(hf)
    tigon.patch(model)
    ids = batch()[0][:1, :5]
    with torch.no_grad():
        before = op_calls("qk_norm_rope")
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert op_calls("qk_norm_rope") > before  # prefill and the DynamicCache decode steps
        ref = hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_unpatch_and_unrouted_norms():
    model = tiny_model("qwen3")
    tigon.patch(model)
    attn = model.model.layers[1].self_attn
    assert qk_norm_rope_forward.QK_NORM_ROPE in attn.__dict__
    tigon.unpatch(model)
    assert qk_norm_rope_forward.QK_NORM_ROPE not in attn.__dict__ and "forward" not in attn.__dict__
    # norms left as Hugging Face's: RoPE is routed, the norms and RoPE stay apart
    report = tigon.patch(model, rms_norm=False)
    assert FUSED not in report.replaced and rope_routing.ROPE in attn.__dict__
    assert report.skipped.count((FUSED, "rms_norm=False")) == 1, report.skipped  # said once, not once a layer
    assert qk_norm_rope_forward.QK_NORM_ROPE not in attn.__dict__
    tigon.unpatch(model)


def test_norms_swapped_after_patch_take_the_class_forward():
    hf = tiny_model("qwen3")
    _norm_weights_off_one(hf)
    model = copy.deepcopy(hf)
    tigon.patch(model)
    for layer, ref_layer in zip(model.model.layers, hf.model.layers):  # back to HF's norms behind the patch's back
        layer.self_attn.q_norm, layer.self_attn.k_norm = ref_layer.self_attn.q_norm, ref_layer.self_attn.k_norm
    ids, labels = batch()
    before = op_calls("qk_norm_rope")
    loss, _ = _loss_and_grads(model, ids, labels)
    assert op_calls("qk_norm_rope") == before
    torch.testing.assert_close(loss, _loss_and_grads(hf, ids, labels)[0], rtol=1e-5, atol=1e-5)


def test_ready_on_the_installed_transformers():
    """The fused forward computes transformers' LlamaAttention.forward of the version it was written against; a
    transformers whose Llama forward differs gets the class forward, and this test says the fused one is off."""
    model = tiny_model("qwen3")
    tigon.patch(model)
    assert qk_norm_rope_forward.qk_norm_rope_ready(model.model.layers[0].self_attn) == ""
    llama = tiny_model("llama")
    assert not any("q/k norms" in piece for piece, _ in tigon.patch(llama).skipped)  # nothing to fuse: not named
    assert "no q/k norms" in qk_norm_rope_forward.qk_norm_rope_ready(llama.model.layers[0].self_attn)


@pytest.mark.parametrize("patch_first", [True, False], ids=["patch_then_peft", "peft_then_patch"])
def test_peft_lora_on_the_projections(patch_first):
    """PEFT LoRA on q/k/v/o of a patched Qwen3: the fused forward calls the adapters' projections; the loss and the
    adapters' gradients are PEFT's on the unpatched model's."""
    peft = pytest.importorskip("peft")
    cfg = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
               init_lora_weights=False)

    def build(patched):
        model = tiny_model("qwen3")
        _norm_weights_off_one(model)
        if patched and patch_first:
            tigon.patch(model)
        torch.manual_seed(3)  # the same adapter init either way
        model = peft.get_peft_model(model, peft.LoraConfig(**cfg))
        if patched and not patch_first:
            tigon.patch(model)
        return model

    model, ref = build(True), build(False)
    ids, labels = batch()
    before = op_calls("qk_norm_rope")
    loss, grads = _loss_and_grads(model, ids, labels)
    assert op_calls("qk_norm_rope") - before == 2
    ref_loss, ref_grads = _loss_and_grads(ref, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and any("lora_A" in n for n in grads)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_qwen3_moe_fuses():
    hf = tiny_model("qwen3_moe")
    _norm_weights_off_one(hf)
    model = copy.deepcopy(hf)
    report = tigon.patch(model)
    assert report.replaced["Qwen3MoeAttention q/k norms + RoPE in one kernel (this instance)"] == 2, str(report)
    ids, labels = batch()
    loss, grads = _loss_and_grads(model, ids, labels)
    ref_loss, ref_grads = _loss_and_grads(hf, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


CLASS_FUSED = "Qwen3Attention.forward (q/k norms + RoPE in one kernel)"


@pytest.mark.parametrize("then_instance", [False, True], ids=["class", "class_then_instance"])
def test_class_level_patch_fuses_models_built_after(then_instance, device):
    """tigon.patch(model_type="qwen3") (Liger's apply_liger_kernel_to_qwen3 path, before the model is built): every
    Qwen3 built afterwards runs its q/k norms and RoPE as one kernel, trains and generates as HF's, also with an
    instance patch on top (the Trainer's); transformers' forward stays readable for the decode wing; unpatch
    restores it."""
    from transformers.models.qwen3 import modeling_qwen3

    cls = modeling_qwen3.Qwen3Attention
    hf_forward = cls.forward
    ref = tiny_model("qwen3").to(device)
    _norm_weights_off_one(ref)
    report = tigon.patch(model_type="qwen3")
    try:
        assert report.replaced[CLASS_FUSED] == 1, str(report)
        model = tiny_model("qwen3").to(device)
        model.load_state_dict(ref.state_dict())
        if then_instance:
            tigon.patch(model)
        attn = model.model.layers[0].self_attn
        assert forward_source.hf_class_forward(cls) is hf_forward and forward_source.has_qk_norm(attn)
        ids, labels = (t.to(device) for t in batch())
        before = op_calls("qk_norm_rope")
        loss, grads = _loss_and_grads(model, ids, labels)
        assert op_calls("qk_norm_rope") - before == 2
        ref_loss, ref_grads = _loss_and_grads(ref, ids, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
        with torch.no_grad():
            out = model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False, pad_token_id=0)
            assert torch.equal(out, ref.generate(ids[:1, :5], max_new_tokens=3, do_sample=False, pad_token_id=0))
        # HF's norms put back behind the patch's back: transformers' forward, same loss
        for layer, ref_layer in zip(model.model.layers, ref.model.layers):
            layer.self_attn.q_norm, layer.self_attn.k_norm = ref_layer.self_attn.q_norm, ref_layer.self_attn.k_norm
        before = op_calls("qk_norm_rope")
        torch.testing.assert_close(_loss_and_grads(model, ids, labels)[0], ref_loss, rtol=1e-5, atol=1e-5)
        assert op_calls("qk_norm_rope") == before
    finally:
        tigon.unpatch(model_type="qwen3")
    assert cls.forward is hf_forward


def test_class_level_patch_without_tigon_norms_keeps_the_forward():
    from transformers.models.qwen3 import modeling_qwen3

    hf_forward = modeling_qwen3.Qwen3Attention.forward
    report = tigon.patch(model_type="qwen3", rms_norm=False)
    try:
        assert (CLASS_FUSED, "rms_norm=False") in report.skipped and CLASS_FUSED not in report.replaced
        assert modeling_qwen3.Qwen3Attention.forward is hf_forward
    finally:
        tigon.unpatch(model_type="qwen3")
    llama = tigon.patch(model_type="llama")  # no q/k norms: nothing to fuse, nothing said
    tigon.unpatch(model_type="llama")
    assert not any("q/k norms" in piece for piece in [*llama.replaced, *(p for p, _ in llama.skipped)])


def test_class_level_patch_compiles_fullgraph():
    """The class forward is a closure over transformers' forward: torch.compile(fullgraph=True) traces it."""
    ref = tiny_model("qwen3")
    _norm_weights_off_one(ref)
    tigon.patch(model_type="qwen3")
    try:
        model = tiny_model("qwen3")
        model.load_state_dict(ref.state_dict())
        ids, labels = batch()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        loss = compiled(ids, labels=labels).loss
        loss.backward()
    finally:
        tigon.unpatch(model_type="qwen3")
    torch.testing.assert_close(loss.detach(), ref(ids, labels=labels).loss.detach(), rtol=1e-5, atol=1e-5)


def test_instance_patch_then_class_level_patch():
    """An instance fused first, then the class patched: the instance's forward still reads transformers' module
    (its attention functions), not the class-level closure's."""
    hf = tiny_model("qwen3")
    _norm_weights_off_one(hf)
    model = copy.deepcopy(hf)
    tigon.patch(model)
    tigon.patch(model_type="qwen3")
    try:
        ids, labels = batch()
        before = op_calls("qk_norm_rope")
        loss, _ = _loss_and_grads(model, ids, labels)
        assert op_calls("qk_norm_rope") - before == 2
    finally:
        tigon.unpatch(model_type="qwen3")
        tigon.unpatch(model)
    torch.testing.assert_close(loss, _loss_and_grads(hf, ids, labels)[0], rtol=1e-5, atol=1e-5)


def test_class_level_patched_qwen3_through_tigon_generate():
    """The decode wing on a class-patched Qwen3: the direct prefill and the RoPE-on-write decode steps read
    transformers' forward for the Llama-form check (the class forward is Tigon's closure); greedy tokens are HF's."""
    from tigon.decode import loop as gen

    ref = tiny_model("qwen3").eval()
    _norm_weights_off_one(ref)
    ids = batch()[0][:1, :6]
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    tigon.patch(model_type="qwen3")
    try:
        model = tiny_model("qwen3").eval()
        model.load_state_dict(ref.state_dict())
        model.generation_config.eos_token_id = None
        assert forward_source.has_qk_norm(model.model.layers[0].self_attn)
        before = op_calls("decode_attention"), op_calls("rope_kv_append")
        got, stats = gen.generate(model, ids, max_new_tokens=3, return_stats=True)
        steps = op_calls("decode_attention") - before[0]
        assert steps == 2 * 2 and op_calls("rope_kv_append") - before[1] >= steps  # both layers' decode steps
    finally:
        tigon.unpatch(model_type="qwen3")
    assert stats["attention"] == "tigon" and torch.equal(got, want)
