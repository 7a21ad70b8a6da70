"""Liger-Kernel's patching API on top of tigon: change `liger_kernel.transformers` to
`tigon.compat.liger` and the script runs on Tigon's kernels.

    from tigon.compat.liger import apply_liger_kernel_to_llama, AutoLigerKernelForCausalLM
    from tigon.compat.liger import _apply_liger_kernel_to_instance   # what transformers' Trainer calls

Every apply_liger_kernel_to_<family> takes liger-kernel 0.8.5's parameters (names, order, defaults), so a call
written for Liger binds the same way here, a misspelled flag is a TypeError in both, and the kwargs filtering
of transformers' Trainer and axolotl (`inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type])`) keeps
the same keys. Each returns tigon.patch's PatchReport (Liger's return None), which lists what ran and what
was left to Hugging Face and why.

Tigon's training-memory options of tigon.patch, `offload_checkpoints`, `tile_mlp` and `keep_activations`
(TIGON_KEYS), ride along where a model instance is patched: the Trainer's (and TRL's SFTConfig's)
`liger_kernel_config={"offload_checkpoints": True, "tile_mlp": True}`, `apply_liger_kernel_to_<family>(model=m,
offload_checkpoints=True)`, `AutoLigerKernelForCausalLM.from_pretrained(..., tile_mlp=True)`. No Liger signature
lists them, so transformers' filtering by signature is unchanged.
"""

import difflib
import inspect
import sys
import types

import torch

from .. import _log

try:
    from ..hf import registry
    from ..hf.patching import patch_hf_model
    from ..hf.unwrap import unwrap_model
except ModuleNotFoundError as e:  # transformers (the [hf] extra) missing: say which extra, not a bare traceback
    if (e.name or "").split(".")[0] not in ("transformers", "accelerate", "peft"):
        raise
    raise ImportError(f'tigon.compat.liger needs {e.name.split(".")[0]}: pip install "tigon[hf]"') from e
from . import liger_alias, liger_chunked_loss
from .liger_ce_options import liger_fused_linear_cross_entropy
from .liger_chunked_loss import *  # noqa: F403  (liger_kernel.chunked_loss's classes, on Tigon's losses)
from .liger_chunked_loss import __all__ as _chunked_loss_names
from .liger_divergences import *  # noqa: F403  (Liger's JSD / KL / TVD losses)
from .liger_divergences import __all__ as _divergence_names
from .liger_layers import *  # noqa: F403  (Liger's layers Tigon has no kernel for, in PyTorch or on Tigon's ops)
from .liger_layers import __all__ as _layer_names
from .liger_modules import *  # noqa: F403  (Liger's module classes, on Tigon's ops)
from .liger_modules import __all__ as _module_names

_ORDER = ("relu_squared", "rope", "cross_entropy", "fused_linear_cross_entropy", "layer_norm", "rms_norm",
          "swiglu", "geglu", "model")
_DEFAULTS = dict(relu_squared=True, rope=True, cross_entropy=False, fused_linear_cross_entropy=True, layer_norm=True,
                 rms_norm=True, swiglu=True, geglu=True, model=None)


# tigon.patch's options that no Liger function takes, honoured wherever a model instance is patched
TIGON_KEYS = ("offload_checkpoints", "tile_mlp", "keep_activations")


def _params(names, **defaults):
    """(name, default) pairs of a Liger signature written as a space-separated list ("**" for **kwargs)."""
    return tuple((n, defaults.get(n, _DEFAULTS.get(n))) for n in names.split())


