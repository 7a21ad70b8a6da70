"""`tigon env`: versions, the GPU, and for every public op of `tigon.ops` the path it takes here and where its
launch settings come from."""

import inspect
import os
import platform
import sys
from importlib import metadata

from .. import _log

# op -> where its launch settings come from, beside the dispatch path (tigon.ops.config holds the classes)
_CONFIG = {"rms_norm": "RMSNormConfig", "add_rms_norm": "RMSNormConfig", "apply_rope": "RopeConfig",
           "qk_norm_rope": "QKNormRopeConfig", "swiglu": "GLUConfig", "geglu": "GLUConfig",
           "cross_entropy": "CrossEntropyConfig", "linear_cross_entropy": "LinearCrossEntropyConfig",
           "adamw_step_": "AdamWConfig", "grad_norm": "AdamWConfig", "rope_kv_write": "RopeKVWriteConfig",
           "rope_kv_append": "RopeKVWriteConfig"}


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def public_ops() -> list[str]:
    """The public functions of `tigon.ops` (its __all__, less the dispatch helpers)."""
    from tigon import ops

    return [n for n in ops.__all__ if inspect.isfunction(getattr(ops, n)) and n != "backend_for"]


def path_text(path: str, device) -> str:
    """What the dispatch rule (`tigon.ops._library`) runs for tensors on `device`."""
    if path == "reference":
        return "PyTorch reference (tigon.ops.reference): no CUDA device and TRITON_INTERPRET off"
    if device.type == "cpu":
        return "Triton kernel through Triton's interpreter (TRITON_INTERPRET=1; slow: for tests)"
    return "Triton kernel (compiled for this GPU)"


def launch_text(op: str, gpu) -> str:
    """Where the launch settings of `op` come from on `gpu` (torch.cuda.get_device_name; None: no GPU)."""
    if op == "decode_linear":
        from tigon.ops import decode_linear_picks

        return decode_linear_picks.source(gpu)
    if op == "quant_linear":
        from tigon.ops import quant_linear_picks

        return quant_linear_picks.source(gpu)
    if op == "decode_attention":
        return ("rule (every card: the split count that best fills the last wave of programs, "
                "decode_attention._splits_for; DecodeAttentionConfig)")
    config = "FusedLinearLossConfig" if op.startswith("fused_linear_") else _CONFIG.get(op)
    if config:
        return f"{config} defaults (measured on an H200; an op's config= overrides them)"
    return "from the shapes (tigon.ops._launch)"


# the mask kinds of training_attention.mask_kind, in the order `tigon env` lists them
MASK_KINDS = ("causal", "packed", "sliding", "packed+sliding", "causal+softcap", "packed+softcap", "sliding+softcap",
              "packed+sliding+softcap")


def attention_text(gpu) -> str:
    """The training-attention backends `tigon.patch` picks on `gpu` per mask kind, and where each ranking comes
    from: the user cache, a row of hf/attention_table.py, the rule for unmeasured cards, or HF's pick."""
    try:
        from tigon.hf import attention_table
    except ModuleNotFoundError as e:
        return str(_log.missing_package(e, "the training attention") or e)
    if not gpu:
        return "no GPU here: Hugging Face's pick for every mask kind (sdpa; eager with softcap)"
    shipped = any(g == gpu for g, _ in attention_table.MEASURED)
    head = (f"hf/attention_table.py rows for {gpu}" if shipped else
            f"no row for {gpu} in hf/attention_table.py (an unmeasured card)")
    lines = [f"{head}; per mask kind, the first backend that takes a call runs (last: Hugging Face's pick):"]
    for kind in MASK_KINDS:
        lines.append(f"  {kind:<24} {' > '.join(attention_table.ranking(gpu, kind)):<26} "
                     f"{attention_table.source(gpu, kind)}")
    return "\n".join(lines)


def cache_text(gpu) -> str:
    """The user cache of `tigon tune` (tigon.ops.tuned_cache): its path and what it holds for `gpu`."""
    from tigon.ops import tuned_cache

    state = tuned_cache.state()
    if state.problem:
        return f"{state.path}: ignored ({state.problem}); the shipped tables apply"
    tuned = state.rows.get(gpu) if gpu else None
    if tuned is not None:
        return (f"{state.path}: rows for {gpu} (attention: {len(tuned.attention)} mask kinds, decode_linear: "
                f"{len(tuned.decode_linear)} shapes, quant_linear: {len(tuned.quant_linear)} shapes)")
    torch_version, triton_version = tuned_cache.versions()
    stale = [f"torch {t}, triton {tr}" for g, t, tr in state.others if g == gpu]
    if stale:
        return (f"{state.path}: rows for {gpu} under {'; '.join(stale)}, not this torch {torch_version} / triton "
                f"{triton_version}: not read (`tigon tune` measures for these)")
    if not os.path.exists(state.path):
        return f"{state.path}: none (`tigon tune` writes it)"
    return f"{state.path}: no rows for {gpu or 'a CPU'}"


def cmd_env(args=None) -> int:
    import tigon

    print(f"python         {platform.python_version()} ({sys.executable})")
    print(f"tigon          {tigon.__version__} ({os.path.dirname(tigon.__file__)})")
    try:
        import torch
    except ModuleNotFoundError as e:
        print(f"tigon env: {_log.missing_package(e, 'tigon') or e}", file=sys.stderr)
        return 1
    print(f"torch          {torch.__version__} (built for CUDA {torch.version.cuda})")
    try:
        import triton

        print(f"triton         {triton.__version__}")
    except ImportError:
        print("triton         not installed (every op runs its PyTorch reference): pip install triton")
    missing = 'not installed (tigon.patch and tigon.generate need it): pip install "tigon[hf]"'
    for dist in ("transformers", "liger-kernel", "cut-cross-entropy"):
        v = _version(dist)
        if v or dist == "transformers":
            print(f"{dist:<14} {v or missing}")
    gpu = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}          {p.name}, compute capability {p.major}.{p.minor}, "
                  f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
        device, gpu = torch.device("cuda"), torch.cuda.get_device_name(0)
    else:
        print("GPU            no CUDA device")
        device = torch.device("cpu")
    interp = os.environ.get("TRITON_INTERPRET", "")
    print(f"TRITON_INTERPRET={interp or 'unset'}: "
          + ("on, CPU tensors run the Triton kernels through the interpreter (slow: for tests)"
             if interp not in ("", "0") else "off"))
    try:
        from tigon.ops import _library
        names = public_ops()
    except Exception as e:  # noqa: BLE001  (a broken install: say so, and keep the versions above)
        print(f"ops: cannot import tigon.ops: {type(e).__name__}: {e}")
        return 1
    path = _library.backend_for(device)
    print(f"ops on the default device ({device}): {path_text(path, device)}")
    print(f"  {'op':<24} {'path':<10} launch settings")
    for op in names:
        print(f"  {op:<24} {path:<10} {launch_text(op, gpu)}")
    print(f"tuned cache    {cache_text(gpu)}")
    print(f"training attention (tigon.patch): {attention_text(gpu)}")
    return 0
