"""AdamW with 8-bit block-quantized moments, one parameter a call: the optimizer state at 2 bytes a parameter.

torch's AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (4 bytes a bf16 parameter) or in fp32 (8).
Here each moment is a uint8 code per element and an fp32 scale per block of 256 elements (the block's absmax):
2.03 bytes a parameter for both. A code is a small float read off the fp32 bits of |x| / absmax (3 mantissa bits,
4 exponent bits for exp_avg plus a sign bit, 5 for exp_avg_sq), rounded stochastically so that the stored moments
are unbiased: round-to-nearest would freeze exp_avg_sq, whose change of 0.1% a step (beta2 = 0.999) is far below
half a code step (6%). The random bits are a hash of the element's index and the step, so a step is deterministic.

One launch updates one parameter (the optimizer calls it from each parameter's gradient hook, as the gradient
arrives), from plain pointers. A program owns a [blocks, 256] tile: it decodes the moments, runs torch's AdamW
update in fp32 with the new, unquantized moments (quantization is for storage only), writes the parameter once in
its dtype and the moments' new codes and scales. Per element it reads 2 + 2 bytes of bf16 param and grad and 2 code
bytes, writes 2 + 2 (the scales add 8 bytes a block): 10.06 bytes against 14 for bf16 AdamW (docs/ops/adamw8bit.md).

Layout contract:
- `param` any shape, contiguous, fp32 / fp16 / bf16; `grad` of its shape, dtype and device, contiguous;
- `m_codes`, `v_codes`: uint8 [numel]; `m_scales`, `v_scales`: fp32 [cdiv(numel, 256)]; 1-D, contiguous, on the
  param's device (`new_moments(param)` makes them);
- param and the four state tensors are updated in place; the grad is only read.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, _library, reference
from .adamw import CLIP_EPS, check_hyper
from .config import ADAMW8BIT, AdamW8bitConfig

MOMENT_BLOCK = reference.MOMENT_BLOCK
_BLOCK = tl.constexpr(MOMENT_BLOCK)
_M_BIAS, _V_BIAS = (tl.constexpr(b) for b in reference.MOMENT_BIAS)
_M_CMAX, _V_CMAX = (tl.constexpr(c) for c in reference.MOMENT_CMAX)
# quantize_moments encodes this many elements at a time: its int64 temporaries stay ~100 MB for any tensor
_QUANTIZE_CHUNK = 1 << 22


@triton.jit
def _moment_hash(o, seed):
    """`reference.moment_hash` in wrapping uint32: the hash of the element index's low 32 bits ^ seed."""
    x = o.to(tl.uint32) ^ seed.to(tl.uint32)
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _decode(b_c, b_s, BIAS: tl.constexpr, SIGNED: tl.constexpr):
    """fp32 moments of a [BLOCKS, BLOCK] tile of codes (int32) with their blocks' scales [BLOCKS]."""
    c = b_c
    if SIGNED:
        c = b_c & 0x7F
    val = ((c + BIAS) << 20).to(tl.float32, bitcast=True) * b_s[:, None]
    val = tl.where(c == 0, 0.0, val)
    if SIGNED:
        val = tl.where(b_c >= 0x80, -val, val)
    return val


@triton.jit
def _encode(x, o, seed, BIAS: tl.constexpr, CMAX: tl.constexpr, SIGNED: tl.constexpr):
    """(int32 codes, fp32 scales [BLOCKS]) of a tile of moments x at element indices o, a row per block."""
    a = tl.abs(x)
    # exact (masked lanes are 0); a NaN (from a NaN gradient) is left out: it stays in its element, as code cmax
    scale = tl.max(tl.where(a == a, a, 0.0), axis=1)
    u = tl.div_rn(a, tl.where(scale > 0, scale, 1.0)[:, None])
    bits = tl.minimum(u.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x3F800000)  # u <= 1.0; a NaN's bits become 1.0's
    r = (_moment_hash(o, seed) >> 12).to(tl.int32)  # 20 random bits: round up with P = the dropped fraction
    c = ((bits + r) >> 20) - BIAS
    c = tl.minimum(tl.maximum(c, 0), CMAX)
    if SIGNED:
        c = c | tl.where(x < 0, 0x80, 0)
    return c, scale