# liger-kernel 0.8.5, liger_kernel/transformers/monkey_patch.py: the parameters of each apply function
_LLAMA = _params("rope cross_entropy fused_linear_cross_entropy rms_norm swiglu model")
_NO_ROPE = _params("rope cross_entropy fused_linear_cross_entropy rms_norm swiglu model", rope=False)
_GEMMA = _params("rope cross_entropy fused_linear_cross_entropy rms_norm geglu model")
_GEMMA_VLM = _params("rope cross_entropy fused_linear_cross_entropy layer_norm rms_norm geglu model")
_TEXT_TOWER = _params("cross_entropy fused_linear_cross_entropy rms_norm layer_norm model **")
LIGER_PARAMETERS = {
    "gemma": _GEMMA, "gemma2": _GEMMA, "gemma3_text": _GEMMA,
    "gemma3": _GEMMA_VLM, "paligemma": _GEMMA_VLM,
    "gemma4_text": _params("rope cross_entropy fused_linear_cross_entropy rms_norm geglu model", rope=False),
    "gemma4": _params("rope cross_entropy fused_linear_cross_entropy layer_norm rms_norm geglu model", rope=False,
                      layer_norm=False),
    "granite": _params("rope cross_entropy fused_linear_cross_entropy rms_norm swiglu model", cross_entropy=True,
                       fused_linear_cross_entropy=False),
    **dict.fromkeys(("glm4", "glm4v", "glm4v_moe", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                     "qwen3_5_moe_text", "deepseek_v2", "deepseek_v3"), _NO_ROPE),
    "deepseek_v4": _params("rope cross_entropy fused_linear_cross_entropy rms_norm swiglu model", rope=False,
                           swiglu=False),
    "nemotron": _params("relu_squared cross_entropy fused_linear_cross_entropy model **"),
    "pixtral": _params("rope rms_norm swiglu model"),
    "muse_glimmer": _params("rope cross_entropy fused_linear_cross_entropy layer_norm rms_norm swiglu model"),
    **dict.fromkeys(("gpt_oss", "qwen3_vl", "qwen3_vl_text"),
                    _params("rope cross_entropy fused_linear_cross_entropy rms_norm swiglu model", swiglu=False)),
    **dict.fromkeys(("llama4", "llama4_text"),
                    _params("rope cross_entropy fused_linear_cross_entropy rms_norm swiglu model layer_norm")),
    **dict.fromkeys(("mllama", "mllama_text_model"),
                    _params("rope cross_entropy fused_linear_cross_entropy layer_norm rms_norm swiglu model")),
    **dict.fromkeys(("qwen2_vl", "qwen2_vl_text"),
                    _params("rope cross_entropy fused_linear_cross_entropy rms_norm layer_norm swiglu model")),
    "internvl": _TEXT_TOWER, "smolvlm": _TEXT_TOWER,
    "llava": _params("cross_entropy fused_linear_cross_entropy model **"),
    **dict.fromkeys(("llama", "mistral", "ministral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "smollm3",
                     "exaone4", "hunyuan_v1_dense", "hunyuan_v1_moe", "olmo2", "olmo3", "qwen2_5_vl",
                     "qwen2_5_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "falcon_h1"), _LLAMA),
}
# Liger names some functions after a family and maps several model types to them (llama4_text -> llama4)
_LIGER_FUNCTION_NAME = {"llama4_text": "llama4", "mllama_text_model": "mllama", "qwen2_vl_text": "qwen2_vl",
                        "qwen2_5_vl_text": "qwen2_5_vl", "qwen3_vl_text": "qwen3_vl",
                        "qwen3_vl_moe_text": "qwen3_vl_moe", "qwen3_5_text": "qwen3_5",
                        "qwen3_5_moe_text": "qwen3_5_moe"}
# Vision-language model types: their language model (text tower) is patched as its own row; the vision tower is
# left as it is
_TEXT_TOWER_TYPES = tuple(registry.VISION_LANGUAGE)


def _signature(params) -> inspect.Signature:
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD) if name == "**" else
                              inspect.Parameter(name, kind, default=default) for name, default in params])


def _bind(name, signature, args, kwargs):
    """(model, extra keywords, Liger's flags, Tigon's options) of one call: TIGON_KEYS are taken out before the
    Liger signature binds the rest."""
    tigon = {k: kwargs.pop(k) for k in TIGON_KEYS if k in kwargs}
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        known = [*signature.parameters, *TIGON_KEYS]
        close = [difflib.get_close_matches(k, known, n=1) for k in kwargs if k not in signature.parameters]
        hint = f" (did you mean {close[0][0]!r}?)" if close and close[0] else ""
        raise TypeError(f"{name}() {e}{hint}; it takes {', '.join(signature.parameters)} (and on a model, "
                        f"{', '.join(TIGON_KEYS)})") from None
    bound.apply_defaults()
    flags = dict(bound.arguments)
    model = flags.pop("model")
    if tigon and model is None:
        raise ValueError(f"{name}: {', '.join(tigon)} is set on a model instance: {name}(model=model, "
                         f"{next(iter(tigon))}=...)")
    return model, flags.pop("kwargs", {}), flags, tigon


def _patch_flags(name, flags):
    """tigon.patch's keyword arguments from Liger's flags: geglu is patch's swiglu (the gated MLP whatever its
    activation), a flag the Liger function does not take is off (layer_norm where Liger has none)."""
    if flags.get("cross_entropy") and flags.get("fused_linear_cross_entropy"):
        raise ValueError(f"{name}: cross_entropy and fused_linear_cross_entropy cannot both be True")
    return dict(rope=flags.get("rope", False), cross_entropy=flags.get("cross_entropy", False),
                fused_linear_cross_entropy=flags.get("fused_linear_cross_entropy", False),
                rms_norm=flags.get("rms_norm", False), swiglu=flags.get("swiglu", flags.get("geglu", False)),
                layer_norm=flags.get("layer_norm", False))


