"""tigon.hf.kernels: transformers' kernel mechanism (KernelConfig, kernelize) running Tigon's layers from the local
kernel repository shipped in the package. The kernelize tests need the `kernels` package in the version range
transformers accepts (5.17: >= 0.16, < 0.17; pip install tigon[kernels]) and skip without it."""

import copy
import json
import warnings

import pytest
import torch

from tests.hf._tiny import batch, op_calls, tiny_model
from tigon import ops
from tigon.hf import kernels as tigon_kernels


@pytest.fixture
def hub_functions():
    """kernelize sets a hub layer's forward on transformers' module-level function modules (apply_rotary_pos_emb of
    a modeling module, shared by every model of it): give them their own forward back after the test."""
    models = []
    yield models.append
    for model in models:
        for m in model.modules():
            for fn in m.__dict__.get("_kernel_funcs", {}).values():
                fn.__dict__.pop("forward", None)


def _kernels():
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("the `kernels` package in transformers' supported range is not installed")
    import kernels

    return kernels



def _step_matches(model, loss, ref, ids, labels):
    """The kernelized model's loss and every gradient against HF's own model on the same batch."""
    loss_ref = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, loss_ref, rtol=2e-4, atol=2e-5)
    loss.backward()
    loss_ref.backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

def test_the_repository_has_the_layout_kernels_loads():
    variant = tigon_kernels.KERNEL_REPO / "build" / "torch-universal"
    metadata = json.loads((variant / "metadata.json").read_text())
    assert {"id", "name", "license", "backend"} <= metadata.keys() and metadata["license"] == "Apache-2.0"
    assert (variant / "__init__.py").exists() and (variant / "layers.py").exists()
    mapping = tigon_kernels.kernel_mapping("cuda")
    assert mapping["RMSNorm"] == {"cuda": f"{tigon_kernels.KERNEL_REPO}:RMSNorm"}
    assert mapping["rotary_pos_emb"] == {"cuda": f"{tigon_kernels.KERNEL_REPO}:RotaryPosEmb"}
    assert {"SwiGLUMLP", "GeGLUMLP", "SiLU", "GeluTanh"} <= mapping.keys()
    with pytest.raises(TypeError, match="kernel_mapping: device must be a string"):
        tigon_kernels.kernel_mapping(None)


def test_kernel_config_is_transformers_and_validates_against_a_model():
    from transformers import KernelConfig

    kernels = _kernels()
    config = tigon_kernels.kernel_config()
    assert isinstance(config, KernelConfig) and config.use_local_kernel
    model = tiny_model("llama", num_hidden_layers=1)
    config.sanitize_kernel_mapping(model)  # raises for a layer name the model does not register
    assert "RMSNorm" in config.registered_layer_names.values()
    layer = kernels.get_local_kernel(tigon_kernels.KERNEL_REPO).layers.RMSNorm
    assert layer.__init__ is torch.nn.Module.__init__  # stateless, as kernels requires


# Llama's formula; OLMo-2's fp32 weight (with q/k norms); Qwen3-MoE's (q/k norms). transformers 5.17 registers no
# hub layer on GemmaRMSNorm, so Gemma's 1 + weight formula is reached only through tigon.patch.
@pytest.mark.parametrize("model_type", ["llama", "olmo2", "qwen3_moe"])
def test_kernelize_runs_tigons_norm_with_each_familys_formula(model_type, hub_functions):
    kernels = _kernels()
    ref = tiny_model(model_type, num_hidden_layers=1)
    model = copy.deepcopy(ref)
    hub_functions(model)
    mapping = {"RMSNorm": {"cpu": tigon_kernels.local_layer_repository()}}
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False), pytest.warns(UserWarning):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    ids, labels = batch(model.config.vocab_size, b=1, t=5)
    model.train()
    ref.train()
    registered = sum(getattr(m, "kernel_layer_name", None) == "RMSNorm" for m in model.modules())
    assert registered >= 3
    ops.dispatch_counts.clear()
    loss = model(input_ids=ids, labels=labels).loss
    assert op_calls("rms_norm") == registered  # each registered norm ran Tigon's op once
    _step_matches(model, loss, ref, ids, labels)


def test_a_norm_class_without_a_row_is_a_type_error():
    class OtherRMSNorm(torch.nn.Module):
        weight = torch.ones(4)
        variance_epsilon = 1e-6

    with pytest.raises(TypeError, match="OtherRMSNorm is not a norm class in tigon.hf.registry"):
        tigon_kernels.rms_norm_forward(OtherRMSNorm(), torch.randn(2, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="transformers maps local kernels for cuda/rocm/... only")
def test_from_pretrained_use_kernels_runs_tigon_on_gpu(tmp_path):
    from transformers import AutoModelForCausalLM

    _kernels()
    tiny_model("llama", num_hidden_layers=1).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True, device_map="cuda",
                                                 kernel_config=tigon_kernels.kernel_config("cuda"))
    ids, labels = batch(model.config.vocab_size, b=1, t=5)
    ops.dispatch_counts.clear()
    model.train()
    model(input_ids=ids.cuda(), labels=labels.cuda()).loss.backward()
    assert ops.dispatch_counts[("rms_norm", "triton")] == 3


