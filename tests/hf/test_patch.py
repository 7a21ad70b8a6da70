import copy
import importlib
import inspect
import io

import pytest
import torch

import tigon
from tests.hf._tiny import batch, kernel_funcs_set_aside, op_calls, tiny_model
from tigon import ops
from tigon.hf import registry
from tigon.modules import RMSNorm, SwiGLUMLP

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


def _train_and_record(m, ids, labels, steps):
    """Eval logits, training loss and grads, then parameters after `steps` AdamW steps (the first step takes the
    grads just recorded: the same parameters and batch, and the kernels are deterministic, give the same grads
    again, so a fresh forward+backward for it would only cost another interpreted pass)."""
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
    opt.step()
    for _step in range(steps - 1):
        opt.zero_grad()
        m(ids, labels=labels).loss.backward()
        opt.step()
    return first, [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("model_type", TRAINED)
def test_patched_matches_unpatched(model_type):
    # Llama keeps the tiny model's two layers (the instance patch reaches every layer); the others take the
    # class-level test's one layer (_ONE_LAYER: Qwen3-MoE's dense-MLP layer; its sparse block is HF's own, trained
    # patched in test_registry_families' router-logits test, as Mixtral's here): a layer costs its launches again
    ref = tiny_model(model_type, **({} if model_type == "llama" else
                                    {"num_hidden_layers": 1, **_ONE_LAYER.get(model_type, {})}))
    model = copy.deepcopy(ref)
    ids, labels = batch(model.config.vocab_size)
    (logits_ref, _, loss_ref, grads_ref), params_ref = _train_and_record(ref, ids, labels, steps=2)
    report = tigon.patch(model)
    assert sum(report.replaced.values()) > 0
    assert model.state_dict().keys() == ref.state_dict().keys()
    (logits, train_logits, loss, grads), params = _train_and_record(model, ids, labels, steps=2)

    _close(logits, logits_ref, "eval logits")
    assert train_logits is None, "training with labels must not build logits"
    _close(loss, loss_ref, "loss")
    for (name, _), g, g_ref in zip(model.named_parameters(), grads, grads_ref):
        if g_ref is not None:
            _close(g, g_ref, f"grad {name}", rtol=1e-3, atol=1e-5)
    for (name, _), p, p_ref in zip(model.named_parameters(), params, params_ref):
        # Adam turns a near-zero gradient (1e-8) into a full-size step: atol is a tenth of lr
        _close(p, p_ref, f"param {name} after 2 AdamW steps", rtol=1e-4, atol=1e-4)

    tigon.unpatch(model)
    assert all(type(a) is type(b) for a, b in zip(model.modules(), ref.modules()))
    assert not _instance_attributes(model)


def _instance_attributes(model):
    """What patch() may set on a module instance and unpatch() must take away."""
    return [(type(m).__name__, k) for m in model.modules() for k in m.__dict__
            if k == "forward" or k.startswith("_tigon")]


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
        assert modeling_qwen3.Qwen3RMSNorm.__name__ == "TigonQwen3RMSNorm"
        assert type(model.model.norm) is RMSNorm and type(model.model.layers[0].mlp) is SwiGLUMLP
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
    model = tiny_model("llama", num_hidden_layers=1)
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


def test_completion_only_labels_run_the_loss_gemms_on_the_kept_rows(monkeypatch, device):
    """Prompt tokens labelled -100 (completion-only SFT) cost the patched model's loss nothing: its fused loss
    drops them before the lm_head GEMMs, with the loss and gradients of the unpatched model. On the device the
    kernels run on (the interpreter's CPU, or the GPU), where the fused loss's launches are seen."""
    ref = tiny_model("llama", num_hidden_layers=1).to(device)
    model = copy.deepcopy(ref)
    tigon.patch(model)
    ref.train(), model.train()
    ids, labels = (t.to(device) for t in batch(b=3, t=9))
    labels[:, :5] = -100  # the prompt
    kept = int((labels[:, 1:] != -100).sum())
    flce = importlib.import_module("tigon.ops.linear_cross_entropy")
    rows, launch = [], flce._fwd_launch
    monkeypatch.setattr(flce, "_fwd_launch", lambda h, *a: rows.append(h.shape[0]) or launch(h, *a))
    loss = model(ids, labels=labels).loss
    loss_ref = ref(ids, labels=labels).loss
    assert rows == [kept] and kept < ids.numel()
    _close(loss, loss_ref, "loss")
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for name, g, g_ref in zip(names, grads, torch.autograd.grad(loss_ref, list(ref.parameters()))):
        _close(g, g_ref, name)


def test_logits_to_keep_and_shift_labels_follow_hf():
    ref = tiny_model("llama", num_hidden_layers=1)
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
    ref = tiny_model("llama", num_hidden_layers=1, tie_word_embeddings=True)
    model = copy.deepcopy(ref)
    tigon.patch(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.train(), ref.train()
    ids, labels = batch()
    model(ids, labels=labels).loss.backward()
    ref(ids, labels=labels).loss.backward()
    _close(model.lm_head.weight.grad, ref.lm_head.weight.grad, "tied grad", rtol=1e-3, atol=1e-5)


# --- class level: the stand-in classes take the HF constructors' arguments, for every family -----------------

def _hf_classes(fam):
    modeling = importlib.import_module(fam.modeling)
    names = [*fam.norm_classes, *fam.mlp_class_names]
    return modeling, {n: getattr(modeling, n) for n in names if hasattr(modeling, n)}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stand_in_classes_take_the_hf_constructor_arguments(model_type):
    fam = registry.FAMILIES[model_type]
    modeling, originals = _hf_classes(fam)
    tigon.patch(model_type=model_type)
    try:
        for name, hf_cls in originals.items():
            stand_in = getattr(modeling, name)
            assert stand_in is not hf_cls and inspect.signature(stand_in) == inspect.signature(hf_cls), name
        for name in fam.norm_classes:
            params = inspect.signature(originals[name]).parameters
            size = next(iter(params))  # hidden_size, or Gemma's dim
            norm = getattr(modeling, name)(**{size: 8})
            assert type(norm) is RMSNorm and norm.weight.shape == (8,) and norm.eps == params["eps"].default
            assert getattr(modeling, name)(8, eps=1e-3).eps == 1e-3
            with pytest.raises(TypeError, match=name):
                getattr(modeling, name)(8, 1e-3, 1)
    finally:
        tigon.unpatch(model_type=model_type)
    assert all(getattr(modeling, n) is c for n, c in originals.items())


def _two_steps(m, ids, labels):
    """Eval logits, one forward+backward and AdamW step, then the training loss on the stepped parameters:
    (logits, the two losses, the grads, the parameters after the step). The second loss proves the Tigon modules
    read the updated Parameters; it runs under no_grad, as a second backward would only repeat the first's
    kernels on other numbers (the interpreter's cost is per launch)."""
    m.eval()
    with torch.no_grad():
        logits = m(ids).logits
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6)  # eps: see _train_and_record
    loss = m(ids, labels=labels).loss
    loss.backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
    opt.step()
    with torch.no_grad():
        stepped = m(ids, labels=labels).loss
    return logits, [loss.detach(), stepped], grads, [p.detach().clone() for p in m.parameters()]


# qwen3_moe's dense-MLP layer is layer 1 in the two-layer tiny model; with one layer, make it layer 0.
# qwen3_next alternates a gated-DeltaNet and an attention layer: it keeps its two.
_ONE_LAYER = {"qwen3_moe": dict(mlp_only_layers=[0]), "qwen3_next": dict(num_hidden_layers=2)}
# deepseek_v4's hyper-connection weights (attn_hc.fn) get gradients at fp32 rounding level (~1e-6), which Adam
# turns into steps of up to a fifth of lr that differ between two summation orders: a fifth of lr, not a tenth
_PARAM_ATOL = {"deepseek_v4": 2e-4}


@pytest.mark.parametrize("model_type", [pytest.param(m, id=m) for m in FAMILIES])
def test_class_level_patch_builds_and_trains_every_family(model_type):
    """A model built with the family's class-level patch active: Tigon modules, the same initialization, the
    same logits, losses, grads and AdamW steps as HF's; unpatch(model_type=) restores the module. One layer,
    five tokens and three passes (one of them a backward) keep it to a few seconds a family under the
    interpreter."""
    fam = registry.FAMILIES[model_type]
    modeling, originals = _hf_classes(fam)
    before = dict(vars(modeling))
    classes = [getattr(modeling, n, None) for n in (fam.decoder_layer_class, fam.causal_lm_class)]
    forwards = [c.__dict__.get("forward") for c in classes if c is not None]
    overrides = {"num_hidden_layers": 1, **_ONE_LAYER.get(model_type, {})}
    ref = tiny_model(model_type, **overrides)
    tigon.patch(model_type=model_type)
    try:
        model = tiny_model(model_type, **overrides)
        names = {type(m).__name__ for m in model.modules()}
        assert ("RMSNorm" in names or not fam.norm_classes) and not names & set(fam.norm_classes)  # Nemotron: none
        if fam.mlp and not registry.mlp_kept(fam, model.config):
            assert not names & set(fam.mlp_class_names)
        state, state_ref = model.state_dict(), ref.state_dict()
        assert state.keys() == state_ref.keys()
        for k in state:
            assert torch.equal(state[k], state_ref[k]), f"{k} is initialized differently"
        ids, labels = batch(model.config.vocab_size, b=1, t=5, ignore_tail=1)
        logits_ref, losses_ref, grads_ref, params_ref = _two_steps(ref, ids, labels)
        logits, losses, grads, params = _two_steps(model, ids, labels)
    finally:
        tigon.unpatch(model_type=model_type)
    _close(logits, logits_ref, "eval logits")
    _close(losses[0], losses_ref[0], "loss")
    _close(losses[1], losses_ref[1], "loss after an AdamW step")
    for (name, _), g, g_ref in zip(model.named_parameters(), grads, grads_ref):
        if g_ref is not None:
            _close(g, g_ref, f"grad {name}", rtol=1e-3, atol=1e-5)
    for (name, _), p, p_ref in zip(model.named_parameters(), params, params_ref):
        _close(p, p_ref, f"param {name} after an AdamW step", rtol=1e-4, atol=_PARAM_ATOL.get(model_type, 1e-4))
    assert all(vars(modeling)[k] is v for k, v in before.items())
    assert [c.__dict__.get("forward") for c in classes if c is not None] == forwards
    rebuilt = tiny_model(model_type, **overrides)
    assert [type(m) for m in rebuilt.modules()] == [type(m) for m in ref.modules()]


def test_patch_logs_its_report_at_info(caplog):
    """Every patch() call logs its report to the "tigon" logger at INFO, whatever TIGON_LOG says: the logger's
    level (TIGON_LOG's handler, or the application's logging config) decides whether it shows."""
    model = tiny_model("llama", num_hidden_layers=1)
    with caplog.at_level("INFO", logger="tigon"):
        report = tigon.patch(model)
    tigon.unpatch(model)
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records if r.name == "tigon"] == \
        [("tigon", "INFO", str(report))]


