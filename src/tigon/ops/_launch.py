"""Launch geometry and input validation shared by every op.

Validation raises ValueError/TypeError that name the op, the argument and what was expected.

Dtypes, one rule for every op and both paths (tests/ops/test_bad_input.py::test_mixed_dtypes):
- x, the tensors combined with it (residual, gate and up, base_out), the weights and biases of its matrix
  products, and the KV caches share x's dtype; a mix is a TypeError naming the op and the argument (torch's own
  matmul refuses it too; a silent cast would copy the weight on every call or round the activations).
- Per-channel parameters read in fp32 may be any float dtype: norm weights and biases (rms_norm, add_rms_norm,
  layer_norm, qk_norm_rope), cos/sin (apply_rope, qk_norm_rope, rope_kv_write, rope_kv_append), LoRA adapters
  (lora_linear, lora_add: cast to x's dtype for their products, as PEFT does) and MoE routing weights
  (moe_combine). The output is in x's dtype, except rms_norm-style "llama" casting, which promotes as
  LlamaRMSNorm's `weight * x_normed.to(x.dtype)` does. decode_linear's norm_weight is not one: its output feeds
  a product in x's dtype, where HF's modules would fail too.
- Independent tensors keep their own dtypes: apply_rope's q and k; a teacher's or reference model's
  (hidden, weight) pair shares a dtype with itself, not with the student's or policy's.
"""

import functools
import math
import numbers

import torch
import triton

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Row-wise kernels keep one whole row in registers; past this the row would spill.
MAX_FUSED_HIDDEN = 65536
# Rows of a decode step's launches: decode_linear's one M tile (tl.dot's least M, so 1 to 16 rows cost the same),
# the largest batch the fused decode layer step takes, and the launches that join its PDL chain (ops/_pdl.py).
DECODE_ROWS = 16


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=16)
def capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA `device` ((9, 0) on Hopper), None off CUDA: cached, no host work a call."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=16)
def _sm_limits(device_index: int) -> tuple[int, int, int]:
    """(registers, bytes of shared memory, threads) one SM holds: the CUDA occupancy rule's budgets."""
    props = torch.cuda.get_device_properties(device_index)
    return (getattr(props, "regs_per_multiprocessor", 65536),
            getattr(props, "shared_memory_per_multiprocessor", 228 << 10),
            getattr(props, "max_threads_per_multi_processor", 2048))


def programs_per_sm(compiled, device_index: int, num_warps: int) -> int:
    """How many programs of a compiled Triton kernel one SM runs at once, from its registers (allocated per warp
    in 256-register units), its shared memory (plus the 1 KiB the driver reserves a block) and its warps; 0 when
    the compiled kernel does not say (an older Triton) or the rule is not CUDA's (ROCm: 64-lane wavefronts)."""
    if torch.version.hip is not None:
        return 0
    load = getattr(compiled, "_init_handles", None)
    if load is not None:
        load()  # loads the module: the register count is known from here
    regs, shared = getattr(compiled, "n_regs", None), getattr(getattr(compiled, "metadata", None), "shared", None)
    if not regs or shared is None:
        return 0
    sm_regs, sm_shared, sm_threads = _sm_limits(device_index)
    per_warp = -(-regs * 32 // 256) * 256
    return max(1, min(sm_regs // (per_warp * num_warps), sm_shared // (shared + 1024), sm_threads // (32 * num_warps),
                      32))


def num_programs(device: torch.device, rows: int, per_sm: int) -> int:
    """Programs for a persistent (row-looping) kernel: enough to fill the GPU, never more than rows."""
    if device.type == "cuda":
        target = sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    else:
        target = 4  # the interpreter pays ~1 ms per program: keep the grid small
    return max(1, min(rows, target))


def cdiv(a, b):
    """ceil(a / b), as triton.cdiv computes it, for host code: in Triton 3.6 triton.cdiv and
    triton.next_power_of_2 are ConstexprFunctions whose call costs ~4 us of host time on a fast CPU (an import
    and argument unwrapping per call), several times per launch of a small op."""
    return (a + b - 1) // b


def next_power_of_2(n):
    """The least power of two >= n (0 for 0), as triton.next_power_of_2, for host code (see cdiv); symbolic
    sizes (torch.compile tracing) go to triton's bit arithmetic."""
    if type(n) is not int or n < 0:
        return triton.next_power_of_2(n)
    return 1 << (n - 1).bit_length() if n else 0


def row_block(op: str, n: int, arg: str = "hidden size") -> int:
    if n > MAX_FUSED_HIDDEN:
        raise ValueError(f"{op}: {arg} {n} is over the kernel's limit of {MAX_FUSED_HIDDEN}")
    return next_power_of_2(max(n, 1))


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


def finite(v) -> bool:
    """v is not inf or NaN, by comparisons: under torch.compile(dynamic=True) a Python float argument arrives as a
    SymFloat, which math.isfinite cannot take in a traced graph (a graph break), while a comparison guards on it."""
    return -math.inf < v < math.inf


def check_eps(op: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, torch.SymFloat)) or not finite(eps) or eps <= 0:
        raise ValueError(f"{op}: eps must be a finite number > 0, got {eps!r}")
    return float(eps)


def check_number(op: str, name: str, v, lo: float = -math.inf, hi: float = math.inf) -> float:
    """A Python real in [lo, hi], finite. Tensors are refused: reading one would sync the host and break
    torch.compile's graph."""
    where = "" if (lo, hi) == (-math.inf, math.inf) else f" in [{lo}, {hi}]"
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{op}: {name} must be a Python number{where}, got {type(v).__name__}")
    if not finite(v) or not lo <= v <= hi:
        raise ValueError(f"{op}: {name} must be a finite number{where}, got {v!r}")
    return float(v)


def check_bool(op: str, name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(v).__name__}")
    return v


def check_min_dim(op: str, name: str, t: torch.Tensor, n: int = 1) -> None:
    if t.dim() < n:
        raise ValueError(f"{op}: {name} must have at least {n} dimension{'s' if n > 1 else ''}, "
                         f"got shape {tuple(t.shape)}")


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when its last dim is strided: the kernels read the last dim at unit stride and every
    other dim through its stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


def is_leafish(t: torch.Tensor) -> bool:
    """A leaf, or a view of one: its storage belongs to the caller, so an op must not write over it.
    (is_leaf and _base, not grad_fn: torch.compile traces these)"""
    return t.is_leaf or (t._base is not None and t._base.is_leaf)


def may_overlap(t: torch.Tensor) -> bool:
    """True unless the layout proves that no two elements of `t` share memory (stride 0, or rows that run
    into each other as in as_strided views). From sizes and strides only: no data read, fine under compile.
    Sufficient, not necessary: some interleaved layouts without overlap also answer True."""
    if t.numel() == 0:
        return False
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    span = 0  # elements covered by the dims seen so far, minus one
    for st, sz in dims:
        if st <= span:
            return True
        span += st * (sz - 1)
    return False


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View `t` as [rows, last]; copies only when the last dim is strided or the rows can't be one stride.
    The row count is explicit: view(-1, 0) is ambiguous for a zero-width tensor."""
    if t.dim() == 0:
        raise ValueError("expected at least one dimension")
    if t.stride(-1) != 1:
        t = t.contiguous()
    shape = (math.prod(t.shape[:-1]), t.shape[-1])
    try:
        return t.view(shape)
    except RuntimeError:
        return t.reshape(shape) if t.is_contiguous() else t.contiguous().view(shape)
