"""Trainer / PEFT / TRL glue: a callback for scripts that only pass callbacks, and the Trainer's AdamW on Tigon's
fused step (`use_fused_adamw(trainer)`: clipping in the step, one gradient-norm pass; `fused_adamw(args)`)."""

from transformers import TrainerCallback

from .. import _log
from . import registry
from .patching import patch_hf_model
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
        self.report = patch_hf_model(model, **self.patch_kwargs)
        return control


def _adamw_kwargs(caller, args, clip, overrides) -> dict:
    if getattr(args, "max_grad_norm", None) is None or not hasattr(args, "learning_rate"):
        raise TypeError(f"{caller}: args must be the Trainer's TrainingArguments, got {type(args).__name__}")
    kwargs = dict(lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                  max_grad_norm=clip)
    kwargs.update(overrides)
    if kwargs.get("step_in_backward"):  # each parameter steps inside the backward: no gradients are left after it
        for bad, what in ((kwargs["max_grad_norm"] is not None, "max_grad_norm=0 (there is nothing left to clip)"),
                          (getattr(args, "gradient_accumulation_steps", 1) > 1,
                           "gradient_accumulation_steps=1 (each backward steps)"),
                          (getattr(args, "fp16", False), "bf16 instead of fp16 (a GradScaler cannot unscale)")):
            if bad:
                raise ValueError(f"{caller}: step_in_backward=True needs TrainingArguments with {what}")
    return kwargs


def use_fused_adamw(trainer, **overrides) -> None:
    """`tigon.hf.trainer.use_fused_adamw(trainer)` before `trainer.train()`: the Trainer (transformers' or a
    subclass such as TRL's) steps with `tigon.optim.AdamW` (its AdamW arguments, as `fused_adamw`), clipping to
    `args.max_grad_norm` inside the step, and takes one gradient-norm pass per step: the norm the Trainer clips and
    logs as `grad_norm` is the optimizer's (`AdamW.norm_at_next_step`), read after the step. With max_grad_norm 0
    nothing is clipped and the optimizer's pass replaces the Trainer's logging-only one.

    Where the Trainer's norm is not a plain one (DeepSpeed, XLA, FSDP1, Megatron-LM, a norm over parameters the
    optimizer does not step), its clip_grad_norm_ runs as before and the step's clipping is then a no-op.
    `overrides` go to tigon.optim.AdamW (e.g. state_dtype=torch.float32)."""
    from ..optim import AdamW

    name = "tigon.hf.trainer.use_fused_adamw"
    accelerator = getattr(trainer, "accelerator", None)
    if not hasattr(trainer, "optimizer_cls_and_kwargs") or accelerator is None:
        raise TypeError(f"{name}: trainer must be a transformers Trainer, got {type(trainer).__name__}")
    if trainer.optimizer is not None:
        raise ValueError(f"{name}: the trainer already has an optimizer; call it on a Trainer built without "
                         "optimizers=, before train()")
    args = trainer.args
    clip = float(args.max_grad_norm) if args.max_grad_norm > 0 else None
    trainer.optimizer_cls_and_kwargs = (AdamW, _adamw_kwargs(name, args, clip, overrides))
    if "clip_grad_norm_" not in accelerator.__dict__:
        accelerator.clip_grad_norm_ = _OneNormPass(trainer, accelerator.clip_grad_norm_)
    _log.get_logger().info("tigon: the Trainer steps with tigon.optim.AdamW%s, one gradient-norm pass a step",
                           f", clipping to {clip} inside the step" if clip else "")


class _OneNormPass:
    """The Trainer's accelerator.clip_grad_norm_ (its clipping, and its logging-only norm at max_norm=inf) as the
    optimizer's norm: a tensor the next step fills. Anything else goes to accelerate's own."""

    def __init__(self, trainer, original):
        self.trainer, self.original = trainer, original

    def __call__(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        opt = self._adamw()
        if opt is None or not self._plain(opt, parameters, max_norm, norm_type):
            return self.original(parameters, max_norm, norm_type)
        self.trainer.accelerator.unscale_gradients()  # fp16: as accelerate does before its norm
        grads = [p.grad for p in parameters if p.grad is not None]
        return opt.norm_at_next_step(grads[0].device if grads else None)

    def _adamw(self):
        from ..optim import AdamW

        opt = self.trainer.optimizer
        while not isinstance(opt, AdamW) and hasattr(opt, "optimizer"):  # accelerate's AcceleratedOptimizer
            opt = opt.optimizer
        return opt if isinstance(opt, AdamW) else None

    def _plain(self, opt, parameters, max_norm, norm_type) -> bool:
        from accelerate.utils import DistributedType

        acc = self.trainer.accelerator
        kind = acc.distributed_type
        if norm_type != 2 or kind in (DistributedType.DEEPSPEED, DistributedType.XLA, DistributedType.MEGATRON_LM) \
                or (kind == DistributedType.FSDP and not acc.is_fsdp2):
            return False
        if max_norm != (opt.max_grad_norm if opt.max_grad_norm is not None else float("inf")):
            return False
        stepped = {id(p) for group in opt.param_groups for p in group["params"]}
        return all(id(p) in stepped for p in parameters if p.grad is not None)


def fused_adamw(args, **overrides):
    """`Trainer(model, args, ..., optimizer_cls_and_kwargs=tigon.hf.trainer.fused_adamw(args))`: the Trainer's
    AdamW (learning_rate, adam_beta1, adam_beta2, adam_epsilon; weight_decay on the Trainer's decay group) as
    `tigon.optim.AdamW`, one launch per group, with the Trainer's gradient clipping moved into that step.

    Moving the clipping sets `args.max_grad_norm` to 0 (the Trainer would otherwise clip a second time) and hands
    the old value to the optimizer. The Trainer (transformers 5.17) then still takes its own gradient-norm pass
    every step to log `grad_norm`: `use_fused_adamw(trainer)` saves that pass. Call it once per
    TrainingArguments. `overrides` go to tigon.optim.AdamW (e.g. state_dtype=torch.float32; state_bits=8 and
    step_in_backward=True for the least memory, which need max_grad_norm=0, no gradient accumulation and no
    fp16)."""
    from ..optim import AdamW

    clip = float(args.max_grad_norm) if getattr(args, "max_grad_norm", None) is not None and \
        args.max_grad_norm > 0 else None
    kwargs = _adamw_kwargs("fused_adamw", args, clip, overrides)
    args.max_grad_norm = 0.0
    _log.get_logger().info("tigon: the Trainer steps with tigon.optim.AdamW%s",
                           f", clipping to {clip} inside the step" if clip else "")
    return AdamW, kwargs
