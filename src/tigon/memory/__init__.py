"""Memory: the RollingBuffer workspace that kernels borrow scratch from, and the ring-buffer KV cache.

RollingKVCache subclasses transformers' Cache, so it loads lazily: `import tigon.ops` never pulls in
transformers (an [hf] extra).
"""

from ..ops._workspace import RollingBuffer, workspace  # the arena lives with the kernels that borrow it

__all__ = ["RollingBuffer", "RollingKVCache", "workspace"]


def __getattr__(name):
    if name == "RollingKVCache":
        from .kv_cache import RollingKVCache

        return RollingKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
