"""tigon.patch / tigon.unpatch: the Hugging Face patch (`tigon.hf.patch`) plus the fused decode layer step.

`patch(model, ...)` is `tigon.hf.patch.patch` (same arguments, report and errors), and on a model instance it
also installs the fused decoder-layer step (`tigon.decode.layer_step.install`) on the layers that run Tigon's
decoder forward, so HF's own `model.generate(ids, past_key_values=RollingKVCache(...))` on the "tigon"
attention decodes with it. `unpatch(model)` undoes the HF patch and takes the layer step off.
"""

import functools

from .decode import layer_step
from .hf.patch import patch as _hf_patch
from .hf.patch import unpatch as _hf_unpatch


@functools.wraps(_hf_patch)
def patch(model=None, **options):
    report = _hf_patch(model, **options)
    if model is not None:
        layer_step.install(model)
    return report


@functools.wraps(_hf_unpatch)
def unpatch(model=None, **options):
    _hf_unpatch(model, **options)  # checks the arguments first
    if model is not None:
        layer_step.uninstall(model)
