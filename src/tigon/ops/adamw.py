"""AdamW over every tensor of a parameter group in one launch, with gradient clipping's norm fused in.

One optimizer step reads a parameter, its gradient and the two moments and writes the parameter and the moments:
7 elements moved per parameter, 14 bytes in bf16 (21.5 GB at 1.5B parameters: 5.0 ms at 4.3 TB/s). torch's
fused AdamW took 8.8 ms for it on an H200 (docs/ops/adamw.md). Here a table of the tensors' addresses (read on
the device) lets one launch walk all of them: each program owns a chunk of one tensor, and the chunks are sized
so that every program moves the same bytes. Gradient clipping (`torch.nn.utils.clip_grad_norm_`) reads the
gradients once more for the norm and then reads and writes them again to scale them; here the norm is one
read (per-program partial sums, added in a fixed order: deterministic) and the scale is applied to the gradient
in registers by the update, never stored.

Layout contract:
- `params`, `grads`, `exp_avgs`, `exp_avg_sqs`: lists of one length; entry i of each has the same numel, is
  contiguous, and lives on one device with all the others; params and grads share one floating dtype, the two
  moment lists share one floating dtype (the params' or float32);
- params and the moments are updated in place; the grads are only read.
The math (torch.optim.AdamW's, step for step) and the byte model are in docs/ops/adamw.md.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, _library, reference
from .config import ADAMW, AdamWConfig

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
CLIP_EPS = 1e-6  # clip_grad_norm_'s: coef = max_norm / (norm + 1e-6), at most 1


@triton.jit
def _adamw_update(P, G, M, V, W, o, mask, coef, decay, beta1, beta2, one_m_beta1, one_m_beta2, eps, step_size,
                  bc2_sqrt, MAXIMIZE: tl.constexpr, MASKED: tl.constexpr, MASTER: tl.constexpr):
    """One block of the update, in fp32, stored once in each tensor's dtype (torch's fused AdamW's order). With
    MASTER, P holds the fp32 master weights and W the model's copy, written from them."""
    if MASKED:
        b_g = tl.load(G + o, mask=mask, other=0.0).to(tl.float32)
        b_p = tl.load(P + o, mask=mask, other=0.0).to(tl.float32)
        b_m = tl.load(M + o, mask=mask, other=0.0).to(tl.float32)
        b_v = tl.load(V + o, mask=mask, other=0.0).to(tl.float32)
    else:
        b_g = tl.load(G + o).to(tl.float32)
        b_p = tl.load(P + o).to(tl.float32)
        b_m = tl.load(M + o).to(tl.float32)
        b_v = tl.load(V + o).to(tl.float32)
    b_g = b_g * coef
    if MAXIMIZE:
        b_g = -b_g
    b_p = b_p * decay
    b_m = beta1 * b_m + one_m_beta1 * b_g
    b_v = beta2 * b_v + one_m_beta2 * b_g * b_g
    denom = tl.div_rn(tl.sqrt_rn(b_v), bc2_sqrt) + eps
    b_p = b_p - tl.div_rn(step_size * b_m, denom)
    if MASKED:
        tl.store(P + o, b_p.to(P.dtype.element_ty), mask=mask)
        tl.store(M + o, b_m.to(M.dtype.element_ty), mask=mask)
        tl.store(V + o, b_v.to(V.dtype.element_ty), mask=mask)
        if MASTER:
            tl.store(W + o, b_p.to(W.dtype.element_ty), mask=mask)
    else:
        tl.store(P + o, b_p.to(P.dtype.element_ty))
        tl.store(M + o, b_m.to(M.dtype.element_ty))
        tl.store(V + o, b_v.to(V.dtype.element_ty))
        if MASTER:
            tl.store(W + o, b_p.to(W.dtype.element_ty))


@triton.jit
def _program_chunk(PROG_TENSOR, PROG_CHUNK, NUMEL, CHUNK: tl.constexpr):
    """This program's tensor t (int64), the first element of its chunk, and the tensor's numel."""
    pid = tl.program_id(0)
    t = tl.load(PROG_TENSOR + pid).to(tl.int64)
    return t, tl.load(PROG_CHUNK + pid).to(tl.int64) * CHUNK, tl.load(NUMEL + t)