def _text_tower(model):
    """The language model inside a vision-language model (LlavaModel.language_model, SmolVLM's text_model)."""
    inner = getattr(model, "model", model)
    for name in ("language_model", "text_model"):
        tower = getattr(inner, name, None)
        if tower is not None:
            return tower
    return None


def _apply_text_tower(name, vlm_type, model, extra, flags, tigon):
    """A vision-language model: Tigon's patch on its language model, and with layer_norm=True (where Liger's
    function takes it) on the plain LayerNorms of the rest (vision tower, projector). Liger's functions with
    **kwargs (Llava, InternVL, SmolVLM) hand their flags and the extra keywords to the language model's own apply
    function, dropping (with a warning) those it does not take; the others patch the tower with their own flags.
    Tigon's options (TIGON_KEYS) go to the language model's patch."""
    logger = _log.get_logger()
    text_type = registry.VISION_LANGUAGE[vlm_type]
    spec = {**_patch_flags(name, flags), "layer_norm": False}  # the text towers have no LayerNorm
    if model is None:
        if text_type is None:
            logger.warning("%s: a class-level patch needs the language model's family, which a %s config does not "
                           "fix; call it with model= (nothing patched)", name, vlm_type)
            return None
        report = patch_hf_model(model_type=text_type, **spec)
        if spec["cross_entropy"]:
            report.skip("loss_function (cross_entropy)", f"the {vlm_type} ForConditionalGeneration keeps HF's loss")
        if flags.get("layer_norm"):
            report.skip("LayerNorm (vision tower)", "the vision tower builds torch.nn.LayerNorm itself: patched on "
                        "a model instance (model=...)")
        return report
    hf = unwrap_model(model, name)
    tower = _text_tower(hf)
    tower_type = getattr(getattr(tower, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(tower_type)
    if apply is None or tower_type in _TEXT_TOWER_TYPES:
        logger.warning("%s: the language model (%s) is not a family Tigon patches; left as it is", name, tower_type)
        return None
    if not any(n == "**" for n, _ in LIGER_PARAMETERS.get(vlm_type, _LLAMA)):
        report = patch_hf_model(tower, **spec, **tigon)
    else:
        kwargs = {**{k: v for k, v in flags.items() if k != "layer_norm"}, **extra}
        taken = inspect.signature(apply).parameters
        dropped = sorted(set(kwargs) - set(taken))
        if dropped:
            logger.warning("%s: %s does not take %s; applied without them", name, apply.__name__, ", ".join(dropped))
        report = apply(model=tower, **{k: v for k, v in kwargs.items() if k in taken}, **tigon)
    if flags.get("layer_norm") and report is not None:
        _patch_layer_norms(hf, tower, report)
    return report


def _patch_layer_norms(hf, tower, report):
    """Every torch.nn.LayerNorm itself (not a subclass: Nemotron's LayerNorm1P computes another formula) outside
    the text tower becomes Tigon's LayerNorm on the same Parameters. Recorded in the text tower's undo list, so
    tigon.unpatch(text tower) restores them with the rest of this call's patch."""
    from ..modules import LayerNorm

    inside = {id(m) for m in tower.modules()}
    undo = tower.__dict__.setdefault("_tigon_undo", [])
    n = 0
    for parent in list(hf.modules()):
        if id(parent) in inside:
            continue
        for child_name, child in list(parent.named_children()):
            if type(child) is torch.nn.LayerNorm and len(child.normalized_shape) == 1:
                undo.append((parent, child_name, child))
                setattr(parent, child_name, LayerNorm.from_hf(child))
                n += 1
    if n:
        report.add("LayerNorm (vision tower, torch.nn.LayerNorm)", n)
    else:
        report.skip("LayerNorm (vision tower)", "no torch.nn.LayerNorm outside the language model")


def _apply_for(model_type):
    name = f"apply_liger_kernel_to_{_LIGER_FUNCTION_NAME.get(model_type, model_type)}"
    row = registry.FAMILIES.get(model_type) or registry.TOWERS.get(model_type)
    # a family Liger lacks takes Llama's parameters, rope off by default where Tigon leaves the RoPE to HF
    params = LIGER_PARAMETERS.get(model_type, _LLAMA if row is None or row.rope else _NO_ROPE)
    signature = _signature(params)

    def apply(*args, **kwargs):
        model, extra, flags, tigon = _bind(name, signature, args, kwargs)
        if model_type in _TEXT_TOWER_TYPES:
            _patch_flags(name, flags)  # the same ValueError for contradicting flags
            return _apply_text_tower(name, model_type, model, extra, flags, tigon)
        spec = _patch_flags(name, flags)
        # cross_entropy=True class-level: the ForCausalLM's loss_function too
        report = (patch_hf_model(model, **spec, **tigon) if model is not None
                  else patch_hf_model(model_type=model_type, **spec))
        if flags.get("relu_squared"):
            report.skip("ReLU^2", "Tigon has no ReLU^2 kernel: the MLP's activation stays HF's")
        return report

    apply.__name__ = apply.__qualname__ = name
    apply.__signature__ = signature
    source = ("liger-kernel 0.8.5's signature" if model_type in LIGER_PARAMETERS
              else "not in liger-kernel 0.8.5: Llama's")
    apply.__doc__ = (f"Patch {model_type} models (the class, or `model` only) with Tigon ({source}). "
                     f"With model=, also tigon.patch's {', '.join(TIGON_KEYS)}. TypeError for an argument it "
                     "does not take.")
    return apply


MODEL_TYPE_TO_APPLY_LIGER_FN = {t: _apply_for(t) for t in [*registry.FAMILIES, *registry.TOWERS, *_TEXT_TOWER_TYPES]}
APPLY_FUNCTIONS = MODEL_TYPE_TO_APPLY_LIGER_FN  # the name earlier Tigon releases used
# One public function per name: where Liger maps two model types to one function (qwen2_vl_text -> qwen2_vl), the
# family's own (each patches an instance as its config says; class-level, the classes the two rows share).
globals().update({fn.__name__: fn for t, fn in sorted(MODEL_TYPE_TO_APPLY_LIGER_FN.items(),
                                                      key=lambda item: item[0] in _LIGER_FUNCTION_NAME, reverse=True)})


def _unsupported(caller, model_type, strict):
    message = (f"{caller}: Tigon has no kernels for model type {model_type!r}; the model is left as it is "
               f"(supported: {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))})")
    if strict:
        raise ValueError(message)
    _log.get_logger().warning("%s", message)


def _applicable(apply, kwargs):
    parameters = inspect.signature(apply).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return {k: v for k, v in kwargs.items() if k != "model"}
    return {k: v for k, v in kwargs.items() if k in parameters and k != "model"}


def _warn_unknown(caller, kwargs, applicable):
    """Keys dropped that no apply function takes and Tigon does not know either (a misspelled key, not another
    family's flag): one warning, with the closest known name."""
    known = {n for fn in MODEL_TYPE_TO_APPLY_LIGER_FN.values() for n in inspect.signature(fn).parameters} - {"kwargs"}
    known.update(TIGON_KEYS)
    unknown = sorted(k for k in kwargs if k not in applicable and k not in known and k != "model")
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known), n=1)
        _log.get_logger().warning("%s: %r is not a flag of any apply function nor of Tigon%s; ignored", caller, key,
                                  f" (did you mean {close[0]!r}?)" if close else "")


