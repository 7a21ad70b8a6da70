"""What to swap in each transformers model family: a data table, read by one generic patcher.

A row names the family's modeling module and, per piece, the HF names to replace:
- norms: RMSNorm class name -> (casting_mode, offset) of the formula that class computes;
- mlps: MLP class name -> "glu" (gate_proj/up_proj/down_proj) or "fused_glu" (Phi-3's gate_up_proj);
  the activation comes from the config (silu -> SwiGLU, gelu tanh -> GeGLU; others stay HF);
- rope: the module-level function that attention calls (rotate-half convention only);
- causal_lm: the ForCausalLM class whose forward gets the fused loss.
A family that lacks a piece leaves it out; the patch report says so. The casting of each norm row is
checked against the HF class by tests/hf/test_patch.py (every row of FAMILIES) and
tests/hf/test_registry_families.py (the text towers), so a wrong row fails CI.

Vision-language models: TOWERS holds the rows of language models that live inside a vision-language model's
modeling module (Qwen2-VL's Qwen2VLTextModel, model_type "qwen2_vl_text"); family_for finds them like any row,
so tigon.patch(vlm.model.language_model) patches the text tower. VISION_LANGUAGE names, per vision-language
model type, the model type of its text tower (None: the tower's own config says, as in Llava, whose language
model is any family).
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
    # A config attribute of multipliers the HF MLP applies inside and after the GLU (Falcon-H1's mlp_multipliers):
    # the MLP is fused only where they are all 1.
    mlp_multipliers: str = ""
    # The DecoderLayer forward is Llama's pre-norm block (norm, attention, add, norm, MLP, add), so the
    # first add and the second norm can be one add_rms_norm; tests/hf/test_patch.py checks the source.
    prenorm_layer: bool = False
    norm_class: str = "RMSNorm"  # suffix of the norm class after the prefix (Llama-4's "TextRMSNorm"); "": none
    mlp_prefix: str = ""  # class-name prefix of the MLP where it is not `prefix` (Qwen2-VL's text MLP is Qwen2MLP)
    notes: str = ""

    @property
    def modeling(self) -> str:
        return f"transformers.models.{self.module}.modeling_{self.module}"

    @property
    def norm_classes(self) -> dict:
        if not self.norm_class:
            return {}
        return {f"{self.prefix}{self.norm_class}": self.norm,
                **{f"{self.prefix}{s}": self.norm for s in self.extra_norms}}

    @property
    def mlp_class_names(self) -> tuple:
        return tuple(f"{self.mlp_prefix or self.prefix}{s}" for s in self.mlp_classes) if self.mlp else ()

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
    Family("mixtral", "mixtral", "Mixtral", mlp="",
           notes="routed experts: the 'tigon' experts implementation (moe_experts)"),
    Family("qwen2", "qwen2", "Qwen2", prenorm_layer=True),
    Family("qwen2_moe", "qwen2_moe", "Qwen2Moe", notes="shared expert and experts' MLP class fused"),
    Family("qwen3", "qwen3", "Qwen3", prenorm_layer=True),
    Family("qwen3_moe", "qwen3_moe", "Qwen3Moe", prenorm_layer=True,
           notes="dense MLP class fused; routed experts: the 'tigon' experts implementation (moe_experts)"),
    Family("gemma", "gemma", "Gemma", prenorm_layer=True, norm=GEMMA_NORM),
    Family("gemma2", "gemma2", "Gemma2", norm=GEMMA_NORM),
    Family("gemma3_text", "gemma3", "Gemma3", norm=GEMMA_NORM),
    # Gemma-4's norm is ones-initialised, no offset, all fp32 (unlike Gemma-3's 1 + w); its scale-free norms
    # (with_scale=False: v_norm, the MoE router's) become weightless Tigon norms (RMSNorm.from_hf)
    Family("gemma4_text", "gemma4", "Gemma4", norm=FP32_WEIGHT_NORM, mlp_classes=("TextMLP",), rope=False,
           notes="RoPE is applied one tensor at a time (and proportional on full attention): stays HF; "
                 "the MoE block's routed experts stay HF"),
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
    Family("gpt_oss", "gpt_oss", "GptOss", norm=FP32_WEIGHT_NORM, mlp="", rope=False,
           notes="experts stay HF; RoPE on half-width cos/sin stays HF"),
    # The MoE layer adds the routed output into the shared expert's output in place (out.add_): the one-node
    # MLP returns a tensor of its own, not a view, so the dense and shared MLPs are fused.
    Family("llama4_text", "llama4", "Llama4", norm_class="TextRMSNorm", mlp_classes=("TextMLP",), rope=False,
           notes="complex (interleaved) RoPE and the routed experts stay HF; dense and shared MLPs fused"),
    Family("hunyuan_v1_moe", "hunyuan_v1_moe", "HunYuanMoEV1", notes="shared MLP fused; routed experts stay HF"),
    # Qwen3-Next's norm is (1 + weight) from zeros, found by isinstance in _init_weights as Qwen3.5's
    # (hf/class_patch.py)
    Family("qwen3_next", "qwen3_next", "Qwen3Next", norm=GEMMA_NORM, rope=False,
           notes="partial RoPE, the gated DeltaNet norm and the routed experts stay HF; dense and shared MLPs fused"),
    Family("deepseek_v2", "deepseek_v2", "DeepseekV2", prenorm_layer=True, rope=False,
           notes="interleaved (complex) RoPE and the routed experts stay HF; dense and shared MLPs fused"),
    Family("deepseek_v3", "deepseek_v3", "DeepseekV3", prenorm_layer=True, rope=False,
           notes="interleaved RoPE and the routed experts stay HF; dense and shared MLPs fused"),
    Family("deepseek_v4", "deepseek_v4", "DeepseekV4", mlp="", rope=False,
           notes="the MLPs clamp at swiglu_limit and the RoPE is interleaved: both stay HF"),
    Family("falcon_h1", "falcon_h1", "FalconH1", causal_lm="", mlp_multipliers="mlp_multipliers",
           notes="lm_head_multiplier keeps the HF loss; the Mamba mixer and its gated norm stay HF"),
    Family("nemotron", "nemotron", "Nemotron", norm_class="", mlp="", rope=False,
           notes="LayerNorm1P, the ReLU^2 MLP (not gated) and the partial RoPE stay HF: the fused loss only"),
]
FAMILIES = {row.model_type: row for row in _ROWS}

# Text towers of vision-language models (not built by AutoModelForCausalLM; causal_lm="" since the
# ForConditionalGeneration forward keeps Hugging Face's loss). mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V)
# stays Hugging Face's.
_TOWER_ROWS = [
    Family("qwen2_vl_text", "qwen2_vl", "Qwen2VL", mlp_prefix="Qwen2", rope=False, causal_lm="", notes="mRoPE"),
    Family("qwen2_5_vl_text", "qwen2_5_vl", "Qwen2_5_VL", mlp_prefix="Qwen2", rope=False, causal_lm="",
           notes="mRoPE"),
    Family("qwen3_vl_text", "qwen3_vl", "Qwen3VL", norm_class="TextRMSNorm", mlp_classes=("TextMLP",), rope=False,
           causal_lm="", notes="interleaved mRoPE"),
    Family("glm4v_text", "glm4v", "Glm4v", mlp="fused_glu", mlp_classes=("TextMLP",), rope=False, causal_lm="",
           notes="mRoPE"),
    # Qwen3.5's text models (also built alone as Qwen3_5ForCausalLM). Their norm computes x * (1 + weight) from a
    # zero weight, which HF's _init_weights sets by isinstance, missing Tigon's norm: a class-level patch also
    # gives the family's PreTrainedModel an _init_weights that zeroes Tigon's offset norms (hf/class_patch.py).
    Family("qwen3_5_text", "qwen3_5", "Qwen3_5", norm=GEMMA_NORM, rope=False,
           notes="mRoPE stays HF; the gated DeltaNet norm stays HF"),
    Family("qwen3_5_moe_text", "qwen3_5_moe", "Qwen3_5Moe", norm=GEMMA_NORM, rope=False,
           notes="shared expert's MLP fused; routed experts, mRoPE and the gated DeltaNet norm stay HF"),
    Family("glm4v_moe_text", "glm4v_moe", "Glm4vMoeText", norm_class="RMSNorm", mlp_classes=("MLP",), rope=False,
           prenorm_layer=True, causal_lm="", notes="mRoPE and the routed experts stay HF; dense and shared MLPs fused"),
    Family("qwen3_vl_moe_text", "qwen3_vl_moe", "Qwen3VLMoe", norm_class="TextRMSNorm", mlp_classes=("TextMLP",),
           rope=False, causal_lm="", notes="interleaved mRoPE and the routed experts stay HF"),
    # MuseGlimmer's scale-free and final norms (MuseGlimmerRMSNorm, with_scale=False on some) stay HF
    Family("muse_glimmer_text", "muse_glimmer", "MuseGlimmer", norm=GEMMA_NORM, norm_class="TextCenteredRMSNorm",
           mlp_classes=("TextMLP",), causal_lm="", notes="the scale-free and final norms stay HF"),
    # Pixtral is a vision tower (Llava's, in Mistral-3 and Pixtral checkpoints); its 2-D RoPE stays HF's
    Family("pixtral", "pixtral", "Pixtral", rope=False, causal_lm="", notes="2-D RoPE"),
    Family("mllama_text_model", "mllama", "Mllama", norm_class="TextRMSNorm", mlp_classes=("TextMLP",),
           notes="cross-attention layers' norms fused as well"),
]
TOWERS = {row.model_type: row for row in _TOWER_ROWS}
VISION_LANGUAGE = {
    "gemma3": "gemma3_text", "gemma4": "gemma4_text", "llama4": "llama4_text", "mllama": "mllama_text_model",
    "qwen2_vl": "qwen2_vl_text",
    "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text", "glm4v": "glm4v_text", "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text", "glm4v_moe": "glm4v_moe_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
    "muse_glimmer": "muse_glimmer_text", "llava": None, "paligemma": None, "internvl": None, "smolvlm": None,
}


def family_for(model_type: str, caller: str = "tigon.patch", argument: str = "model_type") -> Family:
    """The row of `model_type`; a ValueError naming `caller` and `argument` (with close names) if there is none."""
    _log.get_logger()  # every patch() looks its family up first: TIGON_LOG's handler is in place for its report
    row = FAMILIES.get(model_type) or TOWERS.get(model_type)
    if row is not None:
        return row
    close = difflib.get_close_matches(model_type, [*FAMILIES, *TOWERS], n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    if model_type in VISION_LANGUAGE:
        hint += ("; it is a vision-language model: patch its language model (tigon.patch(model.model.language_model))"
                 f" or call tigon.compat.liger.apply_liger_kernel_to_{model_type}(model=model)")
    raise ValueError(
        f"{caller}: {argument} {model_type!r} is not supported{hint}; supported: "
        f"{', '.join(sorted([*FAMILIES, *TOWERS]))}"
    )


def mlp_kept(family: Family, config) -> str:
    """Why the family's MLP stays Hugging Face's for this config, or "" where Tigon's computes the same."""
    if mlp_activation(config) is None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        return f"activation {act!r} is not silu or gelu-tanh"
    p = getattr(config, family.mlp_dropout, 0.0) if family.mlp_dropout else 0.0
    if p:
        return f"the MLP applies {family.mlp_dropout}={p} to its output in training"
    scales = getattr(config, family.mlp_multipliers, None) if family.mlp_multipliers else None
    if scales is not None and any(float(m) != 1.0 for m in scales):
        return f"the MLP scales by {family.mlp_multipliers}={list(scales)}"
    return ""


def mlp_activation(config):
    """'swiglu', 'geglu' or None (an activation Tigon does not fuse) for the config's MLP."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act in SWIGLU_ACTS:
        return "swiglu"
    if act in GEGLU_ACTS:
        return "geglu"
    return None