@triton.jit
def _tensor_ptr(ADDR, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The address at ADDR[t] as a pointer to DTYPE; 16-byte aligned when ALIGNED (checked on the host), which
    lets the unmasked accesses be 16-byte vectors."""
    p = tl.load(ADDR + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _adamw_kernel(
    ADDR,  # int64 [4 or 5, n]: the addresses of param (the fp32 master with MASTER), grad, exp_avg, exp_avg_sq
    # of each tensor, and with MASTER the model's param
    NUMEL,  # int64 [n]
    PROG_TENSOR,  # int32 [programs]: the tensor each program updates
    PROG_CHUNK,  # int32 [programs]: which CHUNK-element chunk of it
    NORM,  # fp32 [1]: the gradients' total norm (read when CLIP)
    n_tensors, max_norm, clip_eps, decay, beta1, beta2,
    one_m_beta1, one_m_beta2,  # 1 - beta from the host's doubles: 1 - fp32(0.999) would be 1e3 u32 off
    eps, step_size, bc2_sqrt,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    MAXIMIZE: tl.constexpr, CLIP: tl.constexpr, ALIGNED: tl.constexpr, MASTER: tl.constexpr,
):
    t, start, n = _program_chunk(PROG_TENSOR, PROG_CHUNK, NUMEL, CHUNK)
    p_p = _tensor_ptr(ADDR, t, P_DTYPE, ALIGNED)
    p_g = _tensor_ptr(ADDR + n_tensors, t, G_DTYPE, ALIGNED)
    p_m = _tensor_ptr(ADDR + 2 * n_tensors, t, S_DTYPE, ALIGNED)
    p_v = _tensor_ptr(ADDR + 3 * n_tensors, t, S_DTYPE, ALIGNED)
    p_w = p_g  # unused without MASTER
    if MASTER:
        p_w = _tensor_ptr(ADDR + 4 * n_tensors, t, W_DTYPE, ALIGNED)
    coef = 1.0
    if CLIP:
        coef = tl.minimum(max_norm / (tl.load(NORM) + clip_eps), 1.0)
    o_b = tl.arange(0, BLOCK)
    if start + CHUNK <= n:  # a whole chunk: no mask, so the accesses vectorize
        for i in tl.static_range(0, CHUNK, BLOCK):
            o = start + i + o_b
            _adamw_update(p_p, p_g, p_m, p_v, p_w, o, o, coef, decay, beta1, beta2, one_m_beta1, one_m_beta2, eps,
                          step_size, bc2_sqrt, MAXIMIZE, False, MASTER)
    else:
        for i in tl.static_range(0, CHUNK, BLOCK):
            o = start + i + o_b
            _adamw_update(p_p, p_g, p_m, p_v, p_w, o, o < n, coef, decay, beta1, beta2, one_m_beta1, one_m_beta2,
                          eps, step_size, bc2_sqrt, MAXIMIZE, True, MASTER)


@triton.jit
def _adamw_sq_sum_kernel(
    ADDR,  # int64 [n]: the gradients' addresses
    NUMEL, PROG_TENSOR, PROG_CHUNK,  # as in _adamw_kernel
    PARTIAL,  # fp32 [programs]: each program's sum of squares
    G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr,
):
    t, start, n = _program_chunk(PROG_TENSOR, PROG_CHUNK, NUMEL, CHUNK)
    p_g = _tensor_ptr(ADDR, t, G_DTYPE, ALIGNED)
    o_b = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if start + CHUNK <= n:
        for i in tl.static_range(0, CHUNK, BLOCK):
            b_g = tl.load(p_g + start + i + o_b).to(tl.float32)
            acc += b_g * b_g
    else:
        for i in tl.static_range(0, CHUNK, BLOCK):
            o = start + i + o_b
            b_g = tl.load(p_g + o, mask=o < n, other=0.0).to(tl.float32)
            acc += b_g * b_g
    tl.store(PARTIAL + tl.program_id(0), tl.sum(acc, axis=0))


class TensorTable:
    """The device-side description of lists of tensors for the multi-tensor kernels: the addresses (a row per
    list), the numels, and which chunk of which tensor each program owns.

    Built on the host from sizes and addresses, copied to the device asynchronously from pinned memory (no host
    sync). An optimizer keeps one per parameter group; when only addresses change (`matches` is False, `same_sizes`
    True: gradients freed and allocated again elsewhere) `retarget` rewrites the addresses and keeps the program
    table, which can hold a million entries."""

    def __init__(self, lists, chunk: int):
        first = lists[0]
        self.device = first[0].device
        self.n = len(first)
        self.rows = len(lists)
        self.numels = tuple(t.numel() for t in first)
        counts = [_launch.cdiv(n, chunk) for n in self.numels]
        self.programs = sum(counts)
        tensor_of = torch.repeat_interleave(torch.arange(self.n, dtype=torch.int32), torch.tensor(counts))
        firsts = torch.tensor([0] + counts[:-1], dtype=torch.int64).cumsum(0)
        chunk_of = torch.arange(self.programs, dtype=torch.int64) - firsts.repeat_interleave(torch.tensor(counts))
        self.prog = _to_device(torch.stack([tensor_of, chunk_of.to(torch.int32)]), self.device)
        self.retarget(lists)

    def retarget(self, lists) -> None:
        """Point the table at `lists`, tensors of the same sizes as the ones it was built for."""
        self.addresses = tuple(tuple(t.data_ptr() for t in ts) for ts in lists)
        self.aligned = all(a % 16 == 0 for row in self.addresses for a in row)
        host = torch.tensor([a for row in self.addresses for a in row] + list(self.numels), dtype=torch.int64)
        self.addr = _to_device(host, self.device)
        self.numel = self.addr[len(lists) * self.n:]

    def row(self, i: int) -> torch.Tensor:
        """The addresses of list i."""
        return self.addr[i * self.n:(i + 1) * self.n]

    def matches(self, lists) -> bool:
        return tuple(tuple(t.data_ptr() for t in ts) for ts in lists) == self.addresses and self.same_sizes(lists)

    def same_sizes(self, lists) -> bool:
        return (lists[0][0].device == self.device and len(lists[0]) == self.n
                and tuple(t.numel() for t in lists[0]) == self.numels)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def check_lists(op: str, params, grads, exp_avgs=None, exp_avg_sqs=None) -> None:
    """The layout contract above, with errors that name the op and the argument."""
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    lists = {k: v for k, v in lists.items() if v is not None}
    for name, ts in lists.items():
        if not isinstance(ts, (list, tuple)):
            raise TypeError(f"{op}: {name} must be a list of tensors, got {type(ts).__name__}")
        if len(ts) != len(params):
            raise ValueError(f"{op}: {name} has {len(ts)} tensors but params has {len(params)}")
    if not params:
        return
    ref = params[0]
    _launch.check_tensor(op, "params[0]", ref)
    state_dtype = exp_avgs[0].dtype if exp_avgs else None
    for name, ts in lists.items():
        for i, t in enumerate(ts):
            arg = f"{name}[{i}]"
            _launch.check_tensor(op, arg, t)
            if t.device != ref.device:
                raise ValueError(f"{op}: {arg} is on {t.device} but params[0] is on {ref.device}")
            if t.is_sparse or not t.is_contiguous():
                raise ValueError(f"{op}: {arg} must be a dense contiguous tensor")
            if t.numel() != params[i].numel():
                raise ValueError(f"{op}: {arg} has {t.numel()} elements but params[{i}] has {params[i].numel()}")
            want, like = (ref.dtype, "params[0]") if name in ("params", "grads") else (state_dtype, "exp_avgs[0]")
            if t.dtype != want:
                raise TypeError(f"{op}: {arg} has dtype {t.dtype} but {like} has dtype {want}")
    if state_dtype is not None and state_dtype not in (ref.dtype, torch.float32):
        raise TypeError(f"{op}: the moments must be float32 or the params' dtype {ref.dtype}, got {state_dtype}")


def check_master(op: str, params, master_params) -> None:
    """master_params: None, or one contiguous fp32 tensor per param (of a lower precision) on its device."""
    if master_params is None:
        return
    if not isinstance(master_params, (list, tuple)) or len(master_params) != len(params):
        raise ValueError(f"{op}: master_params must be a list of {len(params)} tensors, one per param")
    for i, (w, p) in enumerate(zip(master_params, params)):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
            raise TypeError(f"{op}: master_params[{i}] must be a float32 tensor")
        if p.dtype == torch.float32:
            raise TypeError(f"{op}: params[{i}] is float32: master weights are for bf16 or fp16 params")
        if w.device != p.device or w.numel() != p.numel() or w.is_sparse or not w.is_contiguous():
            raise ValueError(f"{op}: master_params[{i}] must be a dense contiguous tensor on {p.device} with "
                             f"{p.numel()} elements")


def check_hyper(op: str, lr, beta1, beta2, eps, weight_decay, step, max_grad_norm) -> None:
    _launch.check_number(op, "lr", lr, 0.0)
    _launch.check_number(op, "beta1", beta1, 0.0, 1.0)
    _launch.check_number(op, "beta2", beta2, 0.0, 1.0)
    if beta1 == 1.0 or beta2 == 1.0:
        raise ValueError(f"{op}: beta1 and beta2 must be < 1 (the bias correction divides by 1 - beta**step)")
    _launch.check_number(op, "eps", eps, 0.0)
    _launch.check_number(op, "weight_decay", weight_decay, 0.0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"{op}: step must be an int >= 1 (the step being taken), got {step!r}")
    if max_grad_norm is not None:
        _launch.check_number(op, "max_grad_norm", max_grad_norm, 0.0)
        if max_grad_norm == 0:
            raise ValueError(f"{op}: max_grad_norm must be > 0 (or None for no clipping)")


def sq_sum_launch(table: TensorTable, grads_row: int, grad_dtype: torch.dtype, config: AdamWConfig) -> torch.Tensor:
    """fp32 [programs]: each program's sum of squared elements of the tensors of row `grads_row` of `table`."""
    partial = torch.empty(table.programs, device=table.device, dtype=torch.float32)
    if table.programs:
        _adamw_sq_sum_kernel[(table.programs,)](
            table.row(grads_row), table.numel, table.prog[0], table.prog[1], partial,
            G_DTYPE=_TL_DTYPES[grad_dtype], BLOCK=config.block, CHUNK=config.chunk,
            ALIGNED=table.aligned, num_warps=config.num_warps,
        )
    return partial


def adamw_launch(table: TensorTable, param_dtype, state_dtype, *, lr, beta1, beta2, eps, weight_decay, step,
                 maximize=False, norm=None, max_grad_norm=None, config: AdamWConfig = ADAMW) -> None:
    """One launch of the update over every tensor of `table`: 4 rows (params, grads, exp_avgs, exp_avg_sqs), or 5
    (fp32 master params, grads, exp_avgs, exp_avg_sqs, the model's params of dtype `param_dtype`)."""
    if table.programs == 0:
        return
    clip = max_grad_norm is not None
    _adamw_kernel[(table.programs,)](
        table.addr, table.numel, table.prog[0], table.prog[1], norm if clip else table.numel,
        len(table.numels), float(max_grad_norm) if clip else 0.0, CLIP_EPS, 1.0 - lr * weight_decay, beta1, beta2,
        1.0 - beta1, 1.0 - beta2, eps, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step),
        P_DTYPE=tl.float32 if table.rows == 5 else _TL_DTYPES[param_dtype], G_DTYPE=_TL_DTYPES[param_dtype],
        S_DTYPE=_TL_DTYPES[state_dtype], W_DTYPE=_TL_DTYPES[param_dtype], BLOCK=config.block,
        CHUNK=config.chunk, MAXIMIZE=maximize, CLIP=clip, ALIGNED=table.aligned,
        MASTER=table.rows == 5, num_warps=config.num_warps,
    )


