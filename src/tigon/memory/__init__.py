"""Memory: RollingBuffer, the workspace arena kernels borrow scratch from (`workspace(device)`: the device's shared
one; docs/memory/rolling_buffer.md), and RollingKVCache, the ring-buffer KV cache (docs/memory/kv_cache.md). For
training at long context: gradient checkpoints in pinned host memory, fetched one layer ahead of their backward
(`install_checkpoint_offload`; docs/memory/offload.md), or only once a step would not fit the card otherwise
(`install_auto_offload`), checkpointing without the recompute on the last layers where memory allows
(`install_kept_activations`; docs/memory/kept_activations.md), a decoder layer's MLP over tiles of the sequence
(`install_tiled_mlp`, `tiled_apply`; docs/memory/tiling.md), and `plan`, the peak memory of a training step by
component before it runs (docs/memory/plan.md). `tigon.patch(model, offload_checkpoints=..., tile_mlp=...)` installs
them.

RollingBuffer is defined in tigon/ops/_rolling_buffer.py, beside the kernels that borrow from it (ops imports
nothing above it), and this package is its public name. RollingKVCache subclasses transformers' Cache, so it loads
lazily: `import tigon.ops` never pulls in transformers (an [hf] extra).
"""

from ..ops._rolling_buffer import RollingBuffer, workspace
from .auto import (
    AutoKeptActivations,
    AutoOffload,
    auto_kept_activations,
    auto_offload,
    install_auto_kept_activations,
    install_auto_offload,
    uninstall_auto_kept_activations,
    uninstall_auto_offload,
)
from .offload import checkpoint_offload_installed, install_checkpoint_offload, uninstall_checkpoint_offload
from .plan import MemoryPlan, MemoryPlanError, plan
from .recompute import install_kept_activations, kept_activation_layers, uninstall_kept_activations
from .tiling import (
    auto_tile_tokens,
    install_tiled_mlp,
    tiled_apply,
    tiled_mlp_installed,
    tiled_mlp_tile_tokens,
    uninstall_tiled_mlp,
)

__all__ = ["RollingBuffer", "RollingKVCache", "checkpoint_offload_installed", "install_checkpoint_offload",
           "uninstall_checkpoint_offload", "workspace",
           "AutoOffload", "auto_offload", "install_auto_offload", "uninstall_auto_offload",
           "auto_tile_tokens", "install_tiled_mlp", "tiled_apply", "tiled_mlp_installed", "tiled_mlp_tile_tokens",
           "uninstall_tiled_mlp",
           "MemoryPlan", "MemoryPlanError", "plan",
           "install_kept_activations", "kept_activation_layers", "uninstall_kept_activations",
           "AutoKeptActivations", "auto_kept_activations", "install_auto_kept_activations",
           "uninstall_auto_kept_activations"]


def __getattr__(name):
    if name == "RollingKVCache":
        from .kv_cache import RollingKVCache

        return RollingKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
