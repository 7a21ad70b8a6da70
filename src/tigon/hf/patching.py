"""The Hugging Face half of tigon.patch() / tigon.unpatch(): one generic patcher driven by the family table in
registry.py. Call `tigon.patch` / `tigon.unpatch` (tigon/__init__.py): they run patch_hf_model / unpatch_hf_model and,
on a model instance, also install (and remove) the fused decode layer step, which these two do not.

Two targets:
- a model instance, and only that instance (here): its norm and MLP submodules are replaced by Tigon modules that
  share the same Parameters (weights, state_dict keys, device and dtype unchanged), its attention modules run
  Tigon's RoPE (tigon.hf.instance_forward.route_rope) and its forward gets the fused loss. Another model of the same
  class is not affected; the record of what was replaced lives on the instance, so copy.deepcopy and
  torch.save of a patched model give a patched model, and tigon.unpatch() of the copy restores the copy only.
  Its memory options (offload_checkpoints, tile_mlp, keep_activations) are checked and installed by
  memory_patch.py;
- a model_type (class_patch.py): the family's modeling module gets Tigon classes and functions, so models built
  afterwards (from_pretrained, from_config) come up fused. The replacement classes take the constructor arguments
  of the classes they replace.
Both are idempotent and fully reversible: every replacement is recorded with what it replaced, and _restore here
puts back either kind.
"""

import collections
import dataclasses
import inspect
from typing import TYPE_CHECKING, Literal

import torch

from .. import _log
from ..memory import (
    checkpoint_offload_installed,
    tiled_mlp_installed,
    uninstall_checkpoint_offload,
    uninstall_kept_activations,
    uninstall_tiled_mlp,
)
from . import attention as tigon_attention
from . import (
    attention_table,
    causal_lm,
    class_patch,
    forward_source,
    instance_forward,
    memory_patch,
    qk_norm_rope_forward,
    registry,
    rope_routing,
    training_attention,
)
from . import lora as tigon_lora
from . import moe as tigon_moe
from . import trl as tigon_trl
from .bound import BoundForward
from .unwrap import model_device, unwrap_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The undo record's attribute name for the experts implementation: original is get_experts_implementation()'s dict
_EXPERTS = "experts_implementation"


@dataclasses.dataclass
class PatchReport:
    """What a tigon.patch() call replaced (counts per piece) and what it skipped (with the reason)."""

    model_type: str
    target: str
    replaced: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    skipped: list = dataclasses.field(default_factory=list)
    # {layer kind: {mask kind: backend}} of the "tigon" training attention (training_attention.layer_plan), for
    # the device the model was on when patched; empty when the model keeps its own attention.
    attention_backends: dict = dataclasses.field(default_factory=dict)
    # with offload_checkpoints / tile_mlp: tigon.memory.plan's prediction for the model as patched (one line)
    memory_plan: str = ""

    def add(self, piece: str, n: int = 1) -> None:
        self.replaced[piece] += n

    def skip(self, piece: str, reason: str) -> None:
        self.skipped.append((piece, reason))

    def __str__(self) -> str:
        rows = [f"tigon.patch: {self.model_type} ({self.target})", f"  {'replaced':<58} {'count':>5}"]
        rows += [f"  {piece:<58} {n:>5}" for piece, n in sorted(self.replaced.items())]
        rows += [f"  training attention, {layer}: " + ", ".join(f"{kind} -> {b}" for kind, b in plan.items())
                 for layer, plan in self.attention_backends.items()]
        rows += [f"  memory plan: {self.memory_plan}"] if self.memory_plan else []
        rows += [f"  skipped: {piece}: {reason}" for piece, reason in self.skipped]
        return "\n".join(rows)


def _model_type_name(model_type, caller) -> str:
    """model_type as given: a string, or a config's .model_type."""
    if isinstance(model_type, str):
        return model_type
    name = getattr(model_type, "model_type", None) if not isinstance(model_type, torch.nn.Module) else None
    if isinstance(name, str) and name:
        return name
    hint = "; pass a model as the first argument" if isinstance(model_type, torch.nn.Module) else ""
    raise TypeError(f"{caller}: model_type must be a string such as 'llama' or a transformers config, got "
                    f"{type(model_type).__name__}{hint}")


