"""tigon.compat.liger: liger-kernel 0.8.5's API exactly (apply functions, the Trainer/axolotl entry points, the
Auto class, the module classes), honoured flag by flag, with Tigon's kernels counted as they run."""

import copy
import inspect
import logging

import pytest
import torch

import tigon
from tests.hf._tiny import batch, op_calls, tiny_config, tiny_model
from tigon import ops
from tigon.compat import liger
from tigon.hf import registry
from tigon.modules import GeGLUMLP, RMSNorm, SwiGLUMLP

try:  # liger-kernel itself, where installed: its signatures are the spec
    import liger_kernel.transformers as liger_kernel
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN as LIGER_FNS
except Exception:  # noqa: BLE001  (not installed, or it fails to import on this machine)
    liger_kernel = LIGER_FNS = None
needs_liger = pytest.mark.skipif(liger_kernel is None,
                                 reason="liger-kernel is not installed (pip install tigon[bench])")

# liger_kernel/transformers/monkey_patch.py of liger-kernel 0.8.5: (parameter, default) in order
LLAMA = [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
         ("swiglu", True), ("model", None)]
GEMMA = [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
         ("geglu", True), ("model", None)]
LIGER_0_8_5 = {
    **{f: LLAMA for f in ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3",
                          "smollm3", "exaone4", "hunyuan_v1_dense", "hunyuan_v1_moe", "olmo2", "olmo3", "qwen2_5_vl")},
    **{f: GEMMA for f in ("gemma", "gemma2", "gemma3_text")},
    "gemma3": GEMMA[:3] + [("layer_norm", True)] + GEMMA[3:],
    "paligemma": GEMMA[:3] + [("layer_norm", True)] + GEMMA[3:],
    "granite": [("rope", True), ("cross_entropy", True), ("fused_linear_cross_entropy", False), ("rms_norm", True),
                ("swiglu", True), ("model", None)],
    **{f: [("rope", False)] + LLAMA[1:] for f in ("glm4", "qwen3_5", "qwen3_next", "deepseek_v2", "deepseek_v3",
                                                   "glm4v_moe")},
    "deepseek_v4": [("rope", False)] + LLAMA[1:4] + [("swiglu", False), ("model", None)],
    "qwen3_vl_moe": LLAMA,
    "falcon_h1": LLAMA,
    "muse_glimmer": LLAMA[:3] + [("layer_norm", True)] + LLAMA[3:],
    "pixtral": [("rope", True), ("rms_norm", True), ("swiglu", True), ("model", None)],
    "nemotron": [("relu_squared", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True),
                 ("model", None), ("kwargs", "**")],
    "gpt_oss": LLAMA[:4] + [("swiglu", False), ("model", None)],
    "qwen3_vl": LLAMA[:4] + [("swiglu", False), ("model", None)],
    "llama4": LLAMA + [("layer_norm", True)],
    "qwen2_vl": LLAMA[:4] + [("layer_norm", True)] + LLAMA[4:],
    "mllama": LLAMA[:3] + [("layer_norm", True)] + LLAMA[3:],
    "llava": [("cross_entropy", False), ("fused_linear_cross_entropy", True), ("model", None), ("kwargs", "**")],
}


def _params(fn):
    return [(p.name, "**" if p.kind is p.VAR_KEYWORD else p.default)
            for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def calls(monkeypatch):
    """What the apply functions hand to tigon.patch, without patching anything."""
    seen = []
    monkeypatch.setattr(liger, "patch_hf_model", lambda model=None, **kw: seen.append((model, kw)) or "report")
    return seen


@pytest.mark.parametrize("family", sorted(LIGER_0_8_5))
def test_signature_is_liger_0_8_5s(family):
    fn = getattr(liger, f"apply_liger_kernel_to_{family}")
    assert _params(fn) == LIGER_0_8_5[family]
    assert fn.__name__ == f"apply_liger_kernel_to_{family}"


@needs_liger
def test_every_shared_model_type_has_liger_kernels_own_signature():
    shared = set(LIGER_FNS) & set(liger.MODEL_TYPE_TO_APPLY_LIGER_FN)
    assert len(shared) >= 51, sorted(shared)
    # every type liger-kernel 0.8.5 maps is Tigon's too
    assert set(LIGER_FNS) - shared == set()
    for model_type in sorted(shared):
        theirs, ours = LIGER_FNS[model_type], liger.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
        assert ours.__name__ == theirs.__name__, model_type
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), model_type
        assert [p.default for p in inspect.signature(ours).parameters.values()] == \
               [p.default for p in inspect.signature(theirs).parameters.values()], model_type