def _grad_norm_run(grads, config: AdamWConfig) -> torch.Tensor:
    if not _library.use_kernels("grad_norm", grads[0]):
        return reference.grad_norm(grads)
    return sq_sum_launch(TensorTable([grads], config.chunk), 0, grads[0].dtype,
                         config).sum().sqrt()


def _grad_norm_launch(grads: list[torch.Tensor], config: list[int]) -> torch.Tensor:
    """The 2-norm of the grads, fp32 scalar; config: `AdamWConfig.ints()`."""
    return _grad_norm_run(grads, AdamWConfig(*config))


def _grad_norm_fake(grads, config):
    return grads[0].new_empty((), dtype=torch.float32)


_GRAD_NORM = _library.Kernel("grad_norm", _grad_norm_launch, _grad_norm_fake)


def grad_norm(grads, *, config: Optional[AdamWConfig] = None) -> torch.Tensor:
    """The total 2-norm of `grads` (a list of tensors of one floating dtype on one device, contiguous), as an fp32
    scalar on their device, with no host sync: what `torch.nn.utils.clip_grad_norm_` computes (and returns)
    before it scales. Per-program partial sums added in a fixed order: the same bits from run to run. Under
    torch.compile one graph node (`tigon::grad_norm`)."""
    op = "tigon.ops.grad_norm"
    check_lists(op, grads, grads)
    if not grads:
        raise ValueError(f"{op}: grads is empty")
    return _GRAD_NORM(list(grads), (config or ADAMW).ints())