def test_hub_function_is_the_function_a_kernels_function_module_wraps():
    from tigon.hf.unwrap import hub_function

    kernels = _kernels()

    def double(x):
        return 2 * x

    wrapped = kernels.use_kernel_forward_from_hub("TigonTestDouble")(double)
    assert isinstance(wrapped, torch.nn.Module) and hub_function(wrapped) is double
    assert hub_function(double) is double and hub_function(None) is None
    norm = torch.nn.RMSNorm(4)
    assert hub_function(norm) is norm
    wrapped.forward = type(wrapped).forward.__get__(wrapped)  # kernelize without a hub layer for it: the same
    assert hub_function(wrapped) is double
    wrapped.forward = lambda x: 3 * x  # what kernelize does with a hub layer: no longer the function
    assert hub_function(wrapped) is wrapped
    assert hub_function(wrapped, defined=True) is double  # the source transformers defined, all the same


def test_from_pretrained_use_kernels_runs_tigon_on_cpu(tmp_path, hub_functions):
    """from_pretrained(use_kernels=True, kernel_config=tigon.hf.kernel_config("cpu")): HF's whole path (the
    mapping's registration at load, its validation against the model, create_compatible_mapping, kernelize), whose
    local-repository step transformers 5.17 breaks (it splits a (repo, metadata) pair as a string) and limits to
    accelerators: Tigon's KernelConfig maps it itself. The norms then run Tigon's op, in eval and in training."""
    from transformers import AutoModelForCausalLM, KernelConfig

    _kernels()
    ref = tiny_model("llama", num_hidden_layers=1)
    ref.save_pretrained(tmp_path)
    config = tigon_kernels.kernel_config("cpu")
    assert isinstance(config, KernelConfig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True, kernel_config=config)
        hub_functions(model)
        model.train()  # kernelizes again, for training
    assert model.use_kernels
    assert not [w for w in caught if "No kernel mapping" in str(w.message)]  # every registered name is mapped
    ids, labels = batch(model.config.vocab_size, b=1, t=5)
    for train in (False, True):
        model.train(train)
        ref.train(train)
        ops.dispatch_counts.clear()
        loss = model(input_ids=ids, labels=labels).loss
        assert op_calls("rms_norm") == 3  # input, post-attention and final norms: Tigon's op, through kernelize
        assert op_calls("apply_rope") == 1  # the layer's apply_rotary_pos_emb
        torch.testing.assert_close(loss, ref(input_ids=ids, labels=labels).loss, rtol=2e-4, atol=2e-5)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _registered(model):
    return {getattr(type(m), "kernel_layer_name", None) for m in model.modules()} - {None} | \
        {name for m in model.modules() for name in m.__dict__.get("_kernel_funcs", {})}


def test_kernelize_maps_every_registered_name_and_matches_hf(hub_functions):
    """Llama with a SwiGLUMLP-registered MLP class (transformers' default mapping names the layer; 5.17 registers it
    on no class yet): every registered name mapped (no "No kernel mapping" warning), the norms, RoPE and MLP on
    Tigon's ops, SiLU as HF's, and the loss and every gradient as HF's."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    kernels = _kernels()
    ref = tiny_model("llama", num_hidden_layers=1)
    model = tiny_model("llama", num_hidden_layers=1)  # not a deepcopy: that copies the function modules kernelize sets
    hub_functions(model)

    @kernels.use_kernel_forward_from_hub("SwiGLUMLP")
    class RegisteredMLP(LlamaMLP):
        pass

    model.model.layers[0].mlp.__class__ = RegisteredMLP
    names = _registered(model)
    assert {"RMSNorm", "rotary_pos_emb", "SiLU", "SwiGLUMLP"} <= names
    mapping = {name: {"cpu": tigon_kernels.local_layer_repository(name)} for name in names}
    with warnings.catch_warnings(record=True) as caught, kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        warnings.simplefilter("always")
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    assert not [w for w in caught if "No kernel mapping" in str(w.message)]
    ids, labels = batch(model.config.vocab_size, b=2, t=5)
    model.train()
    ref.train()
    ops.dispatch_counts.clear()
    loss = model(input_ids=ids, labels=labels).loss
    assert op_calls("rms_norm") == 3 and op_calls("apply_rope") == 1 and op_calls("swiglu_mlp") == 1
    _step_matches(model, loss, ref, ids, labels)
    assert model.state_dict().keys() == ref.state_dict().keys()  # the layers hold no state of their own


def test_rope_layer_keeps_hfs_function_where_tigon_has_no_rope():
    """gpt_oss registers "rotary_pos_emb" on a RoPE over half-width cos/sin that Tigon does not run (registry:
    rope=False): the layer calls transformers' function. Llama's runs Tigon's op, with the same result."""
    _kernels()
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    for fn, cos, ours in ((modeling_llama.apply_rotary_pos_emb, torch.randn(1, 3, 8, generator=g), 1),
                          (modeling_gpt_oss.apply_rotary_pos_emb, torch.randn(1, 3, 4, generator=g), 0)):
        sin = torch.randn(cos.shape, generator=g)
        want = fn(q, k, cos, sin)
        ops.dispatch_counts.clear()
        got = tigon_kernels.rotary_forward(fn, q, k, cos, sin)
        assert op_calls("apply_rope") == ours
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tigons_config_maps_only_the_names_a_model_registers():
    _kernels()
    config = tigon_kernels.kernel_config("cuda")  # HF's check of a device-keyed mapping takes accelerators only
    model = tiny_model("gemma", num_hidden_layers=1)  # rotary_pos_emb and GeluTanh; GemmaRMSNorm is not registered
    config.sanitize_kernel_mapping(model)
    assert set(config.kernel_mapping) == {"rotary_pos_emb", "GeluTanh"}


def test_mlp_layer_refuses_a_module_without_gated_projections():
    with pytest.raises(TypeError, match="tigon kernel layer SwiGLUMLP: Linear cannot run it"):
        tigon_kernels.mlp_forward(torch.nn.Linear(4, 4), torch.randn(2, 4), "swiglu")