def _apply_liger_kernel(model_type, *, strict=False, **kwargs):
    """Liger's pre-initialization entry point: the class-level patch of `model_type`'s family with the keyword
    arguments its apply function takes (the others are dropped, as Liger does). A model type Tigon does not
    cover logs a warning and patches nothing, or raises ValueError with strict=True."""
    if not model_type:
        _log.get_logger().info("_apply_liger_kernel: no model type given; nothing patched")
        return None
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return _unsupported("_apply_liger_kernel", model_type, strict)
    applicable = {k: v for k, v in _applicable(apply, kwargs).items() if k not in TIGON_KEYS}
    left = [k for k in TIGON_KEYS if k in kwargs]
    if left:
        _log.get_logger().info("_apply_liger_kernel: %s set on a model instance only (the Trainer's "
                               "_apply_liger_kernel_to_instance); not applied to the class", ", ".join(left))
    _log.get_logger().info("_apply_liger_kernel: %s with %s", apply.__name__, applicable)
    return apply(**applicable)


def _apply_liger_kernel_to_instance(model, *, strict=False, **kwargs):
    """What transformers' Trainer (use_liger_kernel=True, liger_kernel_config=kwargs; TRL's SFTConfig the same)
    and axolotl call: the family's apply function on this model instance, with the keyword arguments it takes,
    and Tigon's `offload_checkpoints`, `tile_mlp` and `keep_activations` (tigon.patch's; docs/memory/):

        TrainingArguments(..., gradient_checkpointing=True, use_liger_kernel=True,
                          liger_kernel_config={"offload_checkpoints": True, "tile_mlp": True})

    Other keys the function does not take are dropped, as Liger drops them (a config written for another
    family); one no function takes at all logs a warning naming the closest flag. A model type Tigon does not
    cover logs a warning and leaves the model alone (Liger's behaviour), or raises ValueError with strict=True."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type:
        if strict:
            raise ValueError("_apply_liger_kernel_to_instance: the model has no config.model_type")
        _log.get_logger().warning("_apply_liger_kernel_to_instance: the model has no config.model_type; left as "
                                  "it is")
        return None
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return _unsupported("_apply_liger_kernel_to_instance", model_type, strict)
    applicable = {**_applicable(apply, kwargs), **{k: kwargs[k] for k in TIGON_KEYS if k in kwargs}}
    _warn_unknown("_apply_liger_kernel_to_instance", kwargs, applicable)
    _log.get_logger().info("_apply_liger_kernel_to_instance: %s with %s", apply.__name__, applicable)
    return apply(model=model, **applicable)


def _split_flags(model_type, kwargs):
    """Liger's split of from_pretrained/from_config keywords: those the family's apply function takes (and
    Tigon's TIGON_KEYS) go to it, the rest to transformers (all of them for a model type Tigon does not cover)."""
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    taken = (set(inspect.signature(apply).parameters) - {"model", "kwargs"}) | set(TIGON_KEYS) if apply else set()
    return {k: v for k, v in kwargs.items() if k in taken}, {k: v for k, v in kwargs.items() if k not in taken}


class AutoLigerKernelForCausalLM:
    """AutoModelForCausalLM.from_pretrained / from_config, then the family's apply function on the model: the
    keyword arguments that function takes (e.g. rope=False, geglu=False for Gemma) and Tigon's TIGON_KEYS go to
    it, the rest to transformers, as in Liger-Kernel. A model type Tigon does not cover loads as it is, with a
    warning."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = kwargs.get("config")
        if config is None or isinstance(config, str):
            config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path,
                                                trust_remote_code=kwargs.get("trust_remote_code", False))
        flags, rest = _split_flags(config.model_type, kwargs)
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *args, **rest)
        return _patched(model, flags)

    @classmethod
    def from_config(cls, config, **kwargs):
        from transformers import AutoModelForCausalLM

        flags, rest = _split_flags(getattr(config, "model_type", None), kwargs)
        return _patched(AutoModelForCausalLM.from_config(config, **rest), flags)


def _patched(model, flags):
    _apply_liger_kernel_to_instance(model, **flags)
    return model


def is_transformers_available() -> bool:
    """Liger's check; True here, since this module imports only with transformers installed."""
    return True


# liger_kernel.transformers.monkey_patch's names (`from tigon.compat.liger import monkey_patch`): the apply functions,
# the Trainer's and axolotl's entry points, the model-type table
monkey_patch = types.ModuleType(f"{__name__}.monkey_patch", "liger_kernel.transformers.monkey_patch on Tigon")
_MONKEY_PATCH_NAMES = ("MODEL_TYPE_TO_APPLY_LIGER_FN", "_apply_liger_kernel", "_apply_liger_kernel_to_instance",
                       *(fn.__name__ for fn in MODEL_TYPE_TO_APPLY_LIGER_FN.values()))
monkey_patch.__dict__.update({n: globals()[n] for n in _MONKEY_PATCH_NAMES})


def install_as_liger_kernel():
    """Make `import liger_kernel.transformers` (and its submodules, liger_kernel.chunked_loss) give this module's
    names for this process, so transformers' Trainer with use_liger_kernel=True patches with Tigon. RuntimeError
    if the real liger_kernel is already imported; undo with uninstall_as_liger_kernel(). See liger_alias.py."""
    liger_alias.install(sys.modules[__name__], monkey_patch, liger_chunked_loss)


uninstall_as_liger_kernel = liger_alias.uninstall

__all__ = ["AutoLigerKernelForCausalLM", "MODEL_TYPE_TO_APPLY_LIGER_FN", "LIGER_PARAMETERS", "_apply_liger_kernel",
           "_apply_liger_kernel_to_instance", *sorted(fn.__name__ for fn in MODEL_TYPE_TO_APPLY_LIGER_FN.values()),
           *_module_names, *_layer_names, *_divergence_names, *_chunked_loss_names, "install_as_liger_kernel",
           "is_transformers_available", "liger_fused_linear_cross_entropy", "monkey_patch",
           "uninstall_as_liger_kernel"]