@needs_liger
def test_module_classes_have_liger_kernels_signatures():
    for name in ["LigerRMSNorm", "LigerFusedAddRMSNorm", "LigerLayerNorm", "LigerSwiGLUMLP", "LigerGEGLUMLP",
                 "LigerPhi3SwiGLUMLP", "LigerQwen3MoeSwiGLUMLP", "LigerBlockSparseTop2MLP", "LigerTiledSwiGLUMLP",
                 "LigerTiledGEGLUMLP", "LigerCrossEntropyLoss", "LigerFusedLinearCrossEntropyLoss"]:
        theirs, ours = getattr(liger_kernel, name), getattr(liger, name)
        for method in ("__init__", "forward"):
            assert list(inspect.signature(getattr(ours, method)).parameters) == \
                   list(inspect.signature(getattr(theirs, method)).parameters), f"{name}.{method}"
    assert list(inspect.signature(liger.liger_rotary_pos_emb).parameters) == \
           list(inspect.signature(liger_kernel.liger_rotary_pos_emb).parameters)


def test_every_tigon_family_has_a_strict_apply_function():
    for family in registry.FAMILIES:
        fn = liger.MODEL_TYPE_TO_APPLY_LIGER_FN[family]
        if _params(fn)[-1] == ("kwargs", "**"):  # Nemotron's, as Liger's: it takes and ignores any keyword
            continue
        assert _params(fn)[-1] in (("model", None), ("layer_norm", True))
        with pytest.raises(TypeError, match=f"{fn.__name__}\\(\\) got an unexpected keyword argument 'bogus'"):
            fn(bogus=True)


def test_a_misspelled_flag_is_a_type_error_and_patches_nothing(calls):
    with pytest.raises(TypeError, match=r"apply_liger_kernel_to_llama\(\) got an unexpected keyword argument "
                                        r"'rms_nrom' \(did you mean 'rms_norm'\?\)"):
        liger.apply_liger_kernel_to_llama(model=object(), rms_nrom=False)
    with pytest.raises(TypeError, match=r"apply_liger_kernel_to_gemma2\(\) got an unexpected keyword argument "
                                        r"'swiglu'.*takes rope, cross_entropy, fused_linear_cross_entropy, "
                                        r"rms_norm, geglu, model"):
        liger.apply_liger_kernel_to_gemma2(swiglu=False)
    with pytest.raises(TypeError, match=r"apply_liger_kernel_to_llama\(\) too many positional arguments"):
        liger.apply_liger_kernel_to_llama(True, False, True, True, True, None, True)
    with pytest.raises(TypeError, match=r"apply_liger_kernel_to_qwen3\(\) multiple values for argument 'rope'"):
        liger.apply_liger_kernel_to_qwen3(False, rope=True)
    assert calls == []


def test_flags_bind_like_liger_and_reach_tigon_patch(calls):
    model = object()
    liger.apply_liger_kernel_to_llama(False, False, True, False, True, model)  # positional, Liger's order
    assert calls[-1] == (model, dict(rope=False, cross_entropy=False, fused_linear_cross_entropy=True,
                                     rms_norm=False, swiglu=True, layer_norm=False))
    liger.apply_liger_kernel_to_gemma2(geglu=False)  # class-level; geglu is tigon.patch's swiglu flag
    assert calls[-1] == (None, dict(model_type="gemma2", rope=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, rms_norm=True, swiglu=False, layer_norm=False))
    with pytest.raises(ValueError, match="apply_liger_kernel_to_llama: cross_entropy and fused_linear_cross_entropy"):
        liger.apply_liger_kernel_to_llama(cross_entropy=True)
    assert len(calls) == 2


def test_geglu_false_leaves_gemmas_mlp_unfused_and_true_fuses_it():
    model = tiny_model("gemma", num_hidden_layers=1)
    report = liger.apply_liger_kernel_to_gemma(model=model, geglu=False)
    assert not any(isinstance(m, GeGLUMLP) for m in model.modules()) and type(model.model.layers[0].mlp).__name__ \
        == "GemmaMLP"
    assert report.replaced["RMSNorm GemmaRMSNorm"] == 3
    tigon.unpatch(model)
    liger.apply_liger_kernel_to_gemma(model=model)
    assert isinstance(model.model.layers[0].mlp, GeGLUMLP)
    tigon.unpatch(model)


