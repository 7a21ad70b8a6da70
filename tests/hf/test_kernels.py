"""tigon.hf.kernels: transformers' kernel mechanism (KernelConfig, kernelize) running Tigon's layers from the local
kernel repository shipped in the package. The kernelize tests need the `kernels` package in the version range
transformers accepts (5.17: >= 0.16, < 0.17; pip install tigon[kernels]) and skip without it."""

import copy
import json

import pytest
import torch

from tests.hf._tiny import batch, op_calls, tiny_model
from tigon import ops
from tigon.hf import kernels as tigon_kernels


def _kernels():
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("the `kernels` package in transformers' supported range is not installed")
    import kernels

    return kernels


def test_the_repository_has_the_layout_kernels_loads():
    variant = tigon_kernels.KERNEL_REPO / "build" / "torch-universal"
    metadata = json.loads((variant / "metadata.json").read_text())
    assert {"id", "name", "license", "backend"} <= metadata.keys() and metadata["license"] == "Apache-2.0"
    assert (variant / "__init__.py").exists() and (variant / "layers.py").exists()
    assert tigon_kernels.kernel_mapping("cuda") == {"RMSNorm": {"cuda": f"{tigon_kernels.KERNEL_REPO}:RMSNorm"}}
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
def test_kernelize_runs_tigons_norm_with_each_familys_formula(model_type):
    kernels = _kernels()
    ref = tiny_model(model_type, num_hidden_layers=1)
    model = copy.deepcopy(ref)
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
    loss_ref = ref(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, loss_ref, rtol=2e-4, atol=2e-5)
    loss.backward()
    loss_ref.backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-3, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


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


def test_from_pretrained_use_kernels_runs_tigon_on_cpu(tmp_path):
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
    model = AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True, kernel_config=config)
    assert model.use_kernels
    ids, labels = batch(model.config.vocab_size, b=1, t=5)
    for train in (False, True):
        model.train(train)
        ref.train(train)
        ops.dispatch_counts.clear()
        loss = model(input_ids=ids, labels=labels).loss
        assert op_calls("rms_norm") == 3  # input, post-attention and final norms: Tigon's op, through kernelize
        torch.testing.assert_close(loss, ref(input_ids=ids, labels=labels).loss, rtol=2e-4, atol=2e-5)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
