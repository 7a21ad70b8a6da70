"""Deprecated module name: the decode loop lives in `tigon.decode`. Each name read from here is `tigon.decode`'s
own object and warns once (DeprecationWarning) with the name to import instead."""

import importlib
import warnings

_NAMES = ("DecodeSettings", "LATENCY_BUCKETS", "TTFT_PHASES", "generate", "prometheus_text")
_warned: set[str] = set()


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _warned:
        _warned.add(name)
        new = "tigon.generate" if name == "generate" else f"tigon.decode.{name}"
        warnings.warn(f"tigon.generation.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("tigon.decode"), name)


def __dir__():
    return sorted(_NAMES)