def test_trainer_path_patches_the_instance_and_runs_tigon():
    """transformers.integrations.liger.apply_liger_kernel: _apply_liger_kernel_to_instance(model=m, **config)."""
    ref = tiny_model("llama", num_hidden_layers=1)
    model = copy.deepcopy(ref)
    # liger_kernel_config as users write it for any family: keys the llama function lacks are filtered out
    config = {"rope": True, "swiglu": True, "geglu": True, "layer_norm": True, "fused_linear_cross_entropy": True}
    report = liger._apply_liger_kernel_to_instance(model=model, **config)
    assert report.target == "instance" and report.replaced["LlamaForCausalLM.forward (fused loss)"] == 1
    assert isinstance(model.model.norm, RMSNorm) and isinstance(model.model.layers[0].mlp, SwiGLUMLP)
    ids, labels = batch(model.config.vocab_size, b=1, t=5)
    model.train()
    ref.train()
    ops.dispatch_counts.clear()
    loss = model(input_ids=ids, labels=labels).loss
    assert op_calls("linear_cross_entropy") == 1
    assert op_calls("rms_norm", "add_rms_norm") >= 3
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=labels).loss, rtol=2e-4, atol=2e-5)
    tigon.unpatch(model)


def test_instance_cross_entropy_flag_runs_tigons_cross_entropy():
    model = tiny_model("llama", num_hidden_layers=1)
    report = liger.apply_liger_kernel_to_llama(model=model, cross_entropy=True, fused_linear_cross_entropy=False)
    assert report.replaced["loss_function (cross_entropy)"] == 1
    ids, labels = batch(model.config.vocab_size, b=1, t=5)
    model.train()
    ops.dispatch_counts.clear()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and op_calls("cross_entropy") == 1
    tigon.unpatch(model)


def test_class_level_cross_entropy_gives_tigons_loss_and_unpatches():
    from transformers.models.llama import modeling_llama

    ref = tiny_model("llama", num_hidden_layers=1)
    report = liger.apply_liger_kernel_to_llama(cross_entropy=True, fused_linear_cross_entropy=False)
    try:
        assert report.replaced["LlamaForCausalLM.loss_function (cross_entropy)"] == 1
        model = tiny_model("llama", num_hidden_layers=1)
        ids, labels = batch(model.config.vocab_size, b=1, t=5)
        model.train()
        ops.dispatch_counts.clear()
        loss = model(input_ids=ids, labels=labels).loss
        assert op_calls("cross_entropy") == 1
        ref.train()
        torch.testing.assert_close(loss, ref(input_ids=ids, labels=labels).loss, rtol=2e-4, atol=2e-5)
    finally:
        tigon.unpatch(model_type="llama")
    ops.dispatch_counts.clear()
    tiny_model("llama", num_hidden_layers=1).train()(input_ids=ids, labels=labels)
    assert op_calls("cross_entropy") == 0
    assert "loss_function" not in vars(modeling_llama.LlamaForCausalLM) or \
        modeling_llama.LlamaForCausalLM.loss_function.fget is not liger._tigon_loss


def test_unsupported_model_type_warns_and_leaves_the_model_unless_strict(caplog):
    model = torch.nn.Linear(2, 2)  # any module whose config names a type Tigon has no row for
    model.config = tiny_config("llama")
    model.config.model_type = "not_a_family"
    with caplog.at_level(logging.WARNING, logger="tigon"):
        assert liger._apply_liger_kernel_to_instance(model=model, rope=True) is None
        assert liger._apply_liger_kernel("not_a_family", rope=True) is None
    assert caplog.text.count("Tigon has no kernels for model type 'not_a_family'") == 2
    with pytest.raises(ValueError, match="_apply_liger_kernel_to_instance: Tigon has no kernels for model type"):
        liger._apply_liger_kernel_to_instance(model=model, strict=True)
    with pytest.raises(ValueError, match="_apply_liger_kernel: Tigon has no kernels"):
        liger._apply_liger_kernel("not_a_family", strict=True)


def test_apply_liger_kernel_is_class_level_with_filtered_kwargs():
    report = liger._apply_liger_kernel("qwen2", rms_norm=True, swiglu=False, geglu=True, layer_norm=True)
    try:
        assert report.target == "class" and report.model_type == "qwen2"
        assert not any(piece.startswith("MLP class") for piece in report.replaced)
    finally:
        tigon.unpatch(model_type="qwen2")


def test_auto_class_hands_the_flags_to_the_familys_apply_function():
    model = liger.AutoLigerKernelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=1), rope=False,
                                                         rms_norm=False)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    assert isinstance(model.model.layers[0].mlp, SwiGLUMLP)
    gemma = liger.AutoLigerKernelForCausalLM.from_config(tiny_config("gemma2", num_hidden_layers=1), geglu=False)
    assert type(gemma.model.layers[0].mlp).__name__ == "Gemma2MLP"


def test_auto_class_from_pretrained(tmp_path):
    tiny_model("qwen2", num_hidden_layers=1).save_pretrained(tmp_path)
    model = liger.AutoLigerKernelForCausalLM.from_pretrained(tmp_path, swiglu=False, dtype=torch.float32)
    assert isinstance(model.model.norm, RMSNorm) and type(model.model.layers[0].mlp).__name__ == "Qwen2MLP"