def _instance_patch(model, family, report, spec):
    from ..modules import GeGLUMLP, RMSNorm, SwiGLUMLP

    hf = unwrap_model(model)
    # Plain data (modules, names, flags, functions by reference): deepcopy and pickle carry it to a copy.
    undo = hf.__dict__.setdefault("_tigon_undo", [])
    act, kept = registry.mlp_activation(hf.config), registry.mlp_kept(family, hf.config)
    mlp_names = set(family.mlp_class_names)
    for parent in list(hf.modules()):
        for name, child in list(parent.named_children()):
            cls_name = type(child).__name__
            new = piece = None
            if spec["rms_norm"] and cls_name in family.norm_classes:
                mode, offset = family.norm_classes[cls_name]
                new, piece = RMSNorm.from_hf(child, casting_mode=mode, offset=offset), f"RMSNorm {cls_name}"
            elif spec["swiglu"] and cls_name in mlp_names:
                if kept:
                    report.skip(f"MLP {cls_name}", kept)
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
                layer.forward = BoundForward(causal_lm.fused_prenorm_decoder_forward, layer)
                report.add(f"{family.decoder_layer_class}.forward (residual add fused into the norm)")
    if spec["rope"] and family.rope:
        for m in hf.modules():
            if not rope_routing.calls_rope(type(m), family.modeling):
                continue
            piece = f"{type(m).__name__} apply_rotary_pos_emb (this instance)"
            routed = rope_routing.ROPE in m.__dict__
            why = "" if routed else instance_forward.route_rope(m)
            if why and (piece, why) not in report.skipped:
                report.skip(piece, why)
            elif not why:
                if not routed:
                    undo.append((m, rope_routing.ROPE, None))
                report.add(piece)
                fused = f"{type(m).__name__} q/k norms + RoPE in one kernel (this instance)"
                why = qk_norm_rope_forward.fuse_qk_norm_rope(m) if spec["rms_norm"] else "rms_norm=False"
                if not why:
                    report.add(fused)
                elif forward_source.has_qk_norm(m) and (fused, why) not in report.skipped:
                    report.skip(fused, why)
    if spec["lora"]:
        _lora_patch(hf, undo, report)
    cls = type(hf)
    quantized = _quantized_lm_head(hf)
    if spec["fused_linear_cross_entropy"] and family.causal_lm and cls.__name__.endswith("ForCausalLM") and quantized:
        report.skip("fused linear cross-entropy", quantized)
    elif spec["fused_linear_cross_entropy"] and family.causal_lm and cls.__name__.endswith("ForCausalLM"):
        causal_lm.remember_hf_forward(cls)
        if "forward" not in hf.__dict__:
            undo.append((hf, "forward", None))
            hf.forward = BoundForward(causal_lm.fused_causal_lm_forward, hf)
        if _ours(hf.__dict__["forward"]):
            causal_lm.ensure_loss_forward(hf)  # lm_head's permanent loss forward, recorded in _tigon_undo
            report.add(f"{cls.__name__}.forward (fused loss)")
        else:  # e.g. TRL's SFTTrainer installed its own fused LM head on the instance: it computes the loss
            report.skip("fused linear cross-entropy", "model.forward is already replaced on the instance")
    elif spec["fused_linear_cross_entropy"]:
        report.skip("fused linear cross-entropy", family.notes or f"{cls.__name__} is not a ForCausalLM")
    if spec["fused_linear_cross_entropy"] and tigon_trl.arm(hf, undo):
        report.add("TRL's fused LM head (tigon.ops.fused_linear_logprobs)")
    if spec["cross_entropy"]:
        if "_loss_function" not in hf.__dict__:
            undo.append((hf, "_loss_function", None))
            hf.loss_function = causal_lm.causal_lm_loss
        report.add("loss_function (cross_entropy)")


