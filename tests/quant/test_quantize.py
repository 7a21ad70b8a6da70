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


@pytest.mark.parametrize("fmt,group_size,symmetric", [("int4", 16, False), ("int4", 32, True), ("nf4", 32, True),
                                                      ("fp8", 16, True), ("fp8", 0, True)])
def test_siblings_share_rows_and_the_stack_is_a_view(fmt, group_size, symmetric):
    """After quantize, q|k|v and gate|up are row slices of one tensor each (data, scales, zero points), with the
    values each projection quantized alone has; the fused decode step's stack of them copies nothing; state_dict
    saves and loads them as separate projections."""
    import io

    from tigon.quant.stack import layer_stack

    dense = tiny_model("llama").eval()
    model = quantize(copy.deepcopy(dense), fmt, group_size=group_size, symmetric=symmetric)
    for layer, ref in zip(model.model.layers, dense.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        groups = ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj])
        for parts in groups:
            for field in ("data", "scales", "zeros"):
                ts = [getattr(p, field) for p in parts]
                if ts[0] is None:
                    continue
                assert len({t.untyped_storage().data_ptr() for t in ts}) == 1, field
        for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            got = getattr(layer.self_attn if name[0] in "qkv" else layer.mlp, name)
            lin = getattr(ref.self_attn if name[0] in "qkv" else ref.mlp, name)
            alone = QuantLinear.from_linear(lin, fmt, group_size, symmetric=symmetric)
            for field in ("data", "scales", "zeros"):
                a, b = getattr(got, field), getattr(alone, field)
                assert (a is None and b is None) or torch.equal(a, b), (name, field)
        stack = layer_stack(layer, list(groups[0]), attn.o_proj, list(groups[1]), mlp.down_proj, torch.float32)
        for group, parts in ((stack.qkv, groups[0]), (stack.gate_up, groups[1])):
            assert group.stacked
            assert group.weights[0][0].data.untyped_storage().data_ptr() == \
                parts[0].data.untyped_storage().data_ptr()  # a view, not a copy
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["model.layers.0.self_attn.k_proj.data"].shape == model.model.layers[0].self_attn.k_proj.data.shape
    other = quantize(tiny_model("llama", seed=3).eval(), fmt, group_size=group_size, symmetric=symmetric)
    other.load_state_dict(loaded)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))


def test_shared_rows_follow_an_in_place_load_of_one_projection(reference_path):
    """Loading new values into one projection of a shared group changes that projection only."""
    model = quantize(tiny_model("llama").eval(), "int4", group_size=32)
    attn = model.model.layers[0].self_attn
    before = {n: getattr(attn, n).data.clone() for n in ("q_proj", "k_proj", "v_proj")}
    new = QuantLinear.from_linear(nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False),
                                  "int4", 32)
    attn.k_proj.load_state_dict(new.state_dict())
    assert torch.equal(attn.k_proj.data, new.data)
    assert torch.equal(attn.q_proj.data, before["q_proj"]) and torch.equal(attn.v_proj.data, before["v_proj"])


def test_a_stack_rebinds_separate_projections_to_its_rows():
    """Projections holding separate tensors (after a device move, or an import's repacked tensors): building the
    decode stack makes them its rows, values unchanged, so the stack is not a second copy."""
    from tigon.quant.stack import layer_stack

    model = quantize(tiny_model("llama").eval(), "fp8", group_size=16)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    for p in qkv + gate_up:
        p._buffers.update({f: t.clone() for f, t in p._buffers.items() if t is not None})
    before = [{f: t.clone() for f, t in p._buffers.items() if t is not None} for p in qkv + gate_up]
    stack = layer_stack(layer, qkv, attn.o_proj, gate_up, mlp.down_proj, torch.float32)
    for group, parts in ((stack.qkv, qkv), (stack.gate_up, gate_up)):
        storage = group.weights[0][0].data.untyped_storage().data_ptr()
        assert all(p.data.untyped_storage().data_ptr() == storage for p in parts)
    for p, was in zip(qkv + gate_up, before):
        assert all(torch.equal(p._buffers[f], t) for f, t in was.items())
    assert layer_stack(layer, qkv, attn.o_proj, gate_up, mlp.down_proj, torch.float32) is stack  # current


def test_save_pretrained_writes_each_shared_projection(tmp_path):
    """HF's safetensors save of a quantized model whose siblings share one tensor: each projection saved as its own
    tensor, its values."""
    from safetensors.torch import load_file

    model = quantize(tiny_model("llama").eval(), "int4", group_size=32)
    model.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(f))
    attn = model.model.layers[1].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        for field in ("data", "scales"):
            assert torch.equal(saved[f"model.layers.1.self_attn.{name}.{field}"], getattr(attn, name)._buffers[field])