def test_module_classes_compute_what_tigon_computes():
    from types import SimpleNamespace

    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=16, intermediate_size=24, hidden_act="silu")
    x = torch.randn(3, 5, 16, requires_grad=True)
    norm = liger.LigerRMSNorm(16, eps=1e-5, offset=1.0, casting_mode="gemma", init_fn="zeros")
    assert isinstance(norm, RMSNorm) and norm.weight.abs().sum() == 0 and norm.variance_epsilon == 1e-5
    torch.testing.assert_close(norm(x), ops.rms_norm(x, norm.weight, 1e-5, offset=1.0, casting_mode="gemma"))
    assert liger.LigerRMSNorm(16, elementwise_affine=False).weight is None
    ln = liger.LigerLayerNorm(16, eps=1e-5)
    assert ln.bias.abs().sum() == 0
    torch.testing.assert_close(ln(x), torch.nn.functional.layer_norm(x, (16,), ln.weight, ln.bias, 1e-5))
    y, s = liger.LigerFusedAddRMSNorm(16)(x, x)
    torch.testing.assert_close(s, 2 * x)
    mlp = liger.LigerSwiGLUMLP(cfg)
    ref = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)
    assert liger.LigerPhi3SwiGLUMLP(cfg).gate_up_proj.weight.shape == (48, 16)
    with pytest.raises(ValueError, match="LigerSwiGLUMLP: config.hidden_act must be one of"):
        liger.LigerSwiGLUMLP(SimpleNamespace(hidden_size=16, intermediate_size=24, hidden_act="relu"))
    top2 = liger.LigerBlockSparseTop2MLP(cfg)
    torch.testing.assert_close(top2(x), top2.w2(torch.nn.functional.silu(top2.w1(x)) * top2.w3(x)),
                               rtol=1e-5, atol=1e-5)
    logits, target = torch.randn(10, 33), torch.randint(0, 33, (10,))
    target[3] = -100
    ce = liger.LigerCrossEntropyLoss(lse_square_scale=0.0, label_smoothing=0.1, return_token_accuracy=True)
    out = ce(logits, target)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1))
    keep = target != -100
    assert out.token_accuracy == (logits.argmax(-1) == target)[keep].float().mean()
    h, w = torch.randn(10, 16), torch.randn(33, 16)
    flce = liger.LigerFusedLinearCrossEntropyLoss()
    torch.testing.assert_close(flce(w, h, target), torch.nn.functional.cross_entropy(h @ w.T, target),
                               rtol=1e-5, atol=1e-5)
    # the options Liger has beyond the loss work (values against Liger's own: tests/compat/test_liger_parity.py)
    fused = liger.LigerFusedLinearCrossEntropyLoss(return_token_accuracy=True)(w, h, target)
    assert fused.token_accuracy == ((h @ w.T).argmax(-1) == target)[keep].float().mean()
    torch.testing.assert_close(liger.LigerCrossEntropyLoss(weight=torch.ones(33))(logits, target),
                               torch.nn.functional.cross_entropy(logits, target))


def test_liger_rotary_pos_emb_takes_half_width_cos_sin():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    cos, sin = torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    full = liger.liger_rotary_pos_emb(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    half = liger.liger_rotary_pos_emb(q, k, cos, sin, rotary_dim=8)
    for a, b in zip(full, half):
        torch.testing.assert_close(a, b)


def test_every_public_name_resolves_and_the_chunked_losses_are_reexported():
    from tigon.compat import liger_chunked_loss

    assert all(hasattr(liger, name) for name in liger.__all__)
    for name in liger_chunked_loss.__all__:
        assert getattr(liger, name) is getattr(liger_chunked_loss, name)


def test_callback_with_an_unsupported_model_warns_and_trains_as_is_unless_strict(caplog):
    from tigon.hf.trainer import TigonCallback

    model = torch.nn.Linear(2, 2)
    model.config = tiny_config("llama")
    model.config.model_type = "not_a_family"
    callback = TigonCallback()
    with caplog.at_level(logging.WARNING, logger="tigon"):
        assert callback.on_train_begin(None, None, "control", model=model) == "control"
    assert callback.report is None and "TigonCallback: the model's config.model_type 'not_a_family'" in caplog.text
    with pytest.raises(ValueError, match="TigonCallback: the model's config.model_type 'not_a_family' is not"):
        TigonCallback(strict=True).on_train_begin(None, None, "control", model=model)
    llama = tiny_model("llama", num_hidden_layers=1)
    callback = TigonCallback(rope=False)
    callback.on_train_begin(None, None, "control", model=llama)
    assert callback.report.replaced["LlamaForCausalLM.forward (fused loss)"] == 1
    tigon.unpatch(llama)
