"""What to swap in each transformers model family: a data table, read by one generic patcher.

A row names the family's modeling module and, per piece, the HF names to replace:
- norms: RMSNorm class name -> (casting_mode, offset) of the formula that class computes;
- mlps: MLP class name -> "glu" (gate_proj/up_proj/down_proj) or "fused_glu" (Phi-3's gate_up_proj);
  the activation comes from the config (silu -> SwiGLU, gelu tanh -> GeGLU; others stay HF);
- rope: the module-level function that attention calls (rotate-half convention only);
- causal_lm: the ForCausalLM class whose forward gets the fused loss.
A family that lacks a piece leaves it out; the patch report says so. The casting of each norm row is
checked against the HF class by tests/hf/test_registry.py, so a wrong row fails CI.
"""

import dataclasses
import difflib

from .. import _log

LLAMA_NORM = ("llama", 0.0)  # weight * x_normed.to(dtype)
GEMMA_NORM = ("gemma", 1.0)  # (x_normed * (1 + weight.float())).to(dtype)
FP32_WEIGHT_NORM = ("gemma", 0.0)  # (weight * x_normed).to(dtype), all fp32 (OLMo-2, Helium)

SWIGLU_ACTS = ("silu", "swish")
GEGLU_ACTS = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # class-name prefix in that module
    norm: tuple = LLAMA_NORM
    mlp: str = "glu"  # "glu", "fused_glu" or "" (no GLU MLP to fuse)
    mlp_classes: tuple = ("MLP",)  # suffixes after the prefix
    rope: bool = True
    causal_lm: str = "ForCausalLM"
    extra_norms: tuple = ()  # other RMSNorm class suffixes with the same formula
    # The config attribute of a dropout the HF MLP applies to its own output in training (Seed-OSS): the MLP is
    # fused only where it is 0, as Tigon's MLP has no dropout.
    mlp_dropout: str = ""
    # The DecoderLayer forward is Llama's pre-norm block (norm, attention, add, norm, MLP, add), so the
    # first add and the second norm can be one add_rms_norm; tests/hf/test_registry checks the source.
    prenorm_layer: bool = False
    notes: str = ""

    @property
    def modeling(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"

    @property
    def norm_classes(self) -> dict:
        return {f"{self.prefix}RMSNorm": self.norm, **{f"{self.prefix}{s}": self.norm for s in self.extra_norms}}

    @property
    def mlp_class_names(self) -> tuple:
        return tuple(f"{self.prefix}{s}" for s in self.mlp_classes) if self.mlp else ()

    @property
    def decoder_layer_class(self) -> str:
        return f"{self.prefix}DecoderLayer"

    @property
    def causal_lm_class(self) -> str:
        return f"{self.prefix}{self.causal_lm}"


_ROWS = [
    Family("llama", "llama", "Llama", prenorm_layer=True),
    Family("mistral", "mistral", "Mistral", prenorm_layer=True),
    Family("ministral", "ministral", "Ministral", prenorm_layer=True),
    Family("mixtral", "mixtral", "Mixtral", mlp="", notes="experts stay HF"),
    Family("qwen2", "qwen2", "Qwen2", prenorm_layer=True),
    Family("qwen2_moe", "qwen2_moe", "Qwen2Moe", notes="shared expert and experts' MLP class fused"),
    Family("qwen3", "qwen3", "Qwen3", prenorm_layer=True),
    Family("qwen3_moe", "qwen3_moe", "Qwen3Moe", prenorm_layer=True,
           notes="dense MLP class fused; routed experts stay HF"),
    Family("gemma", "gemma", "Gemma", prenorm_layer=True, norm=GEMMA_NORM),
    Family("gemma2", "gemma2", "Gemma2", norm=GEMMA_NORM),
    Family("gemma3_text", "gemma3", "Gemma3", norm=GEMMA_NORM),
    Family("phi3", "phi3", "Phi3", mlp="fused_glu", rope=True),
    Family("granite", "granite", "Granite", causal_lm="", notes="logits_scaling keeps the HF loss"),
    Family("smollm3", "smollm3", "SmolLM3", prenorm_layer=True),
    Family("exaone4", "exaone4", "Exaone4"),
    Family("seed_oss", "seed_oss", "SeedOss", prenorm_layer=True, mlp_dropout="residual_dropout"),
    Family("hunyuan_v1_dense", "hunyuan_v1_dense", "HunYuanDenseV1", prenorm_layer=True),
    Family("olmoe", "olmoe", "Olmoe", mlp=""),
    Family("olmo2", "olmo2", "Olmo2", norm=FP32_WEIGHT_NORM),
    Family("olmo3", "olmo3", "Olmo3", norm=FP32_WEIGHT_NORM),
    Family("glm", "glm", "Glm", mlp="fused_glu", rope=False, notes="interleaved RoPE stays HF"),
    Family("glm4", "glm4", "Glm4", mlp="fused_glu", rope=False, notes="interleaved RoPE stays HF"),
    Family("helium", "helium", "Helium", norm=FP32_WEIGHT_NORM, rope=False, notes="interleaved RoPE"),
    Family("arcee", "arcee", "Arcee", mlp="", notes="ReLU^2 MLP is not gated"),
    Family("apertus", "apertus", "Apertus", mlp="", notes="xIELU MLP is not gated"),
]
FAMILIES = {row.model_type: row for row in _ROWS}


def family_for(model_type: str, caller: str = "tigon.patch", argument: str = "model_type") -> Family:
    """The row of `model_type`; a ValueError naming `caller` and `argument` (with close names) if there is none."""
    _log.get_logger()  # every patch() looks its family up first: TIGON_LOG's handler is in place for its report
    try:
        return FAMILIES[model_type]
    except KeyError:
        close = difflib.get_close_matches(model_type, FAMILIES, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(
            f"{caller}: {argument} {model_type!r} is not supported{hint}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None


def mlp_kept(family: Family, config) -> str:
    """Why the family's MLP stays Hugging Face's for this config, or "" where Tigon's computes the same."""
    if mlp_activation(config) is None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        return f"activation {act!r} is not silu or gelu-tanh"
    p = getattr(config, family.mlp_dropout, 0.0) if family.mlp_dropout else 0.0
    if p:
        return f"the MLP applies {family.mlp_dropout}={p} to its output in training"
    return ""


def mlp_activation(config):
    """'swiglu', 'geglu' or None (an activation Tigon does not fuse) for the config's MLP."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act in SWIGLU_ACTS:
        return "swiglu"
    if act in GEGLU_ACTS:
        return "geglu"
    return None
