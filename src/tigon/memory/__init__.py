"""Memory: the RollingBuffer workspace that kernels borrow scratch from."""

from .rolling_buffer import RollingBuffer, workspace

__all__ = ["RollingBuffer", "workspace"]
