"""The transformers model inside a wrapper (PEFT, accelerate, a user's nn.Module), for patch and the attention
implementation alike; and the plain function inside a `kernels` function module (`hub_function`)."""

import types

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


def model_device(hf) -> torch.device:
    """The device of the model's first parameter (the CPU for a model without parameters)."""
    param = next(hf.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def hub_function(obj, defined=False):
    """The plain function behind a `kernels` function module, else `obj` itself.

    With the `kernels` package installed, transformers' `use_kernel_forward_from_hub` turns a decorated function
    (5.17: `apply_rotary_pos_emb` of Llama and most rotate-half families) into an instance of a class made for it
    (`kernels.layer._create_func_module`) whose forward calls the function. That instance is the function
    unless `kernels.kernelize` gave it a hub layer's forward (set on the instance): then it is returned as is
    (what runs is the hub's), or, with `defined=True`, the function transformers defined all the same (what the
    source says: a process that kernelized a model once still reads Llama's code as Llama's)."""
    cls = type(obj)
    forward = getattr(cls, "forward", None)
    # kernelize without a hub layer for it ("defaulting to original forward") sets the class's own forward, bound
    own = getattr(obj, "__dict__", {}).get("forward")
    hub = own is not None and getattr(own, "__func__", None) is not forward
    if (not isinstance(obj, torch.nn.Module) or not hasattr(cls, "kernel_layer_name") or (hub and not defined)
            or not hasattr(forward, "__code__")):
        return obj
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    func = cells["func"].cell_contents if "func" in cells else None
    return func if isinstance(func, types.FunctionType) else obj
