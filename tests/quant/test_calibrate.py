"""tigon.quantize(..., calibration=batches) on tiny random-init models: the fold alone keeps the logits; with
outlier channels planted in the RMSNorm weights, the calibrated int4 model is closer to the full-precision one than
round-to-nearest's, on held-out and on calibration inputs; GQA leaves v -> o alone; what is refused changes nothing."""

import copy
import logging

import pytest
import torch

from tests.hf._tiny import prompt_ids, tiny_model
from tigon.ops import _library
from tigon.quant import QuantLinear, quantize
from tigon.quant.calibrate import _fold, _groups, search_scales

OUTLIERS = [3, 17, 40]


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    """The scale search and the fold are under test, not the kernel: the reference quant_linear."""
    monkeypatch.setattr(_library, "use_kernels", lambda *args: False)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _with_outliers(seed=0, **overrides):
    """A tiny Llama whose RMSNorm weights are 50x on a few channels: the inputs of q/k/v and gate/up carry outlier
    channels, as real checkpoints' do."""
    model = tiny_model("llama", seed=seed, **overrides).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[OUTLIERS] *= 50
            layer.post_attention_layernorm.weight[OUTLIERS] *= 50
    return model


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", dict(num_key_value_heads=4, mlp_bias=True)),  # every group, up_proj's bias folded too
    ("qwen2", dict(num_key_value_heads=4)),  # v_proj's bias folded
    ("qwen3", {}),
    ("mistral", {}),
])
def test_the_fold_alone_keeps_the_logits(model_type, overrides):
    model = tiny_model(model_type, **overrides).eval()
    ids = prompt_ids(2, 9, seed=3)
    before = _logits(model, ids)
    groups = _groups(model)
    gqa = model.config.num_key_value_heads != model.config.num_attention_heads
    assert [g.key.rpartition(".")[2] for g in groups if g.reason is not None] == ["v_proj"] * 2 * gqa
    g = torch.Generator().manual_seed(0)
    for group in groups:
        if group.reason is None:
            _fold(group, torch.exp(2 * torch.randn(group.members[0].in_features, generator=g)))
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(64))
    assert _rel(_logits(model, ids), before) < 1e-5


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_calibrated_int4_beats_round_to_nearest_with_outlier_channels(kv_heads, caplog):
    base = _with_outliers(num_key_value_heads=kv_heads)
    calibration = [prompt_ids(4, 16, seed=10), prompt_ids(4, 16, seed=11)]
    held_out = prompt_ids(4, 16, seed=99)
    seen = torch.cat(calibration)
    ref_held, ref_seen = _logits(base, held_out), _logits(base, seen)
    rtn = quantize(copy.deepcopy(base), "int4", group_size=32)
    with caplog.at_level(logging.INFO, logger="tigon"):
        calibrated = quantize(copy.deepcopy(base), "int4", group_size=32, calibration=calibration)
    assert type(calibrated) is type(base)
    assert sum(isinstance(m, QuantLinear) for m in calibrated.modules()) == 14
    searched = 8 if kv_heads == 4 else 6  # with GQA, no v -> o group in either layer
    assert any(f"scales over 128 calibration tokens: {searched} group(s) searched" in r.message
               for r in caplog.records)
    assert _rel(_logits(calibrated, held_out), ref_held) < 0.9 * _rel(_logits(rtn, held_out), ref_held)
    assert _rel(_logits(calibrated, seen), ref_seen) < 0.9 * _rel(_logits(rtn, seen), ref_seen)


def test_gqa_leaves_v_to_o_alone_and_no_group_is_worse_on_its_samples():
    model = _with_outliers()  # num_key_value_heads=2, num_attention_heads=4
    v_before = model.model.layers[0].self_attn.v_proj.weight.clone()
    o_before = model.model.layers[0].self_attn.o_proj.weight.clone()
    chosen = search_scales(model, [prompt_ids(4, 16, seed=10)], "int4", 32, True)
    assert len(chosen) == 8
    for name, entry in chosen.items():
        if name.endswith("self_attn.v_proj"):
            assert entry["alpha"] is None and "num_key_value_heads (2) != num_attention_heads (4)" in entry["reason"]
        else:
            assert entry["alpha"] is not None and entry["error"] <= entry["rtn_error"]
    assert any(e["alpha"] and e["error"] < 0.9 * e["rtn_error"] for e in chosen.values())
    # v_proj's columns took the input_layernorm scales; its rows and o_proj are as they were
    layer = model.model.layers[0].self_attn
    ratio = layer.v_proj.weight / v_before
    assert torch.allclose(ratio, ratio[:1].expand_as(ratio), rtol=1e-5) and torch.equal(layer.o_proj.weight, o_before)
    quantize(model, "int4", group_size=32)
    assert isinstance(layer.o_proj, QuantLinear)


def test_batches_as_dicts_padding_out_and_the_model_left_as_it_was(caplog):
    model = tiny_model("qwen3", num_key_value_heads=4).train()
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    batches = [dict(input_ids=prompt_ids(2, 6, seed=5), attention_mask=mask), prompt_ids(1, 5, seed=6)[0]]
    with caplog.at_level(logging.INFO, logger="tigon"):
        chosen = search_scales(model, iter(batches), "int4", 16, False, skip=("lm_head", "mlp.down_proj"), rows=8)
    assert any("over 15 calibration tokens" in r.message for r in caplog.records)  # 10 unpadded + 5
    assert chosen["model.layers.0.mlp.up_proj"]["alpha"] is None  # its down_proj is kept in full precision
    assert "mlp.down_proj" in chosen["model.layers.0.mlp.up_proj"]["reason"]
    assert all(m.training for m in model.modules())
    assert not any(m._forward_pre_hooks for m in model.modules())

    model = tiny_model("llama").to(torch.bfloat16).eval()  # nf4 on a bf16 model: the fold casts back to bf16
    ids = prompt_ids(2, 8, seed=7)
    quantize(model, "nf4", group_size=32, calibration=[ids])
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    assert torch.isfinite(_logits(model, ids)).all()


@pytest.mark.parametrize("model_type,fmt,calibration,error,match", [
    ("gemma", "int4", [1], ValueError, r"supports the decoder layers of model types \('llama', 'mistral', "
                                       r"'qwen2', 'qwen3'\) .* got model_type 'gemma'"),
    ("phi3", "int4", [1], ValueError, r"got model_type 'phi3'"),
    ("llama", "fp8", [1], ValueError, r"4-bit formats \('int4', 'nf4'\) only .* got fmt='fp8'"),
    ("llama", "int4", [], ValueError, "calibration is empty"),
    ("llama", "int4", "ids", TypeError, "got a single str; pass \\[batch\\]"),
    ("llama", "int4", prompt_ids(2, 4), TypeError, "got a single Tensor"),
    ("llama", "int4", 7, TypeError, "must be an iterable of batches"),
    ("llama", "int4", [1, torch.ones(2, 4)], TypeError, r"batch 1 must be a non-empty integer tensor"),
    ("llama", "int4", [1, 3.5], TypeError, "batch 1 must be an input-id tensor or a dict"),
    ("llama", "int4", [{}], TypeError, "batch 0 must be a non-empty dict"),
])
def test_refusals_change_nothing(model_type, fmt, calibration, error, match):
    model = tiny_model(model_type)
    if isinstance(calibration, list):
        calibration = [prompt_ids(1, 4) if type(b) is int else b for b in calibration]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=f"tigon.quantize: .*{match}"):
        quantize(model, fmt, group_size=32, calibration=calibration)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], v) for k, v in before.items())
