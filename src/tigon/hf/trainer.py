"""Trainer / PEFT / TRL glue: a callback for scripts that only pass callbacks."""

from transformers import TrainerCallback

from .patch import patch


class TigonCallback(TrainerCallback):
    """Patches the Trainer's model when training starts (instance-level; same Parameters, so the optimizer,
    PEFT adapters and checkpoints are unaffected). Extra keyword arguments go to `tigon.patch`."""

    def __init__(self, **patch_kwargs):
        self.patch_kwargs = patch_kwargs
        self.report = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self.report is None:
            self.report = patch(model, **self.patch_kwargs)
        return control
