"""transformers' kernel mechanism (`use_kernels=True`, `kernelize`, `KernelConfig`) on Tigon's kernels, offline.

    from tigon.hf.kernels import kernel_config
    model = AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=kernel_config())

transformers registers layer names with `use_kernel_forward_from_hub` (5.17: "RMSNorm" on 127 norm classes,
"rotary_pos_emb" on functions, "RMSNormGated", ...); `kernels` replaces each registered module's forward by the
layer of that name in a kernel repository. Tigon ships one such repository inside the package (KERNEL_REPO,
build/torch-universal/: metadata.json, layers.RMSNorm), so no hub download is needed. Needs the `kernels`
package (pip install tigon[kernels]).
"""

import functools
from pathlib import Path

from . import registry

KERNEL_REPO = Path(__file__).resolve().parent / "kernel_repo"
LAYERS = ("RMSNorm",)  # transformers' registered names Tigon's repository provides
_NORMS = {name: row for family in [*registry.FAMILIES.values(), *registry.TOWERS.values()]
          for name, row in family.norm_classes.items()}


def rms_norm_forward(module, hidden_states):
    """The kernel layer's forward: tigon.ops.rms_norm with the (casting, offset) of the module's class in the
    family table. A norm class Tigon has no row for is a TypeError naming it (its formula is unknown)."""
    from .. import ops

    row = _NORMS.get(type(module).__name__)
    if row is None:
        raise TypeError(f"tigon kernel layer RMSNorm: {type(module).__name__} is not a norm class in tigon.hf.registry;"
                        " leave it out of the kernel mapping")
    casting_mode, offset = row
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return ops.rms_norm(hidden_states, module.weight, eps, offset=offset, casting_mode=casting_mode)


def kernel_mapping(device="cuda") -> dict:
    """{layer name: {device: "/abs/path:LayerName"}}: the KernelConfig mapping form for a local repository."""
    if not isinstance(device, str) or not device:
        raise TypeError(f"tigon.hf.kernels.kernel_mapping: device must be a string such as 'cuda', got {device!r}")
    return {name: {device: f"{KERNEL_REPO}:{name}"} for name in LAYERS}


def kernel_config(device="cuda"):
    """The transformers.KernelConfig that maps transformers' registered layers to Tigon's local repository, for
    `from_pretrained(..., use_kernels=True, kernel_config=...)` on `device` ("cuda", "cpu", ...)."""
    return _config_class()(kernel_mapping(device), use_local_kernel=True)


@functools.cache
def _config_class():
    """KernelConfig with its own create_compatible_mapping. transformers 5.17's from_pretrained first rewrites each
    mapping entry into a (repo, metadata) pair (register_kernel_replacements_and_fusions), which its
    add_to_mapping_local then splits as a string (an AttributeError for every local repository), and it accepts
    local kernels for accelerator devices only. This one maps each layer to Tigon's LocalLayerRepository for the
    model's device, in both modes (a model loaded for inference may be trained next)."""
    from transformers import KernelConfig
    from transformers.utils.kernel_config import infer_device

    class TigonKernelConfig(KernelConfig):
        def create_compatible_mapping(self, model, compile=False):
            from kernels import LocalLayerRepository, Mode

            device = infer_device(model)
            modes = [Mode.INFERENCE, Mode.TRAINING]
            if compile:
                modes = [m | Mode.TORCH_COMPILE for m in modes]
            mapping = {}
            for layer, kernel in self.kernel_mapping.items():
                repo = kernel.get(device) if isinstance(kernel, dict) else kernel  # per device, or HF's pair
                if isinstance(repo, tuple):
                    repo = repo[0]
                if not isinstance(repo, str):
                    continue
                path, _, name = repo.rpartition(":")
                local = LocalLayerRepository(repo_path=Path(path), layer_name=name)
                mapping[layer] = {device: {m: local for m in modes}}
            self.kernel_mapping = mapping

    return TigonKernelConfig


def local_layer_repository(name="RMSNorm"):
    """`kernels.LocalLayerRepository` of one of Tigon's layers, for `kernels.use_kernel_mapping` directly."""
    from kernels import LocalLayerRepository

    if name not in LAYERS:
        raise ValueError(f"tigon.hf.kernels.local_layer_repository: name must be one of {LAYERS}, got {name!r}")
    return LocalLayerRepository(repo_path=KERNEL_REPO, layer_name=name)