def test_class_level_cross_entropy_is_a_loss_function_property():
    """cross_entropy=True, class-level: the ForCausalLM's loss_function is Tigon's (an instance's own still wins),
    and unpatch leaves the class as it was (HF's property inherited from PreTrainedModel)."""
    from transformers.models.llama import modeling_llama

    cls = modeling_llama.LlamaForCausalLM
    assert "loss_function" not in vars(cls)
    report = tigon.patch(model_type="llama", cross_entropy=True, fused_linear_cross_entropy=False)
    try:
        assert report.replaced["LlamaForCausalLM.loss_function (cross_entropy)"] == 1
        tigon.patch(model_type="llama", cross_entropy=True, fused_linear_cross_entropy=False)  # idempotent
        model = tiny_model("llama", num_hidden_layers=1)
        assert model.loss_function is tigon.hf.causal_lm.causal_lm_loss
        ids, labels = batch(model.config.vocab_size, b=1, t=5)
        ops.dispatch_counts.clear()
        model.train()(input_ids=ids, labels=labels).loss.backward()
        assert op_calls("cross_entropy") == 1
        own = object()
        model.loss_function = own
        assert model.loss_function is own
    finally:
        tigon.unpatch(model_type="llama")
    assert "loss_function" not in vars(cls)
    assert tiny_model("llama", num_hidden_layers=1).loss_function is not tigon.hf.causal_lm.causal_lm_loss


