"""The forward that tigon.patch() sets on one module instance, in a form that copy.deepcopy and pickle keep.

A bound method (types.MethodType) deep-copies, but pickles as `getattr(module, function.__name__)`: a
torch.save'd patched model fails to load, or loads with the class forward in its place. `BoundForward`
pickles the function by its import path and the module with the rest of the model, so a copy or a loaded
model is patched like the original. It exposes `__func__` and `__self__` as a bound method does (accelerate,
PEFT and Tigon itself read them) and the bound signature (Trainer and generate() read the parameters).
"""

import inspect
import types


class BoundForward:
    """`function(module, *args, **kwargs)` as `module.forward`; `function` must be a module-level function."""

    # Slots, not a __dict__: functools.wraps copies a wrapped object's __dict__ onto its wrapper, and a
    # wrapper another library puts around this forward must not look like Tigon's (a `__func__` of ours).
    __slots__ = ("__func__", "__self__", "__signature__")

    def __init__(self, function, module):
        self.__func__ = function
        self.__self__ = module
        self.__signature__ = inspect.signature(types.MethodType(function, module))

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self):
        return BoundForward, (self.__func__, self.__self__)

    @property
    def __name__(self):
        return self.__func__.__name__

    def __repr__(self):
        return f"<tigon forward {self.__func__.__qualname__} of {type(self.__self__).__name__}>"
