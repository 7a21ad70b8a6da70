"""The transformers model inside a wrapper (PEFT, accelerate, a user's nn.Module), for patch and the attention
implementation alike."""

import torch


def not_a_module(model) -> str:
    got = f"got {type(model).__name__}"
    if isinstance(model, str):
        return f"got the string {model!r}; for a model family pass model_type={model!r}"
    if isinstance(model, type):
        return f"got the class {model.__name__}; pass an instance of it, or model_type= for the family"
    if isinstance(getattr(model, "model_type", None), str):
        return f"{got} (a config); for a model family pass model_type=config"
    return got


def unwrap_model(model, caller="tigon.patch"):
    """The transformers model inside PEFT/other wrappers: the first module with a `config.model_type`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: `model` must be a torch.nn.Module (a transformers model, or a PEFT/other "
                        f"wrapper of one); {not_a_module(model)}")
    top = model
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    if getattr(getattr(model, "config", None), "model_type", None):
        return model
    for m in model.modules():
        if getattr(getattr(m, "config", None), "model_type", None):
            return m
    raise TypeError(f"{caller}: `model` ({type(top).__name__}) holds no transformers model (no module with a "
                    "config.model_type); Tigon patches transformers models and PEFT/other wrappers of one")
