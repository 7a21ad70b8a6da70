"""The families beyond tests/hf/test_patch.py's every-family tables: the text towers of vision-language models
(registry.TOWERS, reached through tigon.compat.liger's apply functions as Liger's are), the rows added for
liger-kernel 0.8.5's coverage, and MoE models with output_router_logits=True. Each is checked against the HF
classes on a tiny random-init model: logits, loss and gradients equal to unpatched HF, and Tigon's kernels
counted as they run."""

import copy
import importlib
import inspect

import pytest
import torch

import tigon
from tests.hf._tiny import COMMON, batch, op_calls, tiny_model
from tigon import ops
from tigon.compat import liger
from tigon.hf import registry
from tigon.modules import GeGLUMLP, RMSNorm, SwiGLUMLP

# One layer, hidden 32, two heads: the interpreter's cost is per kernel program (rows x heads)
SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)
TEXT = {k: v for k, v in COMMON.items() if k != "attn_implementation"} | SMALL
IMAGE_TOKEN = 99  # above the text batch's ids
_VISION = dict(depth=1, hidden_size=32, out_hidden_size=32, intermediate_size=48, num_heads=2, patch_size=2,
               spatial_merge_size=2, temporal_patch_size=1)
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=2, image_size=8, patch_size=4)
# Gemma-4's per-layer inputs (a small table) and its full-attention heads (512 wide by default) at SMALL's size
_GEMMA4_TEXT = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=100, global_head_dim=16,
                    sliding_window=16)
# model_type -> (config class, model class, config kwargs): a one-layer text tower, a one-block vision tower
VLMS = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", dict(
        text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=1))),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", dict(
        text_config={**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={**_VISION, "fullatt_block_indexes": [0]})),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", dict(
        text_config={**TEXT, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                              "mrope_interleaved": True}},
        vision_config={**_VISION, "deepstack_visual_indexes": [0], "num_position_embeddings": 16})),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", dict(
        text_config={**TEXT, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                     "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
        vision_config={**_VISION, "deepstack_visual_indexes": [0], "num_position_embeddings": 16})),
    "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", dict(
        text_config={**TEXT, "partial_rotary_factor": 0.5, "n_routed_experts": 4, "num_experts_per_tok": 2,
                     "n_shared_experts": 1, "moe_intermediate_size": 16, "first_k_dense_replace": 0, "n_group": 1,
                     "topk_group": 1, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]}},
        vision_config=_VISION)),
    "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", dict(
        text_config={**TEXT, "partial_rotary_factor": 0.5,
                     "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]}},
        vision_config=_VISION)),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config={**TEXT, "model_type": "gemma3_text", "sliding_window": 16}, vision_config=_SIGLIP,
        mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN)),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", dict(
        text_config={**TEXT, "model_type": "llama"}, image_token_index=IMAGE_TOKEN,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=4, projection_dim=32))),
    "paligemma": ("PaliGemmaConfig", "PaliGemmaForConditionalGeneration", dict(
        text_config={**TEXT, "model_type": "gemma"}, vision_config={**_SIGLIP, "projection_dim": 64},
        image_token_index=IMAGE_TOKEN)),
    "gemma4": ("Gemma4Config", "Gemma4ForConditionalGeneration", dict(
        text_config={**TEXT, **_GEMMA4_TEXT, "model_type": "gemma4_text", "layer_types": ["full_attention"]},
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64),
        audio_config=None, image_token_id=IMAGE_TOKEN)),
}
# the pieces the text tower must come back with (Tigon module class names, >= 1 each); Liger's Qwen3-VL function
# has swiglu=False by default, so its MLP stays HF's
TOWER_PIECES = {"gemma3": {"RMSNorm", "GeGLUMLP"}, "paligemma": {"RMSNorm", "GeGLUMLP"},
                "gemma4": {"RMSNorm", "GeGLUMLP"}, "qwen3_vl": {"RMSNorm", "Qwen3VLTextMLP"},
                "qwen3_vl_moe": {"RMSNorm"}}


def _vlm(model_type, seed=0):
    import transformers

    config_cls, model_cls, kwargs = VLMS[model_type]
    config = getattr(transformers, config_cls)(**copy.deepcopy(kwargs))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():  # larger than HF's 0.02 init, so the test sees the weights (tests/hf/_tiny.py)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model