def _lora_patch(hf, undo, report):
    """PEFT LoRA projections of this model through tigon.ops.lora_linear, also those get_peft_model adds later
    (tigon.hf.lora)."""
    found, marked = tigon_lora.arm(hf, undo)
    if found:
        report.add("lora: projections (PEFT lora.Linear -> ops.lora_linear; its bitsandbytes layers -> "
                   "ops.lora_add)", found)
    elif marked:
        report.add("lora: nn.Linear layers ready for PEFT adapters added later", marked)


# The compute capabilities every kernel is compiled for in the tests (tests/ops/test_compile_targets.py)
OLDEST_GPU = (8, 0)


def check_gpu(device: torch.device, caller: str = "tigon.patch") -> None:
    """Refuse a CUDA device older than OLDEST_GPU (T4, V100: no bf16, and kernels never compiled for them), with
    what is supported, rather than run kernels nobody compiled or tested there."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < OLDEST_GPU:
        raise ValueError(f"{caller}: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) is "
                         f"older than the GPUs Tigon supports (8.0 to 9.0: A100, A10, L4, L40S, RTX 3090/4090, H100, "
                         f"H200); run the model unpatched, or on a CPU, where every op has its PyTorch reference")


def _attention_patch(model, report, attention) -> None:
    """Confine packed rows to their examples on every device, and choose the attention kernel.

    The semantics never depend on the GPU: the decoder model's forward is wrapped (training_attention.
    packed_model_forward) so that a padding-free packed row (position_ids restarting per example, no
    attention_mask) attends within each example whatever the implementation. The ranking
    (hf/attention_table.py: the user cache of `tigon tune`, else the shipped table, else for an unmeasured GPU the
    rule, the backends that beat HF's pick on every measured GPU; docs/tuning.md) only orders the kernels of the
    "tigon" implementation, and ends with HF's own pick, which runs where nothing ranks above it (and on a CPU).
    attention=True switches any model to "tigon"; "auto" switches a model on HF's sdpa, and one on eager where the
    ranking puts a kernel above HF's pick for one of its mask kinds (elsewhere eager stays, with its own numerics),
    and keeps an implementation the user chose (flash_attention_2, flex_attention, a hub kernel); attention=False
    keeps any. Where the model keeps its implementation, packed rows run HF's own packed-sequence
    mask (the wrapper turns the training cache off for them)."""
    hf = unwrap_model(model)
    impl = hf.config._attn_implementation
    device = model_device(hf)
    plan = training_attention.layer_plan(hf.config, device)
    faster = any(b != attention_table.hf_pick(kind) for kinds in plan.values() for kind, b in kinds.items())
    if attention is True or (attention == "auto" and (impl in ("sdpa", tigon_attention.NAME)
                                                      or (impl == "eager" and faster))):
        for piece, n in tigon_attention.use_tigon_attention(model).items():
            report.add(piece, n)
        report.attention_backends = plan
    else:
        where = training_attention.gpu_name(device) or device.type
        why = ("attention=False" if attention is False else f"no kernel measured faster than HF's eager on {where}"
               if impl == "eager" else "a choice of the user's")
        report.skip("attention", f"keeps {impl!r} ({why}); packed rows use HF's own packed-sequence mask")
    inner = hf.base_model if hf.base_model is not hf else hf
    if "forward" not in inner.__dict__:
        hf.__dict__.setdefault("_tigon_undo", []).append((inner, "forward", None))
        bound = BoundForward(training_attention.packed_model_forward, inner)
        bound.__signature__ = inspect.signature(type(inner).forward.__get__(inner))  # what callers inspect
        inner.forward = bound
    if _ours(inner.__dict__["forward"]):
        report.add(f"{type(inner).__name__}.forward (packed rows: documents from position_ids)")


def _experts_patch(model, report, asked) -> None:
    """moe_experts: the model's routed experts (and its sub-models') run the "tigon" experts implementation
    (tigon.hf.moe), set through transformers' set_experts_implementation; unpatch restores the one before.
    asked (moe_experts=True, not "auto"): a model without routed experts is reported skipped."""
    hf = unwrap_model(model)
    experts = tigon_moe.experts_modules(hf)
    if not experts:
        if asked:
            report.skip("moe experts", f"{type(hf).__name__} has no routed experts with an experts implementation")
        return
    if not hasattr(hf, "set_experts_implementation") or not hf._can_set_experts_implementation():
        report.skip("moe experts", f"{type(hf).__name__} cannot switch its experts implementation")
        return
    tigon_moe.register()
    before = hf.get_experts_implementation()
    if any(v != tigon_moe.NAME for v in before.values() if v is not None):
        hf.set_experts_implementation(tigon_moe.NAME)
        if not any(name == _EXPERTS for owner, name, _ in hf.__dict__.get("_tigon_undo", []) if owner is hf):
            hf.__dict__.setdefault("_tigon_undo", []).append((hf, _EXPERTS, before))
    names = sorted({type(m).__name__ for m in experts})
    report.add(f"routed experts {', '.join(names)}: experts_implementation 'tigon' (grouped_mm, fused SwiGLU, "
               "permute and combine)", len(experts))


def _quantized_lm_head(hf) -> str:
    """Why the fused loss cannot read the lm_head's weight, or "": bitsandbytes' Linear4bit and Linear8bitLt
    subclass nn.Linear but hold packed integers (a 4-bit [V, H] weight is a uint8 [V*H/2, 1])."""
    linear = getattr(hf, "lm_head", None)
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_floating_point():
        return ""
    return f"lm_head is quantized ({type(linear).__name__}, {weight.dtype} weight); the model computes its loss"


def patch_hf_model(
    model: torch.nn.Module | None = None,
    *,
    model_type: "str | PretrainedConfig | None" = None,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    layer_norm: bool = True,
    cross_entropy: bool = False,
    fused_linear_cross_entropy: bool = True,
    attention: bool | Literal["auto"] = "auto",
    lora: bool = True,
    moe_experts: bool | Literal["auto"] = "auto",
    offload_checkpoints: bool | int | Literal["auto"] = "auto",
    tile_mlp: bool | int = False,
    keep_activations: int | Literal["auto"] = 0,
    verbose: bool = False,
) -> PatchReport:
    """Swap Tigon's fused pieces into a model instance (that instance only), or, with model_type= (a string
    such as "llama", or a config), into a model family module-wide (models built afterwards come up fused).

    Packed rows (instance only): a padding-free row (DataCollatorWithFlattening, position_ids restarting per
    example, no attention_mask) attends within each example on every device and with every attention setting.
    attention (instance only) chooses the implementation: True switches the model to "tigon" (`tigon.hf.attention`:
    decode steps over a RollingKVCache run decode_attention on the ring; training and prefill run
    `tigon.hf.training_attention`: sliding windows and softcapping without a [T, T] mask, on the first backend of
    hf/attention_table.py's ranking for the GPU that takes the call: the user cache `tigon tune` wrote, else the
    shipped table, else for an unmeasured GPU the rule (the backends that beat HF's pick on every measured GPU;
    docs/tuning.md), then HF's own pick, which a CPU always runs). "auto" (the default) does so for a model on
    HF's sdpa, and on eager where the ranking puts a faster kernel first for the GPU; it keeps an implementation
    the user chose; False never switches. The ranking picks kernels only: every choice computes the same
    attention.
    lora=True (instance only) runs the model's PEFT LoRA Linear layers through tigon.ops.lora_linear, also those
    that get_peft_model adds after the patch (tigon.hf.lora); lora=False leaves them to PEFT.
    moe_experts (instance only) switches the model's routed experts (transformers' `@use_experts_implementation`
    classes) to the "tigon" experts implementation: HF's grouped GEMMs with the permute, SwiGLU and weighted
    combine around them fused (tigon.hf.moe; 2.3x HF's grouped_mm fwd+bwd on a Qwen3-30B-A3B block, H200);
    unpatch restores the implementation the model had. "auto" (the default): for a model that has routed
    experts, silently nothing otherwise; True: also reports why not; False: never.
    offload_checkpoints (instance only; for training with gradient checkpointing): the checkpointed layer inputs
    go to pinned host memory during the forward and come back one layer ahead of their backward, overlapped with
    compute (tigon.memory.install_checkpoint_offload; docs/memory/offload.md). True keeps the last layer's input
    on the card (its backward comes first); an int keeps that many. Same losses and gradients bit for bit.
    "auto" (the default) arms it only when a step would not fit the card otherwise: at the first training
    forward of each new (batch, seq_len) on a CUDA card with gradient checkpointing on, tigon.memory.plan's peak
    without offload is compared with the card's memory, and where it does not fit the offload is armed with the
    most layers kept on the card that fit, with one warning on the "tigon" logger
    (tigon.memory.install_auto_offload); nothing on a CPU, without checkpointing, or for a model the plan cannot
    read or whose parameters are sharded. False never offloads.
    tile_mlp (instance only; for training at long context): each decoder layer's MLP runs over tiles of the
    sequence, so its [T, intermediate] activations never exist whole (tigon.memory.install_tiled_mlp;
    docs/memory/tiling.md). True chooses the tile from free memory; an int is the tile length in tokens.
    keep_activations (instance only; for training with gradient checkpointing on a card with memory to spare):
    the last this-many decoder layers keep their activations and skip the recompute, the others are checkpointed
    (tigon.memory.install_kept_activations; docs/memory/kept_activations.md); the same losses and gradients
    (bitwise where a layer runs the same ops either way), a faster step, more memory:
    tigon.memory.plan(model, seq_len=...).most_kept_activations(budget) says how many fit. "auto": at the first
    training forward of each new (batch, seq_len) on a CUDA card, as many as the plan fits in the card's free
    memory less a tenth of the card (tigon.memory.install_auto_kept_activations; a later shape only lowers it).
    0 (the default): every layer is checkpointed.
    Raises TypeError for an argument of the wrong kind, ValueError for an unsupported family."""
    if model is None and model_type is None:
        raise ValueError("tigon.patch: pass a model (tigon.patch(model)) or model_type= (a string such as "
                         "'llama', or a config) for the whole family")
    if model is not None and model_type is not None:
        raise ValueError("tigon.patch: pass a model or model_type=, not both (a model is patched as its "
                         "config.model_type says)")
    spec = dict(rms_norm=rms_norm, rope=rope, swiglu=swiglu, layer_norm=layer_norm, cross_entropy=cross_entropy,
                fused_linear_cross_entropy=fused_linear_cross_entropy, lora=lora)
    for name, value in {**spec, "verbose": verbose}.items():
        if not isinstance(value, bool):
            raise TypeError(f"tigon.patch: {name} must be True or False, got {value!r}")
    for name, value in (("attention", attention), ("moe_experts", moe_experts)):
        if not isinstance(value, bool) and value != "auto":
            raise TypeError(f"tigon.patch: {name} must be True, False or 'auto', got {value!r}")
    memory = memory_patch.memory_options(model, offload_checkpoints, tile_mlp, keep_activations)
    if model is not None:
        check_gpu(model_device(unwrap_model(model)))
        model_type = unwrap_model(model).config.model_type
        family = registry.family_for(model_type, argument="the model's config.model_type")
    else:
        model_type = _model_type_name(model_type, "tigon.patch")
        family = registry.family_for(model_type)
    report = PatchReport(model_type, "instance" if model is not None else "class")
    if model is None:
        class_patch.patch_class(family, report, spec)
    else:
        _instance_patch(model, family, report, spec)
    if attention is True and model is None:
        report.skip("attention", "the 'tigon' attention implementation is set on a model instance")
    elif model is not None:
        _attention_patch(model, report, attention)
    if moe_experts is True and model is None:
        report.skip("moe experts", "the 'tigon' experts implementation is set on a model instance")
    elif moe_experts and model is not None:
        _experts_patch(model, report, moe_experts is True)
    if model is not None:
        memory_patch.patch_memory(unwrap_model(model), report, *memory)
    if layer_norm:
        report.skip("LayerNorm", f"{model_type} has no LayerNorm")
    if not family.mlp and swiglu:
        report.skip("MLP", family.notes or "no gated MLP")
    if not family.rope and rope:
        report.skip("RoPE", family.notes or "not rotate-half")
    # every call: logged at INFO (TIGON_LOG or the application's logging decides what shows); verbose=True makes
    # sure it is seen once (printed only where no handler shows INFO)
    _log.report(str(report), verbose)
    return report


def unpatch_hf_model(
    model: torch.nn.Module | None = None, *, model_type: "str | PretrainedConfig | None" = None
) -> None:
    """Restore exactly what tigon.patch() replaced: on `model` (that instance only, and every module inside it
    patched on its own, as a vision-language model's text tower is; a model never patched is left as it is), or
    the class-level patch of `model_type` (a string or a config), or with neither, every class-level patch."""
    if model is not None and model_type is not None:
        raise ValueError("tigon.unpatch: pass a model or model_type=, not both")
    if model is not None:
        hf = unwrap_model(model, "tigon.unpatch")
        # the model's own patch last: a vision-language model's text tower (patched as its own row by the
        # compat apply functions, with the vision tower's LayerNorms) holds its undo list itself
        for m in [*(m for m in hf.modules() if m is not hf and "_tigon_undo" in m.__dict__), hf]:
            for owner, name, original in reversed(m.__dict__.pop("_tigon_undo", [])):
                _restore(owner, name, original)
            tigon_attention.restore_attention(m)
            tigon_lora.release(m)
            tigon_trl.release(m)
        if checkpoint_offload_installed(hf):
            uninstall_checkpoint_offload(hf)
        if tiled_mlp_installed(hf):
            uninstall_tiled_mlp(hf)
        uninstall_kept_activations(hf)
        return
    if model_type is not None:
        model_type = _model_type_name(model_type, "tigon.unpatch")
        registry.family_for(model_type, caller="tigon.unpatch")
    for owner, attr, original in class_patch.take_undo(model_type):
        _restore(owner, attr, original)


def _ours(value) -> bool:
    if isinstance(value, class_patch.TigonLossProperty) or getattr(value, "__tigon__", False):
        return True
    return getattr(value, "__func__", value) in (
        causal_lm.fused_causal_lm_forward, causal_lm.fused_prenorm_decoder_forward, causal_lm.causal_lm_loss,
        causal_lm.lm_head_forward, training_attention.packed_model_forward)


def _restore(owner, name, original):
    if name == _EXPERTS:
        owner.set_experts_implementation(original)
    elif name == rope_routing.ROPE:
        instance_forward.unroute_rope(owner)
    elif name == "__class__":  # an lm_head's causal_lm.LossHeadLinear back to nn.Linear
        if type(owner) is causal_lm.LossHeadLinear:  # not when another library subclassed it since (FSDP2)
            owner.__class__ = original
    elif original is None and isinstance(owner, type):  # a class attribute that patch() added over an inherited one
        if _ours(owner.__dict__.get(name)):
            delattr(owner, name)
    elif original is None:  # an instance attribute that patch() added
        # One that another library installed over ours since (TRL's SFTTrainer wraps model.forward) stays:
        # removing it would break that library, and its wrapper holds our forward either way.
        if _ours(owner.__dict__.get(name)):
            owner.__dict__.pop(name)
    else:
        current = getattr(owner, "_modules", {}).get(name)
        if isinstance(current, torch.nn.Module) and isinstance(original, torch.nn.Module) and current is not original:
            _carry_wrappers(current, original)
        setattr(owner, name, original)


def _carry_wrappers(current, original) -> None:
    """Before a module swapped by patch() goes back: a child of Tigon's module that another library wrapped since
    (PEFT's get_peft_model after patch: its LoRA layer around the projection both modules shared) replaces the
    wrapped child in the original module, so unpatch keeps the adapters."""
    for child_name, child in current._modules.items():
        old = original._modules.get(child_name)
        if old is not None and child is not old and any(m is old for m in child.modules()):
            original._modules[child_name] = child
