"""Liger-Kernel's patching API on top of tigon: change `liger_kernel.transformers` to
`tigon.compat.liger` and the script runs on Tigon's kernels.

    from tigon.compat.liger import apply_liger_kernel_to_llama, AutoLigerKernelForCausalLM
"""

from ..hf import registry
from ..hf.patch import patch


def _apply_for(model_type):
    def apply(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
              model=None, **ignored):
        if cross_entropy and fused_linear_cross_entropy:
            raise ValueError("cross_entropy and fused_linear_cross_entropy cannot both be True")
        return patch(model, model_type=None if model is not None else model_type, rope=rope, rms_norm=rms_norm,
                     swiglu=swiglu, cross_entropy=cross_entropy,
                     fused_linear_cross_entropy=fused_linear_cross_entropy)

    apply.__name__ = f"apply_liger_kernel_to_{model_type}"
    apply.__doc__ = f"Patch {model_type} models with Tigon (Liger-Kernel's signature)."
    return apply


for _model_type in registry.FAMILIES:
    globals()[f"apply_liger_kernel_to_{_model_type}"] = _apply_for(_model_type)


class AutoLigerKernelForCausalLM:
    """AutoModelForCausalLM.from_pretrained, then tigon.patch of the model's family."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from transformers import AutoModelForCausalLM

        patch_kwargs = {k: kwargs.pop(k) for k in ("rope", "rms_norm", "swiglu", "cross_entropy",
                                                    "fused_linear_cross_entropy") if k in kwargs}
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        patch(model, **patch_kwargs)
        return model

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, **kwargs)
        patch(model)
        return model