def kernel_rows(params, grads, exp_avgs, exp_avg_sqs, master_params=()):
    """The rows of the update's address table: params, grads, exp_avgs, exp_avg_sqs; with masters, the fp32
    masters in the params' row and the params in a fifth row (written only)."""
    if not master_params:
        return [params, grads, exp_avgs, exp_avg_sqs]
    return [master_params, grads, exp_avgs, exp_avg_sqs, params]


def _step_run(params, grads, exp_avgs, exp_avg_sqs, master_params, norm, *, config: AdamWConfig, **kw) -> None:
    """One update on concrete tensors (checked): the kernel, or the reference where the kernels do not run."""
    clip = kw["max_grad_norm"] is not None
    if not _library.use_kernels("adamw", params[0]):
        reference.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, **kw, norm=norm if clip else None,
                              master_params=master_params or None)
        return
    table = TensorTable(kernel_rows(params, grads, exp_avgs, exp_avg_sqs, master_params), config.chunk)
    adamw_launch(table, params[0].dtype, exp_avgs[0].dtype, **kw, config=config,
                 norm=norm.reshape(1).float() if clip else None)


def _step_launch(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], master_params: list[torch.Tensor], norm: Optional[torch.Tensor], lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, step: int, maximize: bool,
    max_grad_norm: Optional[float], config: list[int],
) -> None:
    """One `adamw_step_` (master_params empty: none); config: `AdamWConfig.ints()`."""
    _step_run(params, grads, exp_avgs, exp_avg_sqs, master_params, norm, config=AdamWConfig(*config), lr=lr,
              beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, maximize=maximize,
              max_grad_norm=max_grad_norm)