@triton.jit
def _step_tile(P, G, MC, MS, VC, VS, o, blk, n, nblocks, coef, decay, beta1, beta2, one_m_beta1, one_m_beta2, eps,
               step_size, bc2_sqrt, seed_m, seed_v, MAXIMIZE: tl.constexpr, CLIP: tl.constexpr,
               MASKED: tl.constexpr):
    """The update of one [BLOCKS, BLOCK] tile: elements o of blocks blk. MASKED: the tile may pass the end."""
    if MASKED:
        m_o = o < n
        m_b = blk < nblocks
        b_p = tl.load(P + o, mask=m_o, other=0.0).to(tl.float32)
        b_g = tl.load(G + o, mask=m_o, other=0.0).to(tl.float32)
        b_mc = tl.load(MC + o, mask=m_o, other=0).to(tl.int32)
        b_vc = tl.load(VC + o, mask=m_o, other=0).to(tl.int32)
        b_ms = tl.load(MS + blk, mask=m_b, other=0.0)
        b_vs = tl.load(VS + blk, mask=m_b, other=0.0)
    else:
        b_p = tl.load(P + o).to(tl.float32)
        b_g = tl.load(G + o).to(tl.float32)
        b_mc = tl.load(MC + o).to(tl.int32)
        b_vc = tl.load(VC + o).to(tl.int32)
        b_ms = tl.load(MS + blk)
        b_vs = tl.load(VS + blk)
    if CLIP:
        b_g = b_g * coef
    if MAXIMIZE:
        b_g = -b_g
    # ops/adamw.py's _adamw_update, on the decoded moments
    b_m = beta1 * _decode(b_mc, b_ms, _M_BIAS, True) + one_m_beta1 * b_g
    b_v = beta2 * _decode(b_vc, b_vs, _V_BIAS, False) + one_m_beta2 * b_g * b_g
    b_p = b_p * decay
    denom = tl.div_rn(tl.sqrt_rn(b_v), bc2_sqrt) + eps
    b_p = b_p - tl.div_rn(step_size * b_m, denom)
    c_m, s_m = _encode(b_m, o, seed_m, _M_BIAS, _M_CMAX, True)
    c_v, s_v = _encode(b_v, o, seed_v, _V_BIAS, _V_CMAX, False)
    if MASKED:
        tl.store(P + o, b_p.to(P.dtype.element_ty), mask=m_o)
        tl.store(MC + o, c_m.to(tl.uint8), mask=m_o)
        tl.store(VC + o, c_v.to(tl.uint8), mask=m_o)
        tl.store(MS + blk, s_m, mask=m_b)
        tl.store(VS + blk, s_v, mask=m_b)
    else:
        tl.store(P + o, b_p.to(P.dtype.element_ty))
        tl.store(MC + o, c_m.to(tl.uint8))
        tl.store(VC + o, c_v.to(tl.uint8))
        tl.store(MS + blk, s_m)
        tl.store(VS + blk, s_v)


@triton.jit(do_not_specialize=["seed_m", "seed_v"])
def _adamw8bit_kernel(
    P,  # [n] param (fp32, fp16 or bf16), read and written
    G,  # [n] grad, the param's dtype, read
    MC, MS,  # exp_avg: uint8 codes [n] and fp32 scales [nblocks], read and written
    VC, VS,  # exp_avg_sq: the same
    NORM,  # fp32 [1]: the gradients' total norm (read when CLIP)
    n, nblocks, max_norm, clip_eps, decay, beta1, beta2,
    one_m_beta1, one_m_beta2,  # 1 - beta from the host's doubles (ops/adamw.py says why)
    eps, step_size, bc2_sqrt,
    seed_m, seed_v,  # int32 < 2^31: reference.moment_seed(step, 1) and (step, 2); new each step, not specialized
    BLOCKS: tl.constexpr,  # blocks of 256 a program
    MAXIMIZE: tl.constexpr, CLIP: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)
    o = blk[:, None] * _BLOCK + tl.arange(0, _BLOCK)[None, :]
    coef = 1.0
    if CLIP:
        coef = tl.minimum(tl.div_rn(max_norm, tl.load(NORM) + clip_eps), 1.0)
    if (pid + 1) * (BLOCKS * _BLOCK) <= n:  # a whole tile: no mask, so the accesses vectorize
        _step_tile(P, G, MC, MS, VC, VS, o, blk, n, nblocks, coef, decay, beta1, beta2, one_m_beta1, one_m_beta2,
                   eps, step_size, bc2_sqrt, seed_m, seed_v, MAXIMIZE, CLIP, False)
    else:
        _step_tile(P, G, MC, MS, VC, VS, o, blk, n, nblocks, coef, decay, beta1, beta2, one_m_beta1, one_m_beta2,
                   eps, step_size, bc2_sqrt, seed_m, seed_v, MAXIMIZE, CLIP, True)


