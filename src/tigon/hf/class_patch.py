"""The class-level half of tigon.patch(model_type=...): the family's modeling module gets Tigon classes and
functions, so models built afterwards (from_pretrained, from_config) come up fused. The replacement classes take
the constructor arguments of the classes they replace. Every replacement is recorded with what it replaced;
tigon.unpatch takes the record (take_undo) and restores it with patching.py's restore, the one the instance patch
uses. Apart from patching.py because nothing here touches a model instance: it patches classes and a module.
"""

import functools
import importlib
import inspect

import torch

from . import causal_lm, qk_norm_rope_forward, registry, rope_routing

_UNDO: dict = {}  # model_type -> [(owner, attribute, original)]
_PATCHED_CLASSES: dict = {}  # (model_type, HF class name) -> Tigon class built for it


def take_undo(model_type: str | None) -> list:
    """The class-level replacements of `model_type` (with None, of every patched model_type), newest first per
    model_type, taken off the record: tigon.unpatch restores each (owner, attribute, original)."""
    names = [model_type] if model_type is not None else list(_UNDO)
    return [record for name in names for record in reversed(_UNDO.pop(name, []))]


def _stand_in(hf_cls, build):
    """A class to put in place of `hf_cls` in its modeling module: called with exactly the arguments `hf_cls`
    takes (its signature: positional and keyword names, defaults), it returns `build(bound arguments, args,
    kwargs)`, a Tigon module, or the HF one where Tigon's would differ. No instance of the stand-in is ever made,
    so models built with it hold plain Tigon modules, which deep-copy and pickle like any module."""
    signature = inspect.signature(hf_cls)

    def __new__(cls, *args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{hf_cls.__name__}{signature}: {e}") from None
        bound.apply_defaults()
        return build(bound.arguments, args, kwargs)

    return type(f"Tigon{hf_cls.__name__}", (torch.nn.Module,), {
        "__new__": __new__, "__signature__": signature, "__tigon__": True, "__module__": __name__,
        "__doc__": f"Builds Tigon's module where {hf_cls.__module__}.{hf_cls.__name__} was built."})


def _norm_class(hf_cls, casting_mode, offset):
    """Tigon's RMSNorm from the HF norm's arguments: the size is its first parameter (Llama's `hidden_size`,
    Gemma's `dim`), the eps its `eps` (with that class's default). with_scale=False (Gemma-4's v_norm): a
    weightless one, normalized in fp32 to x.dtype as HF's (RMSNorm.from_hf)."""
    from ..modules import RMSNorm

    size = next(iter(inspect.signature(hf_cls).parameters))

    def build(arguments, args, kwargs):
        with_scale = arguments.get("with_scale", True)
        if not isinstance(with_scale, bool):
            raise TypeError(f"{hf_cls.__name__}: with_scale must be True or False, got {with_scale!r}")
        if not with_scale:
            return RMSNorm(arguments[size], arguments["eps"], casting_mode="gemma", elementwise_affine=False)
        return RMSNorm(arguments[size], arguments["eps"], offset=offset, casting_mode=casting_mode)

    return _stand_in(hf_cls, build)


def _mlp_class(hf_cls, family):
    """Tigon's gated MLP on the projections of the HF MLP built with the same arguments, so every size is the HF
    constructor's (DeepseekV2MLP's hidden_size; Gemma-4's KV-shared layers, double width from their layer_idx);
    or the HF MLP itself where Tigon's would not compute the same (registry.mlp_kept)."""
    from ..modules import GeGLUMLP, SwiGLUMLP

    config_name = next(iter(inspect.signature(hf_cls).parameters))

    def build(arguments, args, kwargs):
        config = arguments[config_name]
        hf = hf_cls(*args, **kwargs)
        if registry.mlp_kept(family, config):
            return hf
        return (SwiGLUMLP if registry.mlp_activation(config) == "swiglu" else GeGLUMLP).from_hf(hf)

    return _stand_in(hf_cls, build)


def _modeling(family, caller):
    try:
        return importlib.import_module(family.modeling)
    except ImportError as e:
        import transformers

        raise ValueError(f"{caller}: model_type {family.model_type!r} needs {family.modeling}, which transformers "
                         f"{transformers.__version__} does not have ({e})") from None


def patch_class(family, report, spec) -> None:
    """Patch `family`'s modeling module as `spec` (tigon.patch's switches) asks, counting each piece in `report`."""
    modeling = _modeling(family, "tigon.patch")
    undo = _UNDO.setdefault(family.model_type, [])

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
            hf_cls = getattr(modeling, hf_name, None)
            if hf_cls is not None and not getattr(hf_cls, "__tigon__", False):
                key = (family.model_type, hf_name)
                cls = _PATCHED_CLASSES.get(key) or _PATCHED_CLASSES.setdefault(key, _norm_class(hf_cls, mode, offset))
                swap(modeling, hf_name, cls, f"RMSNorm class {hf_name}")
            elif hf_cls is not None:
                report.add(f"RMSNorm class {hf_name}")
    if spec["swiglu"]:
        for hf_name in family.mlp_class_names:
            hf_cls = getattr(modeling, hf_name, None)
            if hf_cls is not None and not getattr(hf_cls, "__tigon__", False):
                key = (family.model_type, hf_name)
                cls = _PATCHED_CLASSES.get(key) or _PATCHED_CLASSES.setdefault(key, _mlp_class(hf_cls, family))
                swap(modeling, hf_name, cls, f"MLP class {hf_name}")
            elif hf_cls is not None:
                report.add(f"MLP class {hf_name}")
    if spec["rms_norm"] and any(offset for _, offset in family.norm_classes.values()):
        _patch_offset_norm_init(family, modeling, report)
    layer_cls = getattr(modeling, family.decoder_layer_class, None)
    if spec["rms_norm"] and family.prenorm_layer and layer_cls is not None:
        causal_lm.remember_hf_forward(layer_cls)
        swap(layer_cls, "forward", _tagged(causal_lm.fused_prenorm_decoder_forward),
             f"{layer_cls.__name__}.forward (residual add fused into the norm)")
    if spec["rope"] and family.rope:
        swap(modeling, "apply_rotary_pos_emb", rope_routing.apply_rotary_pos_emb, "function apply_rotary_pos_emb")
        _fuse_qk_norm_rope_class(family, modeling, spec, swap, report)
    if spec["lora"]:
        report.skip("lora", "PEFT LoRA projections run through tigon.ops.lora_linear on an instance patch "
                            "(tigon.patch(model)); a class-level patch leaves them to PEFT")
    _patch_causal_lm_class(family, modeling, spec, swap, report)


def _fuse_qk_norm_rope_class(family, modeling, spec, swap, report):
    """A family whose attention is Llama's with Qwen3's q/k norms gets a class forward running the norms and RoPE
    as one kernel (for instances whose norms are Tigon's: rms_norm=True builds them so)."""
    cls = getattr(modeling, f"{family.prefix}Attention", None)
    why = qk_norm_rope_forward.qk_norm_rope_class_ready(cls) if cls is not None else qk_norm_rope_forward.NO_QK_NORM
    if why == qk_norm_rope_forward.NO_QK_NORM:
        return  # nothing to fuse: not named
    piece = f"{cls.__name__}.forward (q/k norms + RoPE in one kernel)"
    why = why or ("" if spec["rms_norm"] else "rms_norm=False")
    if why:
        report.skip(piece, why)
    else:
        swap(cls, "forward", qk_norm_rope_forward.qk_norm_rope_class_forward(cls), piece)


def _patch_offset_norm_init(family, modeling, report):
    """A (1 + weight) norm starts at weight 0. Some families' _init_weights find their norm by isinstance
    (Qwen3.5: `isinstance(module, Qwen3_5RMSNorm)`), which Tigon's RMSNorm is not, so from_config would leave
    it at PreTrainedModel's generic ones (the "RMSNorm" name match) and the model would start at a scale of 2.
    The family's PreTrainedModel gets an _init_weights that runs HF's, then zeroes Tigon's offset norms with
    transformers.initialization.zeros_, which keeps a loaded weight (_is_hf_initialized) as HF's own init does."""
    cls = getattr(modeling, f"{family.prefix}PreTrainedModel", None)
    if cls is None or getattr(cls.__dict__.get("_init_weights"), "__tigon__", False):
        return
    hf_init = cls._init_weights

    def _init_weights(self, module):
        from transformers import initialization

        from ..modules import RMSNorm

        hf_init(self, module)
        if isinstance(module, RMSNorm) and module.offset and module.weight is not None:
            initialization.zeros_(module.weight)

    _init_weights.__tigon__ = True
    # None where the method is inherited: unpatch deletes ours rather than copying the parent's in
    _UNDO[family.model_type].append((cls, "_init_weights", cls.__dict__.get("_init_weights")))
    cls._init_weights = _init_weights
    report.add(f"{cls.__name__}._init_weights (zero-centred norms start at 0)")


def _patch_causal_lm_class(family, modeling, spec, swap, report):
    if spec["cross_entropy"]:
        _patch_loss_function(family, modeling, report)
    cls = getattr(modeling, family.causal_lm_class, None) if family.causal_lm else None
    if cls is None:
        if spec["fused_linear_cross_entropy"]:
            report.skip("fused linear cross-entropy", family.notes or "no ForCausalLM class")
        return
    causal_lm.remember_hf_forward(cls)
    if spec["fused_linear_cross_entropy"]:
        swap(cls, "forward", _tagged(causal_lm.fused_causal_lm_forward), f"{cls.__name__}.forward (fused loss)")


def _patch_loss_function(family, modeling, report):
    """cross_entropy=True: the family's ForCausalLM (also where its forward keeps HF's, as Granite's does for its
    logits scaling: HF's forward still calls self.loss_function) gets a loss_function property giving Tigon's
    cross-entropy, for models built before or after; unpatch removes it."""
    cls = getattr(modeling, f"{family.prefix}ForCausalLM", None)
    if cls is None:
        report.skip("loss_function (cross_entropy)", f"{family.modeling} has no {family.prefix}ForCausalLM")
        return
    if not isinstance(cls.__dict__.get("loss_function"), TigonLossProperty):
        # None where PreTrainedModel's property is inherited: unpatch deletes ours rather than copying HF's in
        _UNDO[family.model_type].append((cls, "loss_function", cls.__dict__.get("loss_function")))
        cls.loss_function = TigonLossProperty(_tigon_loss, _set_loss)
    report.add(f"{cls.__name__}.loss_function (cross_entropy)")


class TigonLossProperty(property):
    """The class-level loss_function: HF's property (PreTrainedModel.loss_function) with Tigon's cross-entropy
    where HF's picks ForCausalLMLoss; a loss function an instance sets (Trainer's compute_loss_func, TRL) wins,
    through the same setter HF's property has."""


def _tigon_loss(self):
    return self.__dict__.get("_loss_function", causal_lm.causal_lm_loss)


def _set_loss(self, value):
    self._loss_function = value


def _tagged(fn):
    @functools.wraps(fn)  # keeps the signature, which Trainer and generate() inspect
    def forward(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    forward.__tigon__ = True
    return forward
