"""Trainer / PEFT / TRL glue: a callback for scripts that only pass callbacks."""

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
