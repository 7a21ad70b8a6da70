"""transformers' kernel mechanism (`use_kernels=True`, `kernelize`, `KernelConfig`) on Tigon's kernels, offline.

    from tigon.hf.kernels import kernel_config
    model = AutoModelForCausalLM.from_pretrained(path, use_kernels=True, kernel_config=kernel_config())

transformers registers layer names with `use_kernel_forward_from_hub` (5.17: "RMSNorm" on 127 norm classes,
"rotary_pos_emb" on 111 apply_rotary_pos_emb functions, "SiLU", "GeluTanh" and the other activation classes,
"RMSNormGated", ...); `kernels` replaces each registered module's forward by the layer of that name in a kernel
repository. Tigon ships one such repository inside the package (KERNEL_REPO, build/torch-universal/: metadata.json,
layers.py), so no hub download is needed. LAYERS is what it maps (docs/integrations.md says what runs where); a
model gets the names it registers, so Tigon's config raises no "not registered" error and leaves no name of those
unmapped. Needs the `kernels` package (pip install tigon[kernels]).
"""

import functools
from pathlib import Path

from . import registry
from .unwrap import hub_function

KERNEL_REPO = Path(__file__).resolve().parent / "kernel_repo"
# transformers' registered layer name -> the layer of Tigon's repository that replaces its forward
LAYERS = {
    "RMSNorm": "RMSNorm",
    "rotary_pos_emb": "RotaryPosEmb",
    "SwiGLUMLP": "SwiGLUMLP",  # named in transformers' default mapping; no 5.17 class registers it yet
    "GeGLUMLP": "GeGLUMLP",
    **{act: "KeptActivation" for act in ("SiLU", "GeLU", "GeluTanh", "NewGELU", "FastGELU", "QuickGELU")},
}
_FAMILIES = [*registry.FAMILIES.values(), *registry.TOWERS.values()]
_NORMS = {name: row for family in _FAMILIES for name, row in family.norm_classes.items()}
_ROTATE_HALF = frozenset(family.modeling for family in _FAMILIES if family.rope)  # modules whose RoPE Tigon runs


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


def rotary_forward(module, q, k, cos, sin, unsqueeze_dim=1):
    """The "rotary_pos_emb" layer's forward: Tigon's rotate-half RoPE (what tigon.patch puts in place of the same
    function) where the function is a family's whose RoPE Tigon runs; transformers' own function otherwise
    (interleaved, multimodal and partial forms: GLM, Qwen2-VL, ...)."""
    from .. import ops

    fn = hub_function(module, defined=True)
    if getattr(fn, "__module__", None) in _ROTATE_HALF:
        return ops.apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    if fn is module:
        return type(module).forward(module, q, k, cos, sin, unsqueeze_dim)
    return fn(q, k, cos, sin, unsqueeze_dim)


def mlp_forward(module, x, activation):
    """The "SwiGLUMLP" / "GeGLUMLP" layers' forward: Tigon's gated MLP on the module's own projections
    (gate_proj/up_proj/down_proj, or gate_up_proj/down_proj). A module of another layout is a TypeError naming it."""
    from ..modules import GeGLUMLP, SwiGLUMLP

    cls = SwiGLUMLP if activation == "swiglu" else GeGLUMLP
    try:
        return cls.from_hf(module)(x)  # a view sharing the module's Linears: a few microseconds a call
    except (TypeError, ValueError) as e:
        raise TypeError(f"tigon kernel layer {cls.__name__}: {type(module).__name__} cannot run it ({e}); leave "
                        "it out of the kernel mapping") from None


def kernel_mapping(device="cuda") -> dict:
    """{layer name: {device: "/abs/path:LayerName"}}: the KernelConfig mapping form for a local repository."""
    if not isinstance(device, str) or not device:
        raise TypeError(f"tigon.hf.kernels.kernel_mapping: device must be a string such as 'cuda', got {device!r}")
    return {name: {device: f"{KERNEL_REPO}:{layer}"} for name, layer in LAYERS.items()}


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
        def sanitize_kernel_mapping(self, model):
            """The names the model registers, of those Tigon maps (HF's raises for a name the model lacks)."""
            self.store_registered_layer_names(model)
            registered = set(self.registered_layer_names.values())
            self.kernel_mapping = {k: v for k, v in self.kernel_mapping.items() if k in registered}
            super().sanitize_kernel_mapping(model)

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
    """`kernels.LocalLayerRepository` of the layer Tigon maps transformers' layer name `name` to, for
    `kernels.use_kernel_mapping` directly."""
    from kernels import LocalLayerRepository

    if name not in LAYERS:
        raise ValueError(f"tigon.hf.kernels.local_layer_repository: name must be one of {list(LAYERS)}, got {name!r}")
    return LocalLayerRepository(repo_path=KERNEL_REPO, layer_name=LAYERS[name])
