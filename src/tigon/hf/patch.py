"""tigon.patch() / tigon.unpatch(): one generic patcher driven by the family table in registry.py.

Two targets:
- a model instance: its norm and MLP submodules are replaced by Tigon modules that share the same
  Parameters (weights, state_dict keys, device and dtype unchanged) and its forward gets the fused loss;
- a model_type: the family's modeling module gets Tigon classes and functions, so models built afterwards
  (from_pretrained, from_config) come up fused.
Both are idempotent and fully reversible: every replacement is recorded with what it replaced.
"""

import collections
import dataclasses
import functools
import importlib
import logging
import os
import types

import torch

from . import causal_lm, registry

logger = logging.getLogger("tigon")
_CLASS_UNDO: dict = {}  # model_type -> [(owner, attribute, original)]
_PATCHED_CLASSES: dict = {}  # (model_type, HF class name) -> Tigon class built for it


@dataclasses.dataclass
class PatchReport:
    """What a patch() call replaced (counts per piece) and what it skipped (with the reason)."""

    model_type: str
    target: str
    replaced: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped: list = dataclasses.field(default_factory=list)

    def add(self, piece: str, n: int = 1) -> None:
        self.replaced[piece] += n

    def skip(self, piece: str, reason: str) -> None:
        self.skipped.append((piece, reason))

    def __str__(self) -> str:
        rows = [f"tigon.patch: {self.model_type} ({self.target})", f"  {'replaced':<58} {'count':>5}"]
        rows += [f"  {piece:<58} {n:>5}" for piece, n in sorted(self.replaced.items())]
        rows += [f"  skipped: {piece}: {reason}" for piece, reason in self.skipped]
        return "\n".join(rows)


def _rope_function():
    from ..ops import apply_rope

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    apply_rotary_pos_emb.__tigon__ = True
    return apply_rotary_pos_emb


def _norm_class(hf_name, casting_mode, offset):
    from ..modules import RMSNorm

    def __init__(self, hidden_size, eps=1e-6, **kwargs):
        RMSNorm.__init__(self, hidden_size, eps, offset=offset, casting_mode=casting_mode, **kwargs)

    return type(f"Tigon{hf_name}", (RMSNorm,), {"__init__": __init__, "__tigon__": True})


def _mlp_class(hf_cls, kind):
    """A class whose constructor builds the Tigon MLP, or the HF one when the activation is not fused."""
    from ..modules import GeGLUMLP, SwiGLUMLP

    def __new__(cls, config, *args, **kwargs):
        act = registry.mlp_activation(config)
        if act is None:
            return hf_cls(config, *args, **kwargs)
        intermediate = kwargs.get("intermediate_size", args[0] if args else None)
        target = SwiGLUMLP if act == "swiglu" else GeGLUMLP
        extra = {"fused_gate_up": True} if kind == "fused_glu" else {}
        return target(config, intermediate_size=intermediate, **extra)

    return type(f"Tigon{hf_cls.__name__}", (torch.nn.Module,), {"__new__": __new__, "__tigon__": True})


def _class_patch(family, report, spec):
    modeling = importlib.import_module(family.modeling)
    undo = _CLASS_UNDO.setdefault(family.model_type, [])

    def swap(owner, name, new, piece):
        current = getattr(owner, name)
        if getattr(current, "__tigon__", False):
            report.add(piece)  # already patched: idempotent
            return
        undo.append((owner, name, current))
        setattr(owner, name, new)
        report.add(piece)

    if spec["rms_norm"]:
        for hf_name, (mode, offset) in family.norm_classes.items():
            if hasattr(modeling, hf_name):
                cls = _PATCHED_CLASSES.setdefault((family.model_type, hf_name), _norm_class(hf_name, mode, offset))
                swap(modeling, hf_name, cls, f"RMSNorm class {hf_name}")
    if spec["swiglu"]:
        for hf_name in family.mlp_class_names:
            hf_cls = getattr(modeling, hf_name, None)
            if hf_cls is not None and not getattr(hf_cls, "__tigon__", False):
                cls = _PATCHED_CLASSES.setdefault((family.model_type, hf_name), _mlp_class(hf_cls, family.mlp))
                swap(modeling, hf_name, cls, f"MLP class {hf_name}")
            elif hf_cls is not None:
                report.add(f"MLP class {hf_name}")
    layer_cls = getattr(modeling, family.decoder_layer_class, None)
    if spec["rms_norm"] and family.prenorm_layer and layer_cls is not None:
        causal_lm.remember_hf_forward(layer_cls)
        swap(layer_cls, "forward", _tagged(causal_lm.fused_prenorm_decoder_forward),
             f"{layer_cls.__name__}.forward (residual add fused into the norm)")
    if spec["rope"] and family.rope:
        swap(modeling, "apply_rotary_pos_emb", _rope_function(), "function apply_rotary_pos_emb")
    _patch_causal_lm_class(family, modeling, spec, swap, report)


