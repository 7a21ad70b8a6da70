"""Liger-Kernel's patching API on top of tigon: change `liger_kernel.transformers` to
`tigon.compat.liger` and the script runs on Tigon's kernels.

    from tigon.compat.liger import apply_liger_kernel_to_llama, AutoLigerKernelForCausalLM
"""

import difflib
import inspect

from ..hf import registry
from ..hf.patch import patch

# liger-kernel 0.8.5's parameters of apply_liger_kernel_to_<family> (liger_kernel/transformers/monkey_patch.py),
# in its order and with its defaults, so that a call written for Liger binds the same way here and a misspelled
# flag is a TypeError in both. Families Liger does not have (qwen2_moe, olmoe, glm, ...) take Llama's.
_LLAMA = (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
          ("swiglu", True), ("model", None))
_GEMMA = (("rope", True), ("cross_entropy", False), ("fused_linear_cross_entropy", True), ("rms_norm", True),
          ("geglu", True), ("model", None))
_NO_ROPE = (("rope", False),) + _LLAMA[1:]  # interleaved RoPE: Liger raises on rope=True, Tigon leaves HF's
_PARAMETERS = {
    "gemma": _GEMMA, "gemma2": _GEMMA, "gemma3_text": _GEMMA,
    "granite": (("rope", True), ("cross_entropy", True), ("fused_linear_cross_entropy", False), ("rms_norm", True),
                ("swiglu", True), ("model", None)),
    "glm4": _NO_ROPE, "glm": _NO_ROPE,
}
_IN_LIGER = {"llama", "mistral", "ministral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2",
             "gemma3_text", "phi3", "granite", "smollm3", "exaone4", "hunyuan_v1_dense", "olmo2", "olmo3", "glm4"}


def _signature(model_type) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter(name, kind, default=default)
                              for name, default in _PARAMETERS.get(model_type, _LLAMA)])


def _apply_for(model_type):
    name = f"apply_liger_kernel_to_{model_type}"
    signature = _signature(model_type)

    def apply(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            close = [difflib.get_close_matches(k, signature.parameters, n=1) for k in kwargs
                     if k not in signature.parameters]
            hint = f" (did you mean {close[0][0]!r}?)" if close and close[0] else ""
            raise TypeError(f"{name}() {e}{hint}; it takes {', '.join(signature.parameters)}") from None
        bound.apply_defaults()
        flags = dict(bound.arguments)
        model = flags.pop("model")
        if "geglu" in flags:  # tigon.patch's swiglu flag covers the gated MLP of either activation
            flags["swiglu"] = flags.pop("geglu")
        if flags["cross_entropy"] and flags["fused_linear_cross_entropy"]:
            raise ValueError(f"{name}: cross_entropy and fused_linear_cross_entropy cannot both be True")
        return patch(model, model_type=None if model is not None else model_type, **flags)

    apply.__name__ = apply.__qualname__ = name
    apply.__signature__ = signature
    source = "Liger-Kernel 0.8.5's signature" if model_type in _IN_LIGER else "not in Liger-Kernel 0.8.5: Llama's"
    apply.__doc__ = (f"Patch {model_type} models (the class, or `model` only) with Tigon ({source}). "
                     "TypeError for an argument it does not take.")
    return apply


APPLY_FUNCTIONS = {model_type: _apply_for(model_type) for model_type in registry.FAMILIES}
globals().update({fn.__name__: fn for fn in APPLY_FUNCTIONS.values()})
# The flags any apply function takes: AutoLigerKernelForCausalLM hands them to the model's apply function (which
# refuses one its family does not take, e.g. swiglu= for Gemma) and the rest to transformers.
_FLAGS = {name for params in (_LLAMA, _GEMMA) for name, _ in params} - {"model"}


def _split_flags(kwargs):
    return {k: v for k, v in kwargs.items() if k in _FLAGS}, {k: v for k, v in kwargs.items() if k not in _FLAGS}


class AutoLigerKernelForCausalLM:
    """AutoModelForCausalLM.from_pretrained / from_config, then the family's apply function on the model: the
    keyword arguments that function takes (e.g. rope=False, geglu=False for Gemma) go to it, the rest to
    transformers, as in Liger-Kernel."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from transformers import AutoModelForCausalLM

        flags, rest = _split_flags(kwargs)
        return _patched(AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **rest), flags)

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        flags, rest = _split_flags(kwargs)
        return _patched(AutoModelForCausalLM.from_config(config, **rest), flags)


def _patched(model, flags):
    apply = APPLY_FUNCTIONS.get(model.config.model_type)
    if apply is None:  # tigon.patch names the model type it does not cover
        patch(model)
    else:
        apply(model=model, **flags)
    return model