def test_mlp_with_its_own_dropout_stays_hf():
    """Seed-OSS's MLP applies residual_dropout to its output in training; Tigon's has no dropout."""
    model = tiny_model("seed_oss", residual_dropout=0.1)
    report = tigon.patch(model)
    assert type(model.model.layers[0].mlp).__name__ == "SeedOssMLP"
    assert ("MLP SeedOssMLP", "the MLP applies residual_dropout=0.1 to its output in training") in report.skipped
    tigon.unpatch(model)
    tigon.patch(model_type="seed_oss")
    try:
        assert type(tiny_model("seed_oss", residual_dropout=0.1).model.layers[0].mlp).__name__ == "SeedOssMLP"
        assert type(tiny_model("seed_oss").model.layers[0].mlp) is SwiGLUMLP
    finally:
        tigon.unpatch(model_type="seed_oss")


# --- instance level: that instance only --------------------------------------------------------------------

def _rope_calls(model, ids):
    """apply_rope dispatches in one eval forward (one per attention layer where Tigon's RoPE runs)."""
    start = op_calls("apply_rope")
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits
    return op_calls("apply_rope") - start, logits


def test_instance_patch_touches_only_that_instance():
    from transformers.models.llama import modeling_llama

    hf_rope = modeling_llama.apply_rotary_pos_emb
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    b_ref = copy.deepcopy(b)
    ids, _ = batch()
    tigon.patch(a)
    assert modeling_llama.apply_rotary_pos_emb is hf_rope
    assert _rope_calls(a, ids)[0] == 2
    calls, logits = _rope_calls(b, ids)
    assert calls == 0 and torch.equal(logits, _rope_calls(b_ref, ids)[1]), "b, unpatched, runs HF's forward"
    tigon.patch(b)
    tigon.unpatch(a)
    assert _rope_calls(a, ids)[0] == 0 and _rope_calls(b, ids)[0] == 2, "unpatch(a) leaves b fused"
    assert not _instance_attributes(a)
    tigon.unpatch(b)
    calls, logits = _rope_calls(b, ids)
    assert calls == 0 and torch.equal(logits, _rope_calls(b_ref, ids)[1]) and not _instance_attributes(b)
    assert modeling_llama.apply_rotary_pos_emb is hf_rope