def _close(a, b, name, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _step(model, ids, labels):
    """Eval logits, then the training loss and the grads of one forward/backward."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train()
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return logits, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_training(model, ref, ids, labels):
    logits_ref, loss_ref, grads_ref = _step(ref, ids, labels)
    logits, loss, grads = _step(model, ids, labels)
    _close(logits, logits_ref, "eval logits")
    _close(loss, loss_ref, "loss")
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        _close(g, grads_ref[name], f"grad {name}", rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("model_type", sorted(registry.TOWERS))
def test_tower_norm_row_matches_the_hf_class(model_type):
    """The (casting, offset) of each tower row is the formula the HF class computes, in bf16."""
    from tigon.ops import reference

    fam = registry.TOWERS[model_type]
    modeling = importlib.import_module(fam.modeling)
    for name, (mode, offset) in fam.norm_classes.items():
        norm = getattr(modeling, name)(48, eps=1e-6).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.normal_(0.0, 1.0)
        x = torch.randn(5, 48).to(torch.bfloat16)
        ours = reference.rms_norm(x, norm.weight, 1e-6, offset=offset, casting_mode=mode)
        torch.testing.assert_close(ours, norm(x), rtol=2**-7, atol=2**-7 * ours.abs().max().item())
    for name in fam.mlp_class_names:  # every MLP a row names exists and takes a config first
        assert next(iter(inspect.signature(getattr(modeling, name)).parameters)) == "config", name


@pytest.mark.parametrize("model_type", sorted(registry.TOWERS))
def test_tower_class_level_stand_ins_take_the_hf_arguments(model_type):
    fam = registry.TOWERS[model_type]
    modeling = importlib.import_module(fam.modeling)
    originals = {n: getattr(modeling, n) for n in [*fam.norm_classes, *fam.mlp_class_names]}
    report = tigon.patch(model_type=model_type)
    try:
        assert {f"RMSNorm class {n}" for n in fam.norm_classes} <= set(report.replaced)
        for name, hf_cls in originals.items():
            assert inspect.signature(getattr(modeling, name)) == inspect.signature(hf_cls), name
        for name in fam.norm_classes:
            size = next(iter(inspect.signature(originals[name]).parameters))
            assert type(getattr(modeling, name)(**{size: 8})) is RMSNorm
    finally:
        tigon.unpatch(model_type=model_type)
    assert all(getattr(modeling, n) is c for n, c in originals.items())


@pytest.mark.parametrize("model_type", sorted(VLMS))
def test_vision_language_text_tower_runs_tigon_and_trains_like_hf(model_type):
    """apply_liger_kernel_to_<vlm>(model=m), as transformers' Trainer calls it: the text tower's norms and MLPs
    become Tigon's, its ops run, and a text batch gives HF's logits, loss and gradients."""
    ref = _vlm(model_type)
    model = copy.deepcopy(ref)
    apply = liger.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    report = liger._apply_liger_kernel_to_instance(model=model, **{"rms_norm": True, "not_a_flag": 1})
    assert report is not None and sum(report.replaced.values()) > 0, report
    assert apply.__name__ == f"apply_liger_kernel_to_{model_type}"
    tower = liger._text_tower(model)
    names = {type(m).__name__ for m in tower.modules()}
    assert TOWER_PIECES.get(model_type, {"RMSNorm", "SwiGLUMLP"}) <= names
    vision = [m for n, m in model.named_modules() if "vision" in n or "visual" in n]
    assert not any(isinstance(m, (RMSNorm, SwiGLUMLP)) for m in vision), "the vision tower is left as it is"
    rope = inspect.signature(apply).parameters.get("rope")
    if not registry.family_for(tower.config.model_type).rope and rope is not None and rope.default:
        assert [r for p, r in report.skipped if p == "RoPE"], report  # mRoPE, asked for by default: reported
    ids, labels = batch(IMAGE_TOKEN - 1, b=1, t=5)  # below the image token id
    ops.dispatch_counts.clear()
    _assert_same_training(model, ref, ids, labels)
    assert op_calls("rms_norm", "add_rms_norm") > 0
    tigon.unpatch(tower)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava"])
def test_vision_language_class_level_call(model_type, caplog):
    """Class-level: a VLM whose text tower is a known row patches that row's classes; Llava's language model can
    be any family, so without model= it logs and patches nothing."""
    fn = liger.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    if registry.VISION_LANGUAGE[model_type] is None:
        with caplog.at_level("WARNING", logger="tigon"):
            assert fn() is None
        assert "needs the language model's family" in caplog.text
        return
    report = fn()
    try:
        assert report.model_type == registry.VISION_LANGUAGE[model_type] and report.target == "class"
        model = _vlm(model_type)
        assert {"RMSNorm", "SwiGLUMLP"} <= {type(m).__name__ for m in liger._text_tower(model).modules()}
    finally:
        tigon.unpatch(model_type=registry.VISION_LANGUAGE[model_type])


# Qwen3.5 and Qwen3-Next alternate gated-DeltaNet and attention layers; one of each (a cache of DeltaNet layers
# alone has no sequence length for the eval forward)
_LAYERS = {t: dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
           for t in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")}
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_MLA = dict(num_key_value_heads=2, head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0, **_MOE)
# The rows added for liger-kernel 0.8.5's coverage (qwen3_5_moe_text shares qwen3_5_text's layers and its norm
# row, checked above; one of the two trains here), each on a one-layer (Qwen3.5/Next: two) config of SMALL's size
NEW_TEXT_ROWS = {
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2), "llama4_text": {}, "hunyuan_v1_moe": {},
    "qwen3_5_text": _LAYERS["qwen3_5_text"],
    "qwen3_next": dict(**_LAYERS["qwen3_next"], num_experts=4, shared_expert_intermediate_size=24,
                       linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
                       linear_value_head_dim=8, **_MOE),
    "deepseek_v2": dict(q_lora_rank=None, **_MLA), "deepseek_v3": dict(q_lora_rank=16, n_group=1, topk_group=1, **_MLA),
    "deepseek_v4": {},
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                      mamba_chunk_size=4),
    "nemotron": dict(partial_rotary_factor=0.5),
    "gemma4_text": dict(vocab_size_per_layer_input=100),  # with_scale=False v_norm: a weightless Tigon norm
}


@pytest.mark.parametrize("model_type", sorted(NEW_TEXT_ROWS))
def test_new_text_rows_instance_patch_trains_like_hf(model_type):
    ref = tiny_model(model_type, **{**SMALL, **NEW_TEXT_ROWS[model_type]})
    model = copy.deepcopy(ref)
    report = liger.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type](model=model)
    fam = registry.family_for(model_type)
    hf_norms = sum(type(m).__name__ in fam.norm_classes for m in ref.modules())
    assert sum(n for p, n in report.replaced.items() if p.startswith("RMSNorm ")) == hf_norms, report
    assert not {type(m).__name__ for m in model.modules()} & set(fam.norm_classes)
    if model_type == "nemotron":  # Liger's relu_squared=True: no Tigon kernel, said so
        assert ("ReLU^2", "Tigon has no ReLU^2 kernel: the MLP's activation stays HF's") in report.skipped
    ids, labels = batch(model.config.vocab_size, b=1, t=5)
    ops.dispatch_counts.clear()
    logits_ref, loss_ref, grads_ref = _step(ref, ids, labels)
    logits, loss, grads = _step(model, ids, labels)
    _close(logits, logits_ref, "eval logits")
    _close(loss, loss_ref, "loss")
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        _close(g, grads_ref[name], f"grad {name}", rtol=1e-3, atol=1e-5)
    # the fused loss ran once, unless the family keeps HF's (Falcon-H1's lm_head_multiplier)
    assert op_calls("linear_cross_entropy") == (1 if fam.causal_lm else 0)
    assert (op_calls("rms_norm", "add_rms_norm") > 0) == (hf_norms > 0)


def test_gemma4_text_class_level_builds_double_wide_mlps_and_scale_free_norms():
    """Gemma-4's KV-shared layers build a double-width MLP from their layer_idx, and its v_norm has no weight
    (with_scale=False): the class-level patch builds both as HF does (the same state_dict and initialization), the
    scale-free norms as weightless Tigon norms, and gives HF's eval logits and (fused) training loss."""
    kw = {**SMALL, **_GEMMA4_TEXT, "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2,
          "num_kv_shared_layers": 1, "use_double_wide_mlp": True}
    def outputs(m):  # eval logits, and the training loss (fused where patched) without a backward
        with torch.no_grad():
            return m.eval()(input_ids=ids).logits, m.train()(input_ids=ids, labels=labels).loss

    ref = tiny_model("gemma4_text", **kw)
    ids, labels = batch(ref.config.vocab_size, b=1, t=5)
    logits_ref, loss_ref = outputs(ref)  # before the patch, which reaches ref's class forward too
    tigon.patch(model_type="gemma4_text")
    try:
        model = tiny_model("gemma4_text", **kw)
        assert [(type(layer.mlp), layer.mlp.intermediate_size) for layer in model.model.layers] == [
            (GeGLUMLP, 48), (GeGLUMLP, 96)]
        v_norm = model.model.layers[0].self_attn.v_norm  # layer 1 shares layer 0's keys and values: no v_norm
        assert type(v_norm) is RMSNorm and v_norm.weight is None and v_norm.hidden_size == 16
        state, state_ref = model.state_dict(), ref.state_dict()
        assert state.keys() == state_ref.keys()
        for k in state:
            assert torch.equal(state[k], state_ref[k]), f"{k} is initialized differently"
        ops.dispatch_counts.clear()
        logits, loss = outputs(model)
    finally:
        tigon.unpatch(model_type="gemma4_text")
    _close(logits, logits_ref, "eval logits")
    _close(loss, loss_ref, "loss")
    # two passes of two layers: GeGLU on its own (no grad: the projections stay cuBLAS), one fused loss
    assert op_calls("linear_cross_entropy") == 1 and op_calls("geglu") == 4


def test_gemma4_scale_free_norm_becomes_a_weightless_tigon_norm():
    """Gemma4RMSNorm(with_scale=False) keeps no weight and no size: RMSNorm.from_hf gives a weightless norm that
    normalizes in fp32 to x.dtype whatever the row's offset and casting say; its output and dx are HF's."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    hf = Gemma4RMSNorm(16, eps=1e-6, with_scale=False)
    ours = RMSNorm.from_hf(hf, offset=1.0, casting_mode="llama")
    assert ours.weight is None and not ours.state_dict() and ours.hidden_size is None
    x = torch.randn(5, 16, requires_grad=True)
    outs = []
    for m in (hf, ours):
        y = m(x * 3.0)
        (dx,) = torch.autograd.grad(y.square().sum(), x)
        outs.append((y, dx))
    _close(outs[1][0], outs[0][0], "output")
    _close(outs[1][1], outs[0][1], "dx", rtol=1e-3, atol=1e-5)
    assert ours(x.detach().bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="offset"):
        RMSNorm(16, offset=1.0, elementwise_affine=False)
    with pytest.raises(ValueError, match="hidden_size"):
        RMSNorm(None)
    with pytest.raises(TypeError, match="with_scale=False"):
        RMSNorm.from_hf(torch.nn.Identity())


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4"])
def test_unpatch_of_a_vision_language_model_restores_its_towers(model_type):
    """apply_liger_kernel_to_<vlm>(model=vlm) records its undo on the text tower (its own row's patch, with the
    vision tower's torch.nn.LayerNorms where layer_norm=True): tigon.unpatch(vlm) walks to it and restores both."""
    ref = _vlm(model_type)
    model = copy.deepcopy(ref)
    report = liger.MODEL_TYPE_TO_APPLY_LIGER_FN[model_type](model=model, layer_norm=True)
    replaced = [type(m).__name__ for m in model.modules() if type(m).__module__.startswith("tigon.")]
    assert "RMSNorm" in replaced and "GeGLUMLP" in replaced, report
    assert ("LayerNorm" in replaced) == (model_type == "gemma3")  # Gemma-4's vision tower has RMSNorms only
    tigon.unpatch(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    assert not [k for m in model.modules() for k in m.__dict__ if k == "forward" or k.startswith("_tigon")]
    tigon.unpatch(model)  # nothing left to restore: a no-op


def test_pixtral_vision_tower_runs_tigon_like_hf():
    """Pixtral, a vision model (Llava's tower in Pixtral and Mistral-3 checkpoints): its RMSNorms and SwiGLU MLPs."""
    from transformers import PixtralVisionConfig, PixtralVisionModel

    config = PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=16, image_size=8, patch_size=4, hidden_act="silu")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = PixtralVisionModel(config).float()
    model = copy.deepcopy(ref)
    report = liger.apply_liger_kernel_to_pixtral(model=model)
    assert report.replaced["RMSNorm PixtralRMSNorm"] == 3 and report.replaced["SwiGLUMLP PixtralMLP"] == 1, report
    pixels = torch.randn(1, 3, 8, 8)
    ops.dispatch_counts.clear()
    outs = []
    for m in (ref, model):
        out = m(pixel_values=pixels, image_sizes=[(8, 8)]).last_hidden_state
        out.square().sum().backward()
        outs.append((out.detach(), {n: p.grad for n, p in m.named_parameters()}))
    _close(outs[1][0], outs[0][0], "output")
    for name, g in outs[0][1].items():
        _close(outs[1][1][name], g, f"grad {name}", rtol=1e-3, atol=1e-5)
    assert op_calls("rms_norm", "add_rms_norm") == 3 and op_calls("swiglu_mlp") == 1


def test_vision_tower_layer_norms_run_tigons_layer_norm(caplog):
    """layer_norm=True (Liger's default for Gemma-3): the SigLIP tower's torch.nn.LayerNorms become Tigon's
    LayerNorm on the same Parameters, the tower's outputs and grads are HF's, tigon.unpatch(text tower) restores
    them; layer_norm=False and the class-level call (which cannot reach a torch.nn.LayerNorm) leave them."""
    from tigon.modules import LayerNorm

    ref = _vlm("gemma3")
    count = sum(type(m) is torch.nn.LayerNorm for m in ref.modules())
    model = copy.deepcopy(ref)
    report = liger.apply_liger_kernel_to_gemma3(model=model)
    assert count > 0 and report.replaced["LayerNorm (vision tower, torch.nn.LayerNorm)"] == count, report
    assert sum(isinstance(m, LayerNorm) for m in model.modules()) == count
    pixels = torch.randn(1, 3, 8, 8)
    ops.dispatch_counts.clear()
    outs = []
    for m in (ref, model):
        out = m.model.vision_tower(pixel_values=pixels).last_hidden_state
        out.square().sum().backward()
        outs.append((out.detach(), {n: p.grad for n, p in m.model.vision_tower.named_parameters()}))
    assert op_calls("layer_norm") == count
    _close(outs[1][0], outs[0][0], "vision output")
    for name, g in outs[0][1].items():
        _close(outs[1][1][name], g, f"grad {name}", rtol=1e-3, atol=1e-5)
    tigon.unpatch(liger._text_tower(model))
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    liger.apply_liger_kernel_to_gemma3(model=model, layer_norm=False)
    assert not any(isinstance(m, LayerNorm) for m in model.modules())
    tigon.unpatch(liger._text_tower(model))
    report = liger.apply_liger_kernel_to_gemma3()
    tigon.unpatch(model_type="gemma3_text")
    assert [p for p, _ in report.skipped if p == "LayerNorm (vision tower)"]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_qwen3_5_class_level_from_config_initializes_like_hf(model_type):
    """HF's _init_weights zeroes Qwen3.5's and Qwen3-Next's (1 + weight) norm by isinstance, which misses Tigon's:
    the class-level patch's _init_weights zeroes Tigon's offset norms too, and unpatch restores HF's."""
    ref = tiny_model(model_type, **{**SMALL, **_LAYERS[model_type]})
    modeling = importlib.import_module(registry.family_for(model_type).modeling)
    base = getattr(modeling, f"{registry.family_for(model_type).prefix}PreTrainedModel")
    hf_init = base.__dict__["_init_weights"]
    tigon.patch(model_type=model_type)
    try:
        model = tiny_model(model_type, **{**SMALL, **_LAYERS[model_type]})
    finally:
        tigon.unpatch(model_type=model_type)
    assert base.__dict__["_init_weights"] is hf_init
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.offset == 1.0 for m in norms)
    state, state_ref = model.state_dict(), ref.state_dict()
    assert state.keys() == state_ref.keys()
    for k in state:
        assert torch.equal(state[k], state_ref[k]), f"{k} is initialized differently"


MOE = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts", "qwen3_moe": "num_experts"}


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_moe_router_logits_loss_and_aux_loss_equal_hf(model_type):
    """output_router_logits=True: the loss (cross-entropy + router_aux_loss_coef * aux) and the aux loss are HF's."""
    ref = tiny_model(model_type, **SMALL, output_router_logits=True, router_aux_loss_coef=0.05)
    model = copy.deepcopy(ref)
    tigon.patch(model, rope=False)  # the loss is under test: the RoPE kernel's interpreter time is not
    ids, labels = batch(model.config.vocab_size, b=2, t=5)
    mask = torch.ones_like(ids)
    mask[0, -1], labels[0, -1] = 0, -100  # a padded token: the aux loss averages over attended tokens only
    ref.train()
    model.train()
    ops.dispatch_counts.clear()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None and op_calls("linear_cross_entropy") == 1
    assert out.aux_loss is not None and out_ref.aux_loss is not None
    assert len(out.router_logits) == len(out_ref.router_logits)
    _close(out.aux_loss, out_ref.aux_loss, "aux loss")
    _close(out.loss, out_ref.loss, "loss")
    out.loss.backward()
    out_ref.loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        if p_ref.grad is not None:
            _close(p.grad, p_ref.grad, f"grad {name}")
