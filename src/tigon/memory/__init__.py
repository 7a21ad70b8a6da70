"""Memory: RollingBuffer, the workspace arena kernels borrow scratch from (`workspace(device)`: the device's
shared one; docs/memory/rolling_buffer.md), and RollingKVCache, the ring-buffer KV cache (docs/memory/kv_cache.md).

RollingBuffer is defined in tigon/ops/_rolling_buffer.py, beside the kernels that borrow from it (ops imports
nothing above it), and this package is its public name. RollingKVCache subclasses transformers' Cache, so it loads
lazily: `import tigon.ops` never pulls in transformers (an [hf] extra).
"""

from ..ops._rolling_buffer import RollingBuffer, workspace

__all__ = ["RollingBuffer", "RollingKVCache", "workspace"]


def __getattr__(name):
    if name == "RollingKVCache":
        from .kv_cache import RollingKVCache

        return RollingKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