def test_class_level_patch_is_module_wide_and_unpatches_per_family():
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    hf_llama_rope, hf_qwen3_rope = modeling_llama.apply_rotary_pos_emb, modeling_qwen3.apply_rotary_pos_emb
    built_before = tiny_model("llama", num_hidden_layers=1)
    ids, _ = batch()
    tigon.patch(model_type="llama")
    tigon.patch(model_type="qwen3")
    try:
        assert _rope_calls(built_before, ids)[0] == 1, "the module's function: every model of the family"
        built_after = tiny_model("llama", num_hidden_layers=1)
        assert _rope_calls(built_after, ids)[0] == 1 and type(built_after.model.norm) is RMSNorm
        tigon.unpatch(model_type="llama")
        assert modeling_llama.apply_rotary_pos_emb is hf_llama_rope and _rope_calls(built_before, ids)[0] == 0
        assert getattr(modeling_qwen3.apply_rotary_pos_emb, "__tigon__", False), "qwen3 stays patched"
        tigon.unpatch(model_type="llama")  # nothing left to restore: a no-op
    finally:
        tigon.unpatch()
    assert modeling_qwen3.apply_rotary_pos_emb is hf_qwen3_rope


def _save_and_load(model):
    f = io.BytesIO()
    with kernel_funcs_set_aside(model):
        torch.save(model, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copy_of_a_patched_model_is_patched_and_unpatches_alone(how):
    """TRL builds its reference model with copy.deepcopy of the policy; checkpoints torch.save whole models."""
    ref = tiny_model("llama", num_hidden_layers=1)
    model = copy.deepcopy(ref)
    tigon.patch(model, attention=True)
    twin = copy.deepcopy(model) if how == "deepcopy" else _save_and_load(model)
    assert type(twin.model.norm) is RMSNorm and type(twin.model.layers[0].mlp) is SwiGLUMLP
    assert twin.model.norm.weight is not model.model.norm.weight
    assert twin.config._attn_implementation == "tigon"
    ids, labels = batch(b=1, t=6, ignore_tail=1)
    assert _rope_calls(twin, ids)[0] == 1
    # one AdamW step each: a second would rerun the same attention kernels on both
    (logits, train_logits, loss, grads), params = _train_and_record(model, ids, labels, steps=1)
    (logits_t, train_logits_t, loss_t, grads_t), params_t = _train_and_record(twin, ids, labels, steps=1)
    assert train_logits is None and train_logits_t is None, "the copy computes the fused loss too"
    assert torch.equal(logits_t, logits) and torch.equal(loss_t, loss)
    assert all(torch.equal(a, b) for a, b in zip(grads_t, grads) if a is not None)
    assert all(torch.equal(a, b) for a, b in zip(params_t, params))

    _, trained = _rope_calls(twin, ids)
    tigon.unpatch(twin)
    assert all(type(a) is type(b) for a, b in zip(twin.modules(), ref.modules())) and not _instance_attributes(twin)
    assert twin.config._attn_implementation == "eager"
    calls, restored = _rope_calls(twin, ids)
    assert calls == 0
    _close(restored, trained, "the restored HF modules hold the trained Parameters")
    assert type(model.model.norm) is RMSNorm and _rope_calls(model, ids)[0] == 1, "the original stays patched"
    assert model.config._attn_implementation == "tigon"
    tigon.unpatch(model)
    assert not _instance_attributes(model)


# --- bad arguments: a TypeError or ValueError that names the function and the argument ----------------------

def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))