def _step_fake(params, grads, exp_avgs, exp_avg_sqs, master_params, norm, lr, beta1, beta2, eps, weight_decay, step,
               maximize, max_grad_norm, config):
    return None


# Eager calls bump no versions: no autograd graph holds an optimizer's tensors (one host call a tensor saved).
_ADAMW_STEP = _library.Kernel("adamw_step_", _step_launch, _step_fake, bump_versions=False,
                              mutates_args=("params", "exp_avgs", "exp_avg_sqs", "master_params"))


def adamw_step_(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                step, maximize=False, max_grad_norm=None, norm=None, master_params=None,
                config: Optional[AdamWConfig] = None) -> None:
    """torch.optim.AdamW's update of step `step` (1 for the first) over lists of tensors, in place, one launch.

    With `master_params` (fp32 tensors, one per param), the update reads and writes them and `params` (bf16 or
    fp16) receive its rounding: the weights keep the updates below half an ulp of the model's dtype.

    With `max_grad_norm`, every gradient is scaled by min(1, max_grad_norm / (norm + 1e-6)) on the fly (not
    stored), as after `clip_grad_norm_`; `norm` is the total norm over everything clipped together (an fp32
    device scalar, `grad_norm(...)`; computed here from `grads` when None). Forward only, no autograd. Under
    torch.compile one graph node (`tigon::adamw_step_`); not for CUDA-graph capture (it copies the tensors'
    addresses to the device from the host each call)."""
    op = "tigon.ops.adamw_step_"
    check_lists(op, params, grads, exp_avgs, exp_avg_sqs)
    check_master(op, params, master_params)
    check_hyper(op, lr, beta1, beta2, eps, weight_decay, step, max_grad_norm)
    if not params:
        return
    _launch.check_bool(op, "maximize", maximize)
    config = config or ADAMW
    if max_grad_norm is not None and norm is None:
        norm = grad_norm(grads, config=config)
    if norm is not None and (not isinstance(norm, torch.Tensor) or norm.numel() != 1
                             or norm.device != params[0].device):
        raise ValueError(f"{op}: norm must be a one-element tensor on {params[0].device}")
    norm = norm if max_grad_norm is not None else None
    masters = list(master_params) if master_params is not None else []
    _ADAMW_STEP(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), masters, norm, float(lr), float(beta1),
                float(beta2), float(eps), float(weight_decay), step, maximize,
                None if max_grad_norm is None else float(max_grad_norm), config.ints())