def _step_run(param, grad, m_codes, m_scales, v_codes, v_scales, norm, *, config: AdamW8bitConfig, lr, beta1, beta2,
              eps, weight_decay, step, maximize, max_grad_norm) -> None:
    """One update on concrete, checked tensors: the kernel, or the reference where the kernels do not run."""
    clip = max_grad_norm is not None
    if not _library.use_kernels("adamw8bit", param):
        with torch.no_grad():  # param may be a leaf that requires grad (called from its gradient hook)
            reference.adamw8bit_step_(param, grad, m_codes, m_scales, v_codes, v_scales, lr=lr, beta1=beta1,
                                      beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, maximize=maximize,
                                      norm=norm if clip else None, max_grad_norm=max_grad_norm)
        return
    n = param.numel()
    if n == 0:
        return
    nblocks = _launch.cdiv(n, MOMENT_BLOCK)
    _adamw8bit_kernel[(_launch.cdiv(nblocks, config.blocks_per_program),)](
        param, grad, m_codes, m_scales, v_codes, v_scales, norm.reshape(1).float() if clip else m_scales,
        n, nblocks, float(max_grad_norm) if clip else 0.0, CLIP_EPS, 1.0 - lr * weight_decay, beta1, beta2,
        1.0 - beta1, 1.0 - beta2, eps, lr / (1.0 - beta1**step), (1.0 - beta2**step) ** 0.5,
        reference.moment_seed(step, 1), reference.moment_seed(step, 2),
        BLOCKS=config.blocks_per_program, MAXIMIZE=maximize, CLIP=clip, num_warps=config.num_warps,
    )