def _llama_class():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


BAD_CALLS = {
    "patch(123)": (lambda m: tigon.patch(123), TypeError,
                   r"tigon\.patch: `model` must be a torch\.nn\.Module .*got int"),
    "patch('llama')": (lambda m: tigon.patch("llama"), TypeError, r"pass model_type='llama'"),
    "patch(a class)": (lambda m: tigon.patch(_llama_class()), TypeError, r"got the class LlamaForCausalLM"),
    "patch(a config)": (lambda m: tigon.patch(m.config), TypeError, r"a config\); .*pass model_type=config"),
    "patch(non-HF module)": (lambda m: tigon.patch(torch.nn.Linear(2, 2)), TypeError,
                             r"tigon\.patch: `model` \(Linear\) holds no transformers model"),
    "patch(unsupported family)": (lambda m: tigon.patch(_gpt2()), ValueError,
                                  r"tigon\.patch: the model's config\.model_type 'gpt2' is not supported"),
    "patch()": (lambda m: tigon.patch(), ValueError, r"tigon\.patch: pass a model .* or model_type="),
    "patch(model, model_type=)": (lambda m: tigon.patch(m, model_type="llama"), ValueError,
                                  r"tigon\.patch: pass a model or model_type=, not both"),
    "patch(model_type=typo)": (lambda m: tigon.patch(model_type="gemma3"), ValueError,
                               r"tigon\.patch: model_type 'gemma3' is not supported \(did you mean .*'gemma3_text'"),
    "patch(model_type=3)": (lambda m: tigon.patch(model_type=3), TypeError,
                            r"tigon\.patch: model_type must be a string .*got int"),
    "patch(model_type=model)": (lambda m: tigon.patch(model_type=m), TypeError,
                                r"pass a model as the first argument"),
    "patch(rope='yes')": (lambda m: tigon.patch(m, rope="yes"), TypeError,
                          r"tigon\.patch: rope must be True or False, got 'yes'"),
    "unpatch(123)": (lambda m: tigon.unpatch(123), TypeError, r"tigon\.unpatch: `model` must be a torch\.nn\.Module"),
    "unpatch(non-HF module)": (lambda m: tigon.unpatch(torch.nn.Linear(2, 2)), TypeError,
                               r"tigon\.unpatch: `model` \(Linear\) holds no transformers model"),
    "unpatch(model, model_type=)": (lambda m: tigon.unpatch(m, model_type="llama"), ValueError,
                                    r"tigon\.unpatch: pass a model or model_type=, not both"),
    "unpatch(model_type=typo)": (lambda m: tigon.unpatch(model_type="lama"), ValueError,
                                 r"tigon\.unpatch: model_type 'lama' is not supported \(did you mean 'llama'"),
    "unpatch(model_type=3.0)": (lambda m: tigon.unpatch(model_type=3.0), TypeError,
                                r"tigon\.unpatch: model_type must be a string"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_arguments_name_the_function_and_the_argument(case):
    call, error, match = BAD_CALLS[case]
    model = tiny_model("llama", num_hidden_layers=1)
    with pytest.raises(error, match=match):
        call(model)
    assert not _instance_attributes(model), "a refused call patches nothing"


def test_rope_routing_and_the_tigon_attention_share_one_instance_forward():
    from tigon.hf.attention import restore_attention, use_tigon_attention

    model = tiny_model("llama", attn_implementation="sdpa")
    attn = model.model.layers[0].self_attn
    tigon.patch(model)
    use_tigon_attention(model)
    restore_attention(model)
    assert "forward" in attn.__dict__ and attn.__dict__["_tigon_rope"], "the RoPE routing outlives the attention"
    use_tigon_attention(model)
    tigon.unpatch(model)
    assert not _instance_attributes(model) and model.config._attn_implementation == "sdpa"
    use_tigon_attention(model)  # the other order
    tigon.patch(model)
    tigon.unpatch(model)
    assert not _instance_attributes(model) and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("capability,name", [((7, 5), "Tesla T4"), ((7, 0), "Tesla V100-SXM2-16GB")])
def test_patch_refuses_a_gpu_older_than_the_supported_range(monkeypatch, capability, name):
    """A T4 or V100 gets a clear refusal naming the card and the supported range, never kernels nobody compiled."""
    from tigon.hf import patching

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(patching, "model_device", lambda hf: torch.device("cuda", 0))
    model = tiny_model("llama")
    major, minor = capability
    with pytest.raises(ValueError, match=rf"tigon.patch: {name} \(compute capability {major}\.{minor}\) is older "
                                         r"than the GPUs Tigon supports \(8\.0 to 9\.0"):
        tigon.patch(model)
    assert not model.__dict__.get("_tigon_undo")  # refused before anything was swapped
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    patching.check_gpu(torch.device("cuda", 0))  # an A100 passes
    patching.check_gpu(torch.device("cpu"))  # a CPU is never refused
