"""The memory options of tigon.patch(model, ...): checkpoints in host memory (offload_checkpoints), the MLP over
tiles of the sequence (tile_mlp) and layers that keep their activations (keep_activations), each a tigon.memory
install recorded for tigon.unpatch, and the memory plan line of the report. Apart from patching.py because these
change how a training step holds its activations, not which kernels the model runs.
"""

import torch

from .. import _log
from ..memory import (
    auto_kept_activations,
    auto_offload,
    checkpoint_offload_installed,
    install_auto_kept_activations,
    install_auto_offload,
    install_checkpoint_offload,
    install_kept_activations,
    install_tiled_mlp,
    uninstall_auto_kept_activations,
    uninstall_auto_offload,
    uninstall_kept_activations,
)
from ..memory import (
    plan as memory_plan,
)
from .unwrap import model_device, unwrap_model


def memory_options(model, offload, tile, keep_activations=0):
    """(keep_on_card, "auto" or None; tile_tokens or None; keep_activations) from tigon.patch's
    offload_checkpoints, tile_mlp and keep_activations, checked before anything changes on the model. "auto" asks
    nothing of the model: on a model_type, or a model without checkpointed layers, it is nothing."""
    auto_kept = isinstance(keep_activations, str) and keep_activations == "auto"
    if not auto_kept and (isinstance(keep_activations, bool) or not isinstance(keep_activations, int)):
        raise TypeError(f"tigon.patch: keep_activations must be 'auto' or a number of layers (an int >= 0), got "
                        f"{type(keep_activations).__name__} {keep_activations!r}")
    if not auto_kept and keep_activations < 0:
        raise ValueError(f"tigon.patch: keep_activations must be 'auto' or a number of layers (an int >= 0), got "
                         f"{keep_activations}")
    if keep_activations and model is None:
        raise ValueError("tigon.patch: keep_activations is set on a model instance: tigon.patch(model, "
                         "keep_activations=...)")
    for name, value, least in (("offload_checkpoints", offload, 0), ("tile_mlp", tile, 1)):
        if name == "offload_checkpoints" and isinstance(value, str) and value == "auto":
            continue
        want = ("True, False or a tile length in tokens (>= 1)" if name == "tile_mlp"
                else "'auto', True, False or a number of layers kept on the card (>= 0)")
        if not isinstance(value, int):
            raise TypeError(f"tigon.patch: {name} must be {want}, got {type(value).__name__} {value!r}")
        if not isinstance(value, bool) and value < least:
            raise ValueError(f"tigon.patch: {name} must be {want}, got {value}")
        if value is not False and model is None:
            raise ValueError(f"tigon.patch: {name} is set on a model instance: tigon.patch(model, {name}=...)")
    from transformers.modeling_layers import GradientCheckpointingLayer

    if offload is not False and offload != "auto" and model is not None and not any(
            isinstance(m, GradientCheckpointingLayer) for m in unwrap_model(model).modules()):
        raise ValueError("tigon.patch: offload_checkpoints needs a model whose decoder layers gradient "
                         "checkpointing runs (transformers' GradientCheckpointingLayer); this one has none "
                         "('auto' arms nothing on such a model)")
    if keep_activations and not auto_kept:
        layers = sum(isinstance(m, GradientCheckpointingLayer) for m in unwrap_model(model).modules())
        if keep_activations > layers:
            raise ValueError(f"tigon.patch: keep_activations must be at most the model's {layers} checkpointed "
                             f"layers (transformers' GradientCheckpointingLayer), got {keep_activations}")
    keep = None if offload is False else "auto" if offload == "auto" else (1 if offload is True else offload)
    tokens = None if tile is False else ("auto" if tile is True else tile)
    return keep, tokens, keep_activations


def patch_memory(hf, report, keep_on_card, tile_tokens, keep_activations=0) -> None:
    """keep_on_card: an int installs the offload, "auto" the hook that arms it when a step would not fit the
    card (tigon.memory.install_auto_offload; kept out where the offload is installed already), None neither;
    an int or None takes an earlier "auto" off. keep_activations: the last that many layers run without the
    recompute (tigon.memory.install_kept_activations), before the plan line that counts them."""
    if keep_activations == "auto":
        before = auto_kept_activations(hf)
        state = install_auto_kept_activations(hf)
        if state is not None and before is None:  # unpatch's undo removes the hook, then every layer recomputes
            hf.__dict__.setdefault("_tigon_undo", []).append((state, "active", False))
        if state is not None:
            report.add("checkpointing without the recompute where the card has room ('auto')", len(state.layers))
    else:
        uninstall_auto_kept_activations(hf)
        if keep_activations:
            report.add("checkpointing without the recompute (the last layers keep their activations)",
                       install_kept_activations(hf, layers=keep_activations))
        else:
            uninstall_kept_activations(hf)
    if keep_on_card == "auto":
        keep_on_card, before = None, auto_offload(hf)
        state = install_auto_offload(hf) if before is not None or not checkpoint_offload_installed(hf) else None
        if state is not None and before is None:  # unpatch's undo sets active to False (the hook goes), then
            hf.__dict__.setdefault("_tigon_undo", []).append((state, "active", False))  # takes the offload off
        if state is not None:
            report.add("checkpoint in host memory when needed ('auto')", len(state.layers))
    else:
        uninstall_auto_offload(hf)
    if tile_tokens is not None:  # after the MLP swap: the tiled forward wraps the modules the model now holds
        report.add(f"tiled MLP ({tile_tokens} tokens a tile)", install_tiled_mlp(hf, tile_tokens=tile_tokens))
    if keep_on_card is not None:
        try:
            n = install_checkpoint_offload(hf, keep_on_card=keep_on_card)
        except RuntimeError as e:  # no pinned host memory: nothing was armed
            raise RuntimeError(f"tigon.patch: offload_checkpoints: {e}") from e
        report.add(f"checkpoint in host memory ({keep_on_card} kept on the card)", n)
    if keep_on_card is not None or tile_tokens is not None or keep_activations not in (0, "auto"):
        report.memory_plan = _plan_line(hf, keep_on_card, tile_tokens)


def _plan_line(hf, keep_on_card, tile_tokens) -> str:
    """tigon.memory.plan for the model's trainable parameters as they are now, one row of 4096 and 8192 tokens:
    the peak, its slope per 1K tokens and, on a GPU, the longest row that fits the card. Empty where the plan
    does not model the architecture."""
    offload = False if keep_on_card is None else keep_on_card
    try:  # "auto": the plan reads the tile the first step will pick from the memory free on the card
        at = [memory_plan(hf, seq_len=t, offload_checkpoints=offload, tile_tokens=tile_tokens) for t in (4096, 8192)]
    except (ValueError, TypeError, AttributeError) as e:
        _log.get_logger().debug("tigon.patch: no memory plan for this model: %s", e)
        return ""
    slope = (at[1].peak - at[0].peak) / 4
    line = (f"{at[0].peak / 2**30:.1f} GiB at 4096 tokens a row, +{slope / 2**30:.2f} GiB per 1K tokens (the "
            "parameters that train now, AdamW; tigon.memory.plan(model, seq_len=..., lora_rank=...) for LoRA)")
    device = model_device(hf)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        line += f"; longest row on this card: {at[0].longest_seq_len(total)} tokens"
    return line