def _step_launch(
    param: torch.Tensor, grad: torch.Tensor, m_codes: torch.Tensor, m_scales: torch.Tensor, v_codes: torch.Tensor,
    v_scales: torch.Tensor, norm: Optional[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, step: int, maximize: bool, max_grad_norm: Optional[float], config: list[int],
) -> None:
    """One `adamw8bit_step_`; config: `AdamW8bitConfig.ints()`."""
    _step_run(param, grad, m_codes, m_scales, v_codes, v_scales, norm, config=AdamW8bitConfig(*config), lr=lr,
              beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, maximize=maximize,
              max_grad_norm=max_grad_norm)


def _step_fake(param, grad, m_codes, m_scales, v_codes, v_scales, norm, lr, beta1, beta2, eps, weight_decay, step,
               maximize, max_grad_norm, config):
    return None


# Eager calls bump no versions: no autograd graph holds an optimizer's state (as _ADAMW_STEP).
_ADAMW8BIT_STEP = _library.Kernel("adamw8bit_step_", _step_launch, _step_fake, bump_versions=False,
                                  mutates_args=("param", "m_codes", "m_scales", "v_codes", "v_scales"))


def _check_state(op: str, numel: int, ref: str, device: torch.device, **state) -> None:
    """The four state tensors of a tensor of `numel` elements: codes uint8 [numel], scales fp32 [cdiv(numel, 256)],
    1-D, contiguous, on `device` (the device of the argument named `ref`)."""
    nblocks = _launch.cdiv(numel, MOMENT_BLOCK)
    for name, t in state.items():
        _launch.check_tensor(op, name, t, floating=False)
        dtype, size = (torch.uint8, numel) if name.endswith("codes") else (torch.float32, nblocks)
        if t.dtype != dtype:
            raise TypeError(f"{op}: {name} must be {dtype}, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {ref} is on {device}")
        if t.is_sparse or t.dim() != 1 or t.numel() != size or not t.is_contiguous():
            what = "a code per element" if dtype == torch.uint8 else "a scale per block of 256 elements"
            got = f"shape {tuple(t.shape)}" + ("" if t.is_sparse or t.is_contiguous() else ", not contiguous")
            raise ValueError(f"{op}: {name} must be a contiguous 1-D tensor of shape ({size},) ({what}), got {got}")


def _check_dense(op: str, **tensors) -> None:
    for name, t in tensors.items():
        _launch.check_tensor(op, name, t)
        if t.is_sparse or not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be a dense contiguous tensor")


def new_moments(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero moments for `param`: (m_codes uint8 [numel], m_scales fp32 [cdiv(numel, 256)], v_codes, v_scales) on
    its device."""
    _launch.check_tensor("tigon.ops.new_moments", "param", param, floating=False)
    n, device = param.numel(), param.device
    nblocks = _launch.cdiv(n, MOMENT_BLOCK)
    return tuple(torch.zeros(k, dtype=dt, device=device) for k, dt in ((n, torch.uint8), (nblocks, torch.float32),
                                                                        (n, torch.uint8), (nblocks, torch.float32)))


def quantize_moments(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int = 0):
    """(m_codes, m_scales, v_codes, v_scales) of float moments (a torch AdamW state's `exp_avg`, `exp_avg_sq`: one
    shape, contiguous, fp32 / fp16 / bf16), with the stochastic rounding of step `step` (an int >= 0; the step the
    moments are from keeps a resumed run's random bits apart from the next step's). Plain PyTorch on their device."""
    op = "tigon.ops.quantize_moments"
    _check_dense(op, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    _launch.check_same_device(op, "exp_avg", exp_avg, exp_avg_sq=exp_avg_sq)
    if exp_avg_sq.shape != exp_avg.shape:
        raise ValueError(f"{op}: exp_avg_sq has shape {tuple(exp_avg_sq.shape)} but exp_avg has "
                         f"{tuple(exp_avg.shape)}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{op}: step must be an int >= 0, got {step!r}")
    out = new_moments(exp_avg)
    m, v = exp_avg.reshape(-1), exp_avg_sq.reshape(-1)
    seeds = reference.moment_seed(step, 1), reference.moment_seed(step, 2)
    for start in range(0, m.numel(), _QUANTIZE_CHUNK):
        end = min(start + _QUANTIZE_CHUNK, m.numel())
        blocks = slice(start // MOMENT_BLOCK, _launch.cdiv(end, MOMENT_BLOCK))
        for x, seed, signed, codes, scales in ((m, seeds[0], True, *out[:2]), (v, seeds[1], False, *out[2:])):
            c, s = reference.encode_moment(x[start:end], seed, signed, start)
            codes[start:end] = c
            scales[blocks] = s
    return out


def dequantize_moments(m_codes, m_scales, v_codes, v_scales, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq): fp32 tensors of `shape` decoded from the 8-bit state (to save a checkpoint in
    torch AdamW's form, or to inspect it)."""
    op = "tigon.ops.dequantize_moments"
    try:
        shape = torch.Size(shape)
    except TypeError:
        raise TypeError(f"{op}: shape must be a sequence of ints, got {shape!r}") from None
    _launch.check_tensor(op, "m_codes", m_codes, floating=False)
    _check_state(op, shape.numel(), "m_codes", m_codes.device, m_codes=m_codes, m_scales=m_scales, v_codes=v_codes,
                 v_scales=v_scales)
    return reference.dequantize_moments(m_codes, m_scales, v_codes, v_scales, shape)


def adamw8bit_step_(param, grad, m_codes, m_scales, v_codes, v_scales, *, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=1e-2, step, maximize=False, max_grad_norm=None, norm=None,
                    config: Optional[AdamW8bitConfig] = None) -> None:
    """torch.optim.AdamW's update of step `step` (1 for the first) of one parameter, in place, with its moments
    stored as 8-bit codes and per-256-element fp32 scales (`new_moments(param)`; the layout contract above).

    The update runs in fp32 on the decoded moments and the new moments before they are quantized; the stored
    moments are rounded stochastically (unbiased, deterministic for a given step). With `max_grad_norm`, the
    gradient is scaled by min(1, max_grad_norm / (norm + 1e-6)) on the fly, where `norm` (required then) is the
    total norm of everything clipped together, a one-element fp32 tensor on the param's device. Forward only, no
    autograd. Under torch.compile one graph node (`tigon::adamw8bit_step_`)."""
    op = "tigon.ops.adamw8bit_step_"
    _check_dense(op, param=param, grad=grad)
    _launch.check_same_device(op, "param", param, grad=grad)
    _launch.check_same_dtype(op, "param", param, grad=grad)
    if grad.shape != param.shape:
        raise ValueError(f"{op}: grad has shape {tuple(grad.shape)} but param has {tuple(param.shape)}")
    _check_state(op, param.numel(), "param", param.device, m_codes=m_codes, m_scales=m_scales, v_codes=v_codes,
                 v_scales=v_scales)
    check_hyper(op, lr, beta1, beta2, eps, weight_decay, step, max_grad_norm)
    _launch.check_bool(op, "maximize", maximize)
    if max_grad_norm is not None and (not isinstance(norm, torch.Tensor) or norm.numel() != 1
                                      or norm.device != param.device or not norm.is_floating_point()):
        got = (f"shape {tuple(norm.shape)}, {norm.dtype} on {norm.device}" if isinstance(norm, torch.Tensor)
               else type(norm).__name__)
        raise ValueError(f"{op}: max_grad_norm needs norm, the gradients' total norm as a one-element float tensor "
                         f"on {param.device}; got {got}")
    if config is not None and not isinstance(config, AdamW8bitConfig):
        raise TypeError(f"{op}: config must be an AdamW8bitConfig, got {type(config).__name__}")
    if param.numel() == 0:
        return
    _ADAMW8BIT_STEP(param, grad, m_codes, m_scales, v_codes, v_scales,
                    norm if max_grad_norm is not None else None, float(lr), float(beta1), float(beta2), float(eps),
                    float(weight_decay), step, maximize, None if max_grad_norm is None else float(max_grad_norm),
                    (config or ADAMW8BIT).ints())
