"""tigon.quant.quantize and adopt / release on a tiny random-init Llama: greedy tokens of HF's own generate on the
quantized model equal those of the same model with the dequantized weights in nn.Linear; a checkpoint's quantized
projections swapped and put back exactly; what is left alone, and why; bad input."""

import copy
import logging

import pytest
import torch
from torch import nn

from tests.hf._tiny import prompt_ids, tiny_model
from tigon import ops
from tigon.ops import _library
from tigon.ops.quantized_weight import dequantize
from tigon.quant import QuantLinear, adopt, quantize, quantized_projections, release

from . import _formats

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _greedy(model, b=2, new=5):
    with torch.no_grad():
        return model.generate(prompt_ids(b, 5), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0)


@pytest.fixture
def reference_path(monkeypatch):
    """The model plumbing is under test here, not the kernel (tests/quant/test_module.py, tests/ops): the
    reference quant_linear, ~0.3 s a call less under the interpreter."""
    monkeypatch.setattr(_library, "use_kernels", lambda *args: False)


def _dequantized_copy(model):
    """The same model with each QuantLinear replaced by an nn.Linear holding its dequantized weight."""
    dense = copy.deepcopy(model)
    for name, m in list(dense.named_modules()):
        if isinstance(m, QuantLinear):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            lin.weight.data = dequantize(m.quantized_weight)
            if m.bias is not None:
                lin.bias.data = m.bias.float()
            dense.set_submodule(name, lin)
    return dense


@pytest.mark.parametrize("fmt,group_size,symmetric", [("int4", 16, False), ("nf4", 32, True), ("fp8", 32, True)])
def test_greedy_tokens_equal_the_dequantized_model(fmt, group_size, symmetric, reference_path):
    model = tiny_model("llama").eval()
    assert quantize(model, fmt, group_size=group_size, symmetric=symmetric) is model
    swapped = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(swapped) == 2 * len(PROJECTIONS) and type(model.lm_head) is nn.Linear
    assert torch.equal(_greedy(model), _greedy(_dequantized_copy(model)))


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter on CPU tensors; a GPU runs the kernels in tests/ops/test_quant_linear.py")
def test_greedy_tokens_through_the_kernel():
    model = quantize(tiny_model("llama").eval(), "int4", group_size=32)
    before = ops.dispatch_counts[("quant_linear", "triton")]
    assert torch.equal(_greedy(model, b=1, new=2), _greedy(_dequantized_copy(model), b=1, new=2))
    assert ops.dispatch_counts[("quant_linear", "triton")] == before + 2 * 2 * len(PROJECTIONS)


def test_quantize_refusals_change_nothing():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"tigon.quantize: group_size must be even, > 0 and divide in_features "
                                         r"\(64\) .* \(layer 'model.layers.0.self_attn.q_proj'\)"):
        quantize(model, "int4", group_size=24)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize(model, "int8")
    with pytest.raises(ValueError, match="calibration searches scales for 4-bit formats"):
        quantize(model, "fp8", calibration=[prompt_ids(1, 4)])
    with pytest.raises(TypeError, match="skip must be a tuple"):
        quantize(model, "int4", skip="lm_head")
    quantize(model, "int4", group_size=32, skip=("lm_head", "mlp.down_proj"))
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.self_attn.q_proj' is already quantized "
                                         r"\(QuantLinear\)"):
        quantize(model, "fp8")


def _checkpoint_like():
    """Layer 0: GPTQ projections; layer 1: GPTQ with one FP8 projection (mixed layouts); lm_head FP8."""
    model = tiny_model("llama").eval()
    for i, layer in enumerate(model.model.layers):
        for j, (name, lin) in enumerate((n, m) for n, m in layer.named_modules() if n.endswith(PROJECTIONS)):
            if i == 1 and name.endswith("v_proj"):
                q, _ = _formats.fp8(lin.out_features, lin.in_features, block=None, seed=j)
            else:
                q, _ = _formats.gptq(lin.out_features, lin.in_features, 16, act_order=j % 2 == 1, seed=j,
                                     bias=False)
            layer.set_submodule(name, q)
    model.lm_head, _ = _formats.fp8(131, 64, block=None, seed=99)
    return model


def test_adopt_swaps_and_release_restores(caplog, reference_path):
    model = _checkpoint_like()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    tokens = _greedy(model)  # HF's generate over the checkpoint modules' own forwards
    found = list(quantized_projections(model))
    skipped = {}
    with caplog.at_level(logging.WARNING, logger="tigon"):
        names = adopt(model, skipped=skipped)
    assert names == [f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                     "mlp.down_proj")]
    assert names == found
    assert "output projection" in skipped["lm_head"]
    assert "mixes weight layouts ['fp8', 'int4']" in skipped["model.layers.1.self_attn.q_proj"]
    assert len(skipped) == 1 + len(PROJECTIONS) and "left on their own forward" in caplog.text
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in names)
    assert torch.equal(_greedy(model), tokens)
    assert adopt(model) == []  # nothing more to swap
    with pytest.raises(ValueError, match="already quantized"):
        quantize(model, "int4", group_size=16)
    assert release(model) == names
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    assert all(model.get_submodule(n) is modules[n] for n in names)


def test_bad_input():
    for fn in (adopt, release, quantized_projections):
        with pytest.raises(TypeError, match=rf"tigon.quant.{fn.__name__}: model must be an nn.Module"):
            fn("model")
    with pytest.raises(TypeError, match="skipped must be None or a dict"):
        adopt(nn.Linear(2, 2), skipped=[])