def _patch_causal_lm_class(family, modeling, spec, swap, report):
    cls = getattr(modeling, family.causal_lm_class, None) if family.causal_lm else None
    if cls is None:
        if spec["fused_linear_cross_entropy"]:
            report.skip("fused linear cross-entropy", family.notes or "no ForCausalLM class")
        return
    causal_lm.remember_hf_forward(cls)
    if spec["fused_linear_cross_entropy"]:
        swap(cls, "forward", _tagged(causal_lm.fused_causal_lm_forward), f"{cls.__name__}.forward (fused loss)")


def _tagged(fn):
    @functools.wraps(fn)  # keeps the signature, which Trainer and generate() inspect
    def forward(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    forward.__tigon__ = True
    return forward


def _unwrap_model(model):
    """The transformers model inside PEFT/other wrappers: the first module with a `config.model_type`."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    if getattr(getattr(model, "config", None), "model_type", None):
        return model
    for m in model.modules():
        if getattr(getattr(m, "config", None), "model_type", None):
            return m
    raise ValueError("tigon.patch: found no transformers model (a module with config.model_type) in `model`")


def _instance_patch(model, family, report, spec):
    from ..modules import GeGLUMLP, RMSNorm, SwiGLUMLP

    hf = _unwrap_model(model)
    undo = hf.__dict__.setdefault("_tigon_undo", [])
    modeling = importlib.import_module(family.modeling)
    act = registry.mlp_activation(hf.config)
    mlp_names = set(family.mlp_class_names)
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            cls_name = type(child).__name__
            new = piece = None
            if spec["rms_norm"] and cls_name in family.norm_classes:
                mode, offset = family.norm_classes[cls_name]
                new, piece = RMSNorm.from_hf(child, casting_mode=mode, offset=offset), f"RMSNorm {cls_name}"
            elif spec["swiglu"] and cls_name in mlp_names:
                if act is None:
                    report.skip(f"MLP {cls_name}", "activation is not silu or gelu-tanh")
                    mlp_names.discard(cls_name)
                    continue
                target = SwiGLUMLP if act == "swiglu" else GeGLUMLP
                new, piece = target.from_hf(child), f"{target.__name__} {cls_name}"
            if new is not None:
                undo.append((parent, name, child))
                setattr(parent, name, new)
                report.add(piece)
    if spec["rms_norm"] and family.prenorm_layer:
        for layer in hf.modules():
            if type(layer).__name__ == family.decoder_layer_class and "forward" not in layer.__dict__ and \
                    isinstance(getattr(layer, "post_attention_layernorm", None), RMSNorm):
                undo.append((layer, "forward", None))
                layer.forward = types.MethodType(causal_lm.fused_prenorm_decoder_forward, layer)
                report.add(f"{family.decoder_layer_class}.forward (residual add fused into the norm)")
    if spec["rope"] and family.rope:
        fn = getattr(modeling, "apply_rotary_pos_emb", None)
        if fn is not None and not getattr(fn, "__tigon__", False):
            undo.append((modeling, "apply_rotary_pos_emb", fn))
            modeling.apply_rotary_pos_emb = _rope_function()
        report.add(f"function {family.module}.apply_rotary_pos_emb (module-wide)")
    cls = type(hf)
    quantized = _quantized_lm_head(hf)
    if spec["fused_linear_cross_entropy"] and family.causal_lm and cls.__name__.endswith("ForCausalLM") and quantized:
        report.skip("fused linear cross-entropy", quantized)
    elif spec["fused_linear_cross_entropy"] and family.causal_lm and cls.__name__.endswith("ForCausalLM"):
        causal_lm.remember_hf_forward(cls)
        if "forward" not in hf.__dict__:
            undo.append((hf, "forward", None))
            hf.forward = types.MethodType(causal_lm.fused_causal_lm_forward, hf)
        if _ours(hf.__dict__["forward"]):
            report.add(f"{cls.__name__}.forward (fused loss)")
        else:  # e.g. TRL's SFTTrainer installed its own fused LM head on the instance: it computes the loss
            report.skip("fused linear cross-entropy", "model.forward is already replaced on the instance")
    elif spec["fused_linear_cross_entropy"]:
        report.skip("fused linear cross-entropy", family.notes or f"{cls.__name__} is not a ForCausalLM")
    if spec["cross_entropy"]:
        if "_loss_function" not in hf.__dict__:
            undo.append((hf, "_loss_function", None))
            hf.loss_function = causal_lm.causal_lm_loss
        report.add("loss_function (cross_entropy)")


def _quantized_lm_head(hf) -> str:
    """Why the fused loss cannot read the lm_head's weight, or "": bitsandbytes' Linear4bit and Linear8bitLt
    subclass nn.Linear but hold packed integers (a 4-bit [V, H] weight is a uint8 [V*H/2, 1])."""
    linear = getattr(hf, "lm_head", None)
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_floating_point():
        return ""
    return f"lm_head is quantized ({type(linear).__name__}, {weight.dtype} weight); the model computes its loss"


def patch(
    model=None,
    *,
    model_type=None,
    rms_norm=True,
    rope=True,
    swiglu=True,
    layer_norm=True,
    cross_entropy=False,
    fused_linear_cross_entropy=True,
    attention=False,
    verbose=False,
) -> PatchReport:
    """Swap Tigon's fused pieces into a model instance, or (model_type / config) into a model family.

    attention=True (instance only) switches the model to the "tigon" attention implementation
    (`tigon.hf.attention`: decode steps over a RollingKVCache run decode_attention on the ring)."""
    if model is None and model_type is None:
        raise ValueError("tigon.patch: pass a model instance, or model_type= (a string or a config)")
    if model_type is not None and not isinstance(model_type, str):
        model_type = getattr(model_type, "model_type", None) or model_type
    if model is not None:
        model_type = _unwrap_model(model).config.model_type
    family = registry.family_for(model_type)
    spec = dict(rms_norm=rms_norm, rope=rope, swiglu=swiglu, layer_norm=layer_norm, cross_entropy=cross_entropy,
                fused_linear_cross_entropy=fused_linear_cross_entropy)
    report = PatchReport(model_type, "instance" if model is not None else "class")
    if model is None:
        _class_patch(family, report, spec)
    else:
        _instance_patch(model, family, report, spec)
    if attention and model is None:
        report.skip("attention", "the 'tigon' attention implementation is set on a model instance")
    elif attention:
        from .attention import use_tigon_attention

        for piece, n in use_tigon_attention(model).items():
            report.add(piece, n)
    if layer_norm:
        report.skip("LayerNorm", f"{model_type} has no LayerNorm")
    if not family.mlp and swiglu:
        report.skip("MLP", family.notes or "no gated MLP")
    if not family.rope and rope:
        report.skip("RoPE", family.notes or "not rotate-half")
    if verbose or os.environ.get("TIGON_LOG", "").lower() == "info":
        logger.info("%s", report)
        if verbose:
            print(report)
    return report


def unpatch(model=None) -> None:
    """Restore exactly what patch() replaced: on `model` if given, else every class-level patch."""
    if model is not None:
        from .attention import restore_attention

        hf = _unwrap_model(model)
        for owner, name, original in reversed(hf.__dict__.pop("_tigon_undo", [])):
            _restore(owner, name, original)
        restore_attention(hf)
        return
    for model_type in list(_CLASS_UNDO):
        for owner, name, original in reversed(_CLASS_UNDO.pop(model_type)):
            _restore(owner, name, original)


def _ours(value) -> bool:
    return getattr(value, "__func__", value) in (
        causal_lm.fused_causal_lm_forward, causal_lm.fused_prenorm_decoder_forward, causal_lm.causal_lm_loss)


def _restore(owner, name, original):
    if original is None:  # an instance attribute that patch() added
        # One that another library installed over ours since (TRL's SFTTrainer wraps model.forward) stays:
        # removing it would break that library, and its wrapper holds our forward either way.
        if _ours(owner.__dict__.get(name)):
            owner.__dict__.pop(name)
    else:
        setattr(owner, name, original)
