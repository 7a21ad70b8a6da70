import copy
import importlib

import pytest
import torch

import tigon
from tests.hf._tiny import batch, tiny_model
from tigon.hf import registry

FAMILIES = sorted(registry.FAMILIES)
# The families that fit in CI time on the interpreter; every row still gets its norm checked below.
TRAINED = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma", "gemma2", "gemma3_text", "phi3",
           "olmo2", "glm4"]


def _close(a, b, name, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_norm_row_matches_the_hf_class(model_type):
    """The (casting, offset) in the table is the formula the HF class computes, in bf16."""
    from tigon.ops import reference

    fam = registry.FAMILIES[model_type]
    modeling = importlib.import_module(fam.modeling)
    for name, (mode, offset) in fam.norm_classes.items():
        hf_cls = getattr(modeling, name)
        norm = hf_cls(48, eps=1e-6).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.normal_(0.0, 1.0)
        x = torch.randn(5, 48).to(torch.bfloat16)
        ours = reference.rms_norm(x, norm.weight, 1e-6, offset=offset, casting_mode=mode)
        torch.testing.assert_close(ours, norm(x), rtol=2**-7, atol=2**-7 * ours.abs().max().item())


@pytest.mark.parametrize("model_type", [m for m in FAMILIES if registry.FAMILIES[m].prenorm_layer])
def test_prenorm_rows_have_llamas_decoder_layer(model_type):
    """A family flagged prenorm_layer gets the fused decoder forward: its HF forward must be Llama's."""
    import inspect

    def body(model_type):
        fam = registry.FAMILIES[model_type]
        src = inspect.getsource(getattr(importlib.import_module(fam.modeling), fam.decoder_layer_class).forward)
        return src[src.index("residual = hidden_states"):]

    assert body(model_type) == body("llama")


def _train_and_record(m, ids, labels):
    """Eval logits, training loss and grads, then parameters after 5 AdamW steps."""
    m.eval()
    with torch.no_grad():
        logits = m(ids).logits
    m.train()
    out = m(ids, labels=labels)
    out.loss.backward()
    first = (logits, out.logits, out.loss.detach(), [p.grad.clone() if p.grad is not None else None
                                                     for p in m.parameters()])
    # eps 1e-6: a gradient that is zero in exact math (GLM's unrotated k bias) is rounding noise of ~1e-9
    # in both runs, and Adam with eps 1e-8 would turn that noise into full-size, opposite steps.
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6)
    for _step in range(5):
        opt.zero_grad()
        m(ids, labels=labels).loss.backward()
        opt.step()
    return first, [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("model_type", TRAINED)
def test_patched_matches_unpatched(model_type):
    ref = tiny_model(model_type)
    model = copy.deepcopy(ref)
    ids, labels = batch(model.config.vocab_size)
    # The unpatched run goes first: an instance patch swaps the family's RoPE function module-wide.
    (logits_ref, _, loss_ref, grads_ref), params_ref = _train_and_record(ref, ids, labels)
    report = tigon.patch(model)
    assert sum(report.replaced.values()) > 0
    assert model.state_dict().keys() == ref.state_dict().keys()
    (logits, train_logits, loss, grads), params = _train_and_record(model, ids, labels)

    _close(logits, logits_ref, "eval logits")
    assert train_logits is None, "training with labels must not build logits"
    _close(loss, loss_ref, "loss")
    for (name, _), g, g_ref in zip(model.named_parameters(), grads, grads_ref):
        if g_ref is not None:
            _close(g, g_ref, f"grad {name}", rtol=1e-3, atol=1e-5)
    for (name, _), p, p_ref in zip(model.named_parameters(), params, params_ref):
        # Adam turns a near-zero gradient (1e-8) into a full-size step: atol is a tenth of lr
        _close(p, p_ref, f"param {name} after 5 AdamW steps", rtol=1e-4, atol=1e-4)

    tigon.unpatch(model)
    assert all(type(a) is type(b) for a, b in zip(model.modules(), ref.modules()))
    assert "forward" not in model.__dict__


def test_patch_is_idempotent_and_counts_pieces():
    model = tiny_model("llama")
    first = tigon.patch(model)
    again = tigon.patch(model)
    assert first.replaced["RMSNorm LlamaRMSNorm"] == 2 * 2 + 1
    assert first.replaced["SwiGLUMLP LlamaMLP"] == 2
    assert "RMSNorm LlamaRMSNorm" not in again.replaced  # nothing left to replace
    assert "LlamaRMSNorm" in str(first)
    tigon.unpatch(model)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"


def test_class_level_patch_then_from_config():
    from transformers.models.qwen3 import modeling_qwen3

    original_norm, original_rope = modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.apply_rotary_pos_emb
    ref = tiny_model("qwen3")
    report = tigon.patch(model_type="qwen3")
    try:
        model = tiny_model("qwen3")
        assert type(model.model.norm).__name__ == "TigonQwen3RMSNorm"
        assert type(model.model.layers[0].mlp).__name__ == "SwiGLUMLP"
        assert report.replaced["function apply_rotary_pos_emb"] == 1
        model.load_state_dict(ref.state_dict())
        ids, labels = batch()
        model.train(), ref.train()
        _close(model(ids, labels=labels).loss, ref(ids, labels=labels).loss, "loss")
    finally:
        tigon.unpatch()
    assert modeling_qwen3.Qwen3RMSNorm is original_norm
    assert modeling_qwen3.apply_rotary_pos_emb is original_rope
    assert type(tiny_model("qwen3").model.norm) is original_norm


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match="llama"):
        tigon.patch(model_type="no_such_model")


def test_num_items_in_batch_gradient_accumulation_equals_full_batch():
    model = tiny_model("llama")
    tigon.patch(model)
    model.train()
    ids, labels = batch(b=4, t=6)
    n_items = (labels[:, 1:] != -100).sum()
    full = model(ids, labels=labels).loss
    (g_full,) = torch.autograd.grad(full, model.lm_head.weight)
    halves = [model(ids[i:i + 2], labels=labels[i:i + 2], num_items_in_batch=n_items).loss for i in (0, 2)]
    _close(halves[0] + halves[1], full, "accumulated loss")
    (g_acc,) = torch.autograd.grad(halves[0] + halves[1], model.lm_head.weight)
    _close(g_acc, g_full, "accumulated grad")


def test_logits_to_keep_and_shift_labels_follow_hf():
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    tigon.patch(model)
    model.train(), ref.train()
    ids, labels = batch()
    shift = torch.roll(labels, 1, dims=1)  # not the usual shift, so the test sees which one is used
    _close(model(ids, labels=labels, shift_labels=shift).loss, ref(ids, labels=labels, shift_labels=shift).loss,
           "shift_labels loss")
    model.eval(), ref.eval()
    with torch.no_grad():
        _close(model(ids, logits_to_keep=1).logits, ref(ids, logits_to_keep=1).logits, "logits_to_keep")


def test_tied_embeddings_get_one_gradient():
    ref = tiny_model("llama", tie_word_embeddings=True)
    model = copy.deepcopy(ref)
    tigon.patch(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.train(), ref.train()
    ids, labels = batch()
    model(ids, labels=labels).loss.backward()
    ref(ids, labels=labels).loss.backward()
    _close(model.lm_head.weight.grad, ref.lm_head.weight.grad, "tied grad", rtol=1e-3, atol=1e-5)
