"""Deprecated module name, kept so that old imports keep working: the decode loop lives in `tigon.decode`, the
Prometheus metrics in `tigon.metrics`. Each name read from here is the new home's own object and warns once
(DeprecationWarning) with the name to import instead."""

import importlib
import warnings

# old name -> (the module that holds it, the name to import instead)
_NAMES = {
    "DecodeSettings": ("tigon.decode", "tigon.decode.DecodeSettings"),
    "LATENCY_BUCKETS": ("tigon.metrics", "tigon.metrics.LATENCY_BUCKETS"),
    "TTFT_PHASES": ("tigon.decode", "tigon.decode.TTFT_PHASES"),
    "generate": ("tigon.decode", "tigon.generate"),
    "prometheus_text": ("tigon.metrics", "tigon.metrics.prometheus_text"),
}
_warned: set[str] = set()


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = _NAMES[name]
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"tigon.generation.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(_NAMES)
