"""Tigon's layers in the layout the `kernels` package loads from a local repository (build/<variant>/)."""

from . import layers

__all__ = ["layers"]
