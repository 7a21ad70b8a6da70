"""Trainer / PEFT / TRL glue: a callback for scripts that only pass callbacks, and the Trainer's AdamW on Tigon's
fused step (`fused_adamw`)."""

from transformers import TrainerCallback

from .. import _log
from . import registry
from .patch import patch
from .unwrap import unwrap_model


class TigonCallback(TrainerCallback):
    """Patches the Trainer's model when training starts (instance-level; same Parameters, so the optimizer,
    PEFT adapters and checkpoints are unaffected). Extra keyword arguments go to `tigon.patch`.

    A model type Tigon has no row for logs a warning and trains as it is (as Liger's Trainer integration does);
    strict=True raises the ValueError instead."""

    def __init__(self, strict=False, **patch_kwargs):
        if not isinstance(strict, bool):
            raise TypeError(f"TigonCallback: strict must be True or False, got {strict!r}")
        self.strict = strict
        self.patch_kwargs = patch_kwargs
        self.report = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None or self.report is not None:
            return control
        model_type = unwrap_model(model, "TigonCallback").config.model_type
        try:
            registry.family_for(model_type, caller="TigonCallback", argument="the model's config.model_type")
        except ValueError as e:
            if self.strict:
                raise
            _log.get_logger().warning("%s; training without Tigon's kernels", e)
            return control
        self.report = patch(model, **self.patch_kwargs)
        return control


def fused_adamw(args, **overrides):
    """`Trainer(model, args, ..., optimizer_cls_and_kwargs=tigon.hf.trainer.fused_adamw(args))`: the Trainer's
    AdamW (learning_rate, adam_beta1, adam_beta2, adam_epsilon; weight_decay on the Trainer's decay group) as
    `tigon.optim.AdamW`, one launch per group, with the Trainer's gradient clipping moved into that step.

    Moving the clipping sets `args.max_grad_norm` to 0 (the Trainer would otherwise clip a second time) and hands
    the old value to the optimizer; the Trainer then logs no `grad_norm` (the optimizer's `grad_norm` holds it).
    Call it once per TrainingArguments. `overrides` go to tigon.optim.AdamW (e.g. state_dtype=torch.float32)."""
    from ..optim import AdamW

    if getattr(args, "max_grad_norm", None) is None or not hasattr(args, "learning_rate"):
        raise TypeError(f"fused_adamw: args must be the Trainer's TrainingArguments, got {type(args).__name__}")
    clip = float(args.max_grad_norm) if args.max_grad_norm > 0 else None
    args.max_grad_norm = 0.0
    kwargs = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                  max_grad_norm=clip)
    kwargs.update(overrides)
    _log.get_logger().info("tigon: the Trainer steps with tigon.optim.AdamW%s",
                           f", clipping to {clip} inside the step" if clip else "")
    return AdamW, kwargs
