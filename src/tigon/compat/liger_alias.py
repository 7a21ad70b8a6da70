"""Make `import liger_kernel...` resolve to tigon.compat.liger in this process, so code that only knows
liger-kernel (transformers' Trainer with use_liger_kernel=True, axolotl, LLaMA-Factory) runs Tigon's kernels.

    import tigon.compat.liger
    tigon.compat.liger.install_as_liger_kernel()   # before the Trainer applies its kernels
    ...  # TrainingArguments(use_liger_kernel=True) now patches with Tigon
    tigon.compat.liger.uninstall_as_liger_kernel() # liger_kernel resolves as before

The aliases are module objects in sys.modules (liger_kernel, liger_kernel.transformers and its submodules,
liger_kernel.chunked_loss); transformers' is_liger_kernel_available() cache is cleared on both calls. If the real
liger-kernel is already imported, install refuses (RuntimeError): objects built from its classes would mix with
Tigon's. If it is installed but not imported, the aliases shadow it, with a warning.
"""

import importlib.machinery
import importlib.util
import sys
import types

from .. import _log

_PACKAGE = "liger_kernel"
# liger-kernel 0.8.5's transformers submodules that user code imports names from; each alias holds every name of
# tigon.compat.liger (a superset of what each Liger submodule exports)
_TRANSFORMERS_SUBMODULES = (
    "auto_model", "cross_entropy", "dyt", "functional", "fused_add_rms_norm", "fused_ce_tvd",
    "fused_linear_cross_entropy", "fused_linear_jsd", "fused_linear_kl_div", "geglu", "jsd", "kl_div", "layer_norm",
    "llama4_rope", "mhc", "mlp", "modulated_rms_norm", "monkey_patch", "multi_token_attention", "poly_norm",
    "relu_squared", "rms_norm", "rope", "softmax", "sparsemax", "swiglu", "tiled_mlp", "tvd",
    "vocab_parallel_cross_entropy")
# the version reported to transformers' availability check (>= 0.3.0), Liger's whose API this mirrors
LIGER_API_VERSION = "0.8.5"

_installed: list = []


def _alias(name, namespace, is_package):
    module = types.ModuleType(name, f"{name} on Tigon (tigon.compat.liger.install_as_liger_kernel)")
    module.__dict__.update(namespace)
    module.__version__ = LIGER_API_VERSION
    module.__file__ = __file__
    # a spec, so importlib.util.find_spec (transformers' availability check) finds the alias
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    if is_package:
        module.__path__ = []
    return module


def _clear_transformers_cache():
    import_utils = sys.modules.get("transformers.utils.import_utils")
    check = getattr(import_utils, "is_liger_kernel_available", None)
    if check is not None and hasattr(check, "cache_clear"):
        check.cache_clear()


def is_installed() -> bool:
    """True while install_as_liger_kernel's aliases are in place."""
    return bool(_installed)


def install(liger, monkey_patch, chunked_loss):
    """Alias liger_kernel.transformers (and its submodules) to the module `liger` (tigon.compat.liger), its
    monkey_patch submodule to `monkey_patch`, liger_kernel.chunked_loss to `chunked_loss`, for this process.
    Idempotent. RuntimeError if the real liger_kernel is already imported. Undo with uninstall()."""
    if _installed:
        return
    present = sorted(n for n in sys.modules if n == _PACKAGE or n.startswith(_PACKAGE + "."))
    if present:
        raise RuntimeError(f"install_as_liger_kernel: the liger-kernel package is already imported ({present[0]}); "
                           "call install_as_liger_kernel() before anything imports liger_kernel, or use "
                           "tigon.compat.liger's functions directly")
    if importlib.util.find_spec(_PACKAGE) is not None:
        _log.get_logger().warning("install_as_liger_kernel: liger-kernel is installed; `import liger_kernel` now gives "
                                  "Tigon's implementation in this process (uninstall_as_liger_kernel() undoes it)")
    names = {n: getattr(liger, n) for n in liger.__all__}
    names["__all__"] = list(liger.__all__)
    modules = {_PACKAGE: _alias(_PACKAGE, {}, True),
               f"{_PACKAGE}.transformers": _alias(f"{_PACKAGE}.transformers", names, True),
               f"{_PACKAGE}.chunked_loss": _alias(f"{_PACKAGE}.chunked_loss",
                                                  {n: getattr(chunked_loss, n) for n in chunked_loss.__all__},
                                                  False)}
    for sub in _TRANSFORMERS_SUBMODULES:
        modules[f"{_PACKAGE}.transformers.{sub}"] = _alias(f"{_PACKAGE}.transformers.{sub}", names, False)
    modules[f"{_PACKAGE}.transformers.monkey_patch"].__dict__.update(
        {n: v for n, v in vars(monkey_patch).items() if not n.startswith("__")})
    for full, module in modules.items():  # parents get their children as attributes, as an import would set
        parent, _, child = full.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    sys.modules.update(modules)
    _installed.extend(modules)
    _clear_transformers_cache()
    _log.get_logger().info("install_as_liger_kernel: liger_kernel resolves to %s", liger.__name__)


def uninstall():
    """Remove the aliases install() put in place (nothing if none): `import liger_kernel` resolves as
    it did before."""
    for name in _installed:
        sys.modules.pop(name, None)
    _installed.clear()
    _clear_transformers_cache()
