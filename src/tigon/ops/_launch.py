"""Launch geometry and input validation shared by every op.

Validation raises ValueError/TypeError that name the op, the argument and what was expected.
"""

import functools
import math

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Row-wise kernels keep one whole row in registers; past this the row would spill.
MAX_FUSED_HIDDEN = 65536


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(device: torch.device, rows: int, per_sm: int) -> int:
    """Programs for a persistent (row-looping) kernel: enough to fill the GPU, never more than rows."""
    if device.type == "cuda":
        target = sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    else:
        target = 4  # the interpreter pays ~1 ms per program: keep the grid small
    return max(1, min(rows, target))


def row_block(op: str, n: int, arg: str = "hidden size") -> int:
    if n > MAX_FUSED_HIDDEN:
        raise ValueError(f"{op}: {arg} {n} is over the kernel's limit of {MAX_FUSED_HIDDEN}")
    return triton.next_power_of_2(max(n, 1))


def row_warps(block: int, elem_bytes: int = 2) -> int:
    """Warps for a one-row-per-program kernel: ~8-16 elements per thread, 1..16 warps."""
    return max(1, min(16, block // 256 if elem_bytes <= 2 else block // 128))


def check_tensor(op: str, arg: str, t, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {arg} must be float32, float16 or bfloat16, got {t.dtype}")


def check_same_device(op: str, ref_arg: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref_arg} is on {ref.device}")


def check_same_dtype(op: str, ref_arg: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{op}: {name} has dtype {t.dtype} but {ref_arg} has dtype {ref.dtype}")


def check_shape(op: str, arg: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: {arg} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_eps(op: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"{op}: eps must be a finite number > 0, got {eps!r}")
    return float(eps)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View `t` as [rows, last]; copies only when the last dim is strided or the rows can't be one stride."""
    if t.dim() == 0:
        raise ValueError("expected at least one dimension")
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1]) if t.is_contiguous() else t.contiguous().view(-1, t.shape[-1])
