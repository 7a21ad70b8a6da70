"""tigon.compat.liger: Liger-Kernel 0.8.5's apply_liger_kernel_to_<family> signatures, exactly and strictly."""

import inspect

import pytest

from tests.hf._tiny import tiny_config
from tigon.compat import liger
from tigon.hf import registry

# liger_kernel/transformers/monkey_patch.py of liger-kernel 0.8.5: (parameter, default) in order
LLAMA = [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
         ("swiglu", True), ("model", None)]
GEMMA = [("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
         ("geglu", True), ("model", None)]
LIGER_0_8_5 = {
    **{f: LLAMA for f in ("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3",
                          "smollm3", "exaone4", "hunyuan_v1_dense", "olmo2", "olmo3")},
    **{f: GEMMA for f in ("gemma", "gemma2", "gemma3_text")},
    "granite": [("rope", True), ("cross_entropy", True), ("fused_linear_cross_entropy", False), ("rms_norm", True),
                ("swiglu", True), ("model", None)],
    "glm4": [("rope", False)] + LLAMA[1:],
}


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.fixture
def calls(monkeypatch):
    """What the apply functions hand to tigon.patch, without patching anything."""
    seen = []
    monkeypatch.setattr(liger, "patch", lambda model=None, **kw: seen.append((model, kw)) or "report")
    return seen


@pytest.mark.parametrize("family", sorted(LIGER_0_8_5))
def test_signature_is_liger_0_8_5s(family):
    fn = getattr(liger, f"apply_liger_kernel_to_{family}")
    assert _params(fn) == LIGER_0_8_5[family]
    assert fn.__name__ == f"apply_liger_kernel_to_{family}"
    kinds = {p.kind for p in inspect.signature(fn).parameters.values()}
    assert kinds == {inspect.Parameter.POSITIONAL_OR_KEYWORD}  # no **kwargs swallowing typos


def test_every_tigon_family_has_a_strict_apply_function():
    for family in registry.FAMILIES:
        fn = liger.APPLY_FUNCTIONS[family]
        assert getattr(liger, fn.__name__) is fn and _params(fn)[-1] == ("model", None)
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
    assert calls[-1] == (model, dict(model_type=None, rope=False, cross_entropy=False,
                                     fused_linear_cross_entropy=True, rms_norm=False, swiglu=True))
    liger.apply_liger_kernel_to_gemma2(geglu=False)  # class-level; geglu is tigon.patch's swiglu flag
    assert calls[-1] == (None, dict(model_type="gemma2", rope=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True, rms_norm=True, swiglu=False))
    liger.apply_liger_kernel_to_granite()  # Liger's Granite defaults: cross entropy, no fused linear one
    assert calls[-1][1]["cross_entropy"] is True and calls[-1][1]["fused_linear_cross_entropy"] is False
    with pytest.raises(ValueError, match="apply_liger_kernel_to_llama: cross_entropy and fused_linear_cross_entropy"):
        liger.apply_liger_kernel_to_llama(cross_entropy=True)
    assert len(calls) == 3


def test_auto_class_hands_the_flags_to_the_familys_apply_function(calls):
    model = liger.AutoLigerKernelForCausalLM.from_config(tiny_config("llama"), rope=False, rms_norm=False)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert calls[-1] == (model, dict(model_type=None, rope=False, cross_entropy=False,
                                     fused_linear_cross_entropy=True, rms_norm=False, swiglu=True))
    gemma = tiny_config("gemma2")
    liger.AutoLigerKernelForCausalLM.from_config(gemma, geglu=False)
    assert calls[-1][1]["swiglu"] is False
    with pytest.raises(TypeError, match=r"apply_liger_kernel_to_gemma2\(\) got an unexpected keyword argument "
                                        r"'swiglu'"):
        liger.AutoLigerKernelForCausalLM.from_config(gemma, swiglu=False)
