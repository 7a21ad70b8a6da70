"""Decode-step linear layers: y = x @ W^T for a few rows x (the batch of one decode step), with the neighbours
of a transformer's projections fused in.

At decode a projection reads its whole weight to produce a handful of rows: it is bound by the weight bytes
and, at 1-2 B parameters, by how many kernels a step launches. One kernel here does, for `x [M, K]`:
- `norm_weight`: RMSNorm of each row first ("llama" casting, as `ops.rms_norm`); every program recomputes the
  row statistics from x, which is a few KiB and sits in L2, so the norm costs no kernel and no pass over HBM
  (in a few wide loads: each is a dependent L2 round trip before the program's first weight tile);
- `weights`: 1 to 3 matrices `[N_i, K]` whose outputs are concatenated (q, k, v in one launch);
- `activation` ("silu" / "gelu_tanh"): exactly two weights (gate, up), the output is act(gate) * up: the
  gated MLP's first half without its `[M, 2 * I]` intermediate;
- `residual [M, N]`: added to the rounded product (the decoder's residual stream).

Each program owns BLOCK_N output columns of one matrix for BLOCK_M rows and walks K; the product is a
`tl.dot` with M padded to 16 (tensor cores, fp32 accumulation), which makes M = 1..16 cost the same. Rounding
follows the unfused modules: the norm output, each projection output and the GLU product are rounded to the
input dtype where the separate ops would round them. Inference only (no autograd).
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from . import _launch, _library, _pdl, decode_linear_picks, reference
from . import _rolling_buffer as _ws
from .config import DecodeLinearConfig

ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2}
MAX_WEIGHTS = 3
# x elements a NORM program loads per statistics step (rows x columns): 8192 columns at batch 1, 1024 at 8
# (DecodeLinearConfig.stats_elems overrides it; measured in docs/ops/decode_linear.md, "What the fused norm costs")
STATS_ELEMS = 8192


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 1:  # silu
        return g / (1.0 + tl.exp(-g))
    # gelu, tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1) (no libdevice under the interpreter)
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))


@triton.jit
def _dot(b_x, b_w, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    if UPCAST:  # the interpreter computes raw 16-bit products wrongly: fp32 numpy matmul instead
        return tl.dot(b_x.to(tl.float32), tl.trans(b_w.to(tl.float32)), input_precision="ieee")
    return tl.dot(b_x, tl.trans(b_w), input_precision=PRECISION)


@triton.jit(do_not_specialize=["N0", "N1", "N2", "NB0", "NB1"])
def _decode_linear_kernel(
    X,  # [M, K], unit stride on K
    NW,  # [K] RMSNorm weight (read when NORM)
    W,  # [N0, K] first weight, contiguous; the others sit at element offsets D1, D2 from it
    R,  # [M, N_total] residual (read when RESIDUAL)
    Y,  # [M, N_total] output
    WS,  # fp32 [SPLIT_K, M, N_total]: split-K partial tiles (SPLIT_K > 1)
    CNT,  # int32 [n_blocks * m_blocks] zeros: split-K arrival counters (reset by the last arrival)
    M, K, N0, N1, N2,
    NB0, NB1,  # column blocks of weights 0 and 1 (program ranges: [0, NB0), [NB0, NB0 + NB1), the rest)
    D1, D2,  # element offsets of weights 1 and 2 from W (weight 1 = up when ACT)
    K_SPLIT,  # K elements per split, a multiple of BLOCK_K
    stride_xm, stride_rm, stride_ym,
    eps,
    NUM_W: tl.constexpr,
    NORM: tl.constexpr,
    ACT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 and the splits tile K exactly: no mask along K
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATS_M: tl.constexpr,  # NORM: rows whose statistics a program computes (the real rows, <= BLOCK_M)
    STATS_K: tl.constexpr,  # NORM: elements of x a statistics step loads per row (few, wide steps)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/_pdl.py)
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    # The matrix this program reads (an element offset from W, so the loads keep W's alignment); with ACT
    # every program reads gate (W) and up (W + D1) for the same columns.
    off = tl.zeros([], dtype=tl.int64)
    N, col0, blk = N0, 0, pid_n
    if NUM_W > 1 and ACT == 0:
        if pid_n >= NB0 + NB1:
            off, N, col0, blk = D2.to(tl.int64), N2, N0 + N1, pid_n - NB0 - NB1
        elif pid_n >= NB0:
            off, N, col0, blk = D1.to(tl.int64), N1, N0, pid_n - NB0
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_k = tl.arange(0, BLOCK_K)
    p_x = X + o_m.to(tl.int64)[:, None] * stride_xm
    dt = X.dtype.element_ty
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    _pdl.wait(PDL)  # x, the residual and every store: after the previous kernel

    if NORM:  # the row statistics over all of K, whatever this program's split
        # Over the STATS_M real rows in steps of STATS_K (one step for a row of <= 4096 at batch 1): each step is
        # a dependent L2 round trip every program pays before its first weight tile, and BLOCK_K-wide steps
        # over 16 padded rows cost the Llama-3-8B q/k/v launch 5 of its 21.5 us (docs/ops/decode_linear.md).
        o_sm = pid_m * BLOCK_M + tl.arange(0, STATS_M)
        o_sk = tl.arange(0, STATS_K)
        p_xs = X + o_sm.to(tl.int64)[:, None] * stride_xm
        b_ss = tl.zeros([STATS_M], dtype=tl.float32)
        for k0 in range(0, K, STATS_K):
            kk = k0 + o_sk
            b_x = tl.load(p_xs + kk[None, :], mask=(o_sm < M)[:, None] & (kk < K)[None, :], other=0.0)
            b_x = b_x.to(tl.float32)
            b_ss += tl.sum(b_x * b_x, axis=1)
        b_rstd_s = tl.rsqrt(b_ss / K + tl.cast(eps, tl.float32))
        # to the tile's BLOCK_M rows (rows past STATS_M are masked padding: 0)
        sel = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, STATS_M)[None, :]
        b_rstd = tl.sum(tl.where(sel, b_rstd_s[None, :], 0.0), axis=1)

    p_w = W + off + o_n.to(tl.int64)[:, None] * K
    p_u = W + D1.to(tl.int64) + o_n.to(tl.int64)[:, None] * K  # ACT: up's rows, at D1
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + o_k
        if EVEN_K:
            m_k = o_k < BLOCK_K
        else:
            m_k = kk < K
        b_x = tl.load(p_x + kk[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        if NORM:  # round the normalized value to the input dtype, then scale by the weight (LlamaRMSNorm)
            b_nw = tl.load(NW + kk, mask=m_k, other=0.0).to(tl.float32)
            b_n = (b_x.to(tl.float32) * b_rstd[:, None]).to(dt).to(tl.float32)
            b_x = (b_n * b_nw[None, :]).to(dt)
        m_w = m_n[:, None] & m_k[None, :]
        acc += _dot(b_x, tl.load(p_w + kk[None, :], mask=m_w, other=0.0), UPCAST, PRECISION)
        if ACT != 0:
            acc_u += _dot(b_x, tl.load(p_u + kk[None, :], mask=m_w, other=0.0), UPCAST, PRECISION)
    _pdl.start(PDL)  # every weight byte read: the next kernel may launch into the SMs this tail frees

    o_col = col0 + o_n
    m_y = m_m[:, None] & m_n[None, :]
    if SPLIT_K > 1:
        # Each split stores its fp32 partial tile in its own workspace slice; the last split to arrive (an
        # arrival counter per tile, acq_rel atomics) sums the slices in split order: the same sum every run.
        n_total = N0 + N1 + N2
        o_ws = o_m.to(tl.int64)[:, None] * n_total + o_col[None, :]
        slice_size = n_total.to(tl.int64) * M  # (M may be the constant 1: no .to on it)
        tl.store(WS + pid_k * slice_size + o_ws, acc, mask=m_y)
        # All of this program's threads' stores happen before the counter's release (barrier, then the
        # gpu-scope acq_rel atomic: the threadfence-reduction pattern).
        tl.debug_barrier()
        p_cnt = CNT + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(p_cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):  # L2 reads (.cg): the other splits' stores, made visible by the counter
                acc += tl.load(WS + s * slice_size + o_ws, mask=m_y, other=0.0, cache_modifier=".cg")
            tl.store(p_cnt, 0)  # every split has arrived: the counter is free for the next call
            _epilogue(acc, acc_u, R, Y, o_m, o_col, m_y, stride_rm, stride_ym, dt, ACT, RESIDUAL)
    else:
        _epilogue(acc, acc_u, R, Y, o_m, o_col, m_y, stride_rm, stride_ym, dt, ACT, RESIDUAL)


@triton.jit
def _epilogue(acc, acc_u, R, Y, o_m, o_col, m_y, stride_rm, stride_ym, dt, ACT: tl.constexpr,
              RESIDUAL: tl.constexpr):
    if ACT != 0:  # act and product on the rounded projections, one rounding after (ops.swiglu / geglu)
        b_g = acc.to(dt).to(tl.float32)
        b_y = _act(b_g, ACT) * acc_u.to(dt).to(tl.float32)
    else:
        b_y = acc
    if RESIDUAL:  # HF: residual + proj(x), with proj(x) rounded first
        p_r = R + o_m.to(tl.int64)[:, None] * stride_rm + o_col[None, :]
        b_y = b_y.to(dt).to(tl.float32) + tl.load(p_r, mask=m_y, other=0.0).to(tl.float32)
    tl.store(Y + o_m.to(tl.int64)[:, None] * stride_ym + o_col[None, :], b_y.to(Y.dtype.element_ty), mask=m_y)


# Hopper's (H100 / H200) most dynamic shared memory one block may opt into: 227 KiB. The picks keep under it
# (or under the device's own opt-in limit where torch reports one).
SMEM_LIMIT = 232448


def _smem_bytes(config: DecodeLinearConfig, esize: int, glu: bool, norm: bool,
                block_m: int = _launch.DECODE_ROWS) -> int:
    """Shared memory the main K loop of a launch with `config` is modeled to ask for, in bytes: `num_stages`
    buffers of each tile loaded per K step (x [block_m, BLOCK_K], the one weight tile [BLOCK_N, BLOCK_K] a
    program reads, gate and up with a GLU, the norm weight [BLOCK_K] with NORM), plus with NORM one more x tile,
    where the normalized x is staged to become a dot operand. Triton 3.6 allocates num_stages - 1 buffers on
    sm_90 (compiled for it: fp32 64x256 with 4 stages asks 245760 = 3 x 80 KiB; with NORM, 16 KiB more at
    BLOCK_K 256); counting num_stages keeps a stage of headroom for pipeliners that allocate one per stage."""
    per_stage = block_m * config.block_k + (2 if glu else 1) * config.block_n * config.block_k
    per_stage += config.block_k if norm else 0
    return (config.num_stages * per_stage + (block_m * config.block_k if norm else 0)) * esize


def _fit_smem(config: DecodeLinearConfig, esize: int, glu: bool, norm: bool,
              limit: int = SMEM_LIMIT) -> DecodeLinearConfig:
    """`config` with fewer stages, then narrower K steps, until `_smem_bytes` fits `limit` (4-byte dtypes: the
    16-bit defaults were measured and fit as they are)."""
    while _smem_bytes(config, esize, glu, norm) > limit and (config.num_stages > 1 or config.block_k > 16):
        if config.num_stages > 1:
            config = dataclasses.replace(config, num_stages=config.num_stages - 1)
        else:
            config = dataclasses.replace(config, block_k=config.block_k // 2)
    return config


def _smem_limit(device) -> int:
    return getattr(torch.cuda.get_device_properties(device.index or 0), "shared_memory_per_block_optin", SMEM_LIMIT)


def _gpu_name(index: int) -> str | None:
    return torch.cuda.get_device_name(index) if torch.cuda.is_available() else None


def _rule_config(K: int, n_total: int, glu: bool, norm: bool, sms: int) -> DecodeLinearConfig:
    """The launch from the shapes where no measured pick applies, before the shared-memory fit."""
    # From the H200 sweeps (benchmarks/results/h200_decode_ops_sweep.json, 1.5B Llama shapes, bf16, batch 1 and 8): 32
    # columns a program except for a plain square projection (o_proj: 16, twice the programs), 256-wide K steps,
    # 4 warps; a long K over few column blocks (down_proj, K = 4 N) splits K in 4 over 64-column blocks.
    block_k = 256 if K >= 256 else max(16, _launch.next_power_of_2(K))
    if not glu and K >= 4 * 2048 and _launch.cdiv(n_total, 64) < 2 * sms:
        return DecodeLinearConfig(64, block_k, 4, 4, 4)
    block_n = 32 if glu or norm or n_total >= 4096 else 16
    return DecodeLinearConfig(block_n, block_k, 4, 3 if glu else 4, 1)


@functools.lru_cache(maxsize=256)
def _pick_config(M: int, K: int, n_total: int, glu: bool, norm: bool, esize: int, device,
                 smem_limit: int | None = None, residual: bool = False) -> DecodeLinearConfig:
    """The launch for these shapes and element size when the caller passes no config (cached: no per-call host
    work): the measured pick for this GPU and 16-bit shape (`decode_linear_picks.lookup`: the user cache, then
    MEASURED_PICKS), else the rule. smem_limit: bytes of shared memory a block may use (None: the device's)."""
    if device.type != "cuda":
        # the interpreter: a few K steps on small test shapes, 64 columns a program (it costs per program: 16
        # columns took 2.4 s of a tiny model's 4-token generate, 64 take 0.9)
        return DecodeLinearConfig(64, 64, 4, 1, 1)
    index = device.index or 0
    pick = None
    if esize == 2:  # measured in bf16; fp16 reads the same bytes
        pick = decode_linear_picks.lookup(_gpu_name(index), K, n_total, M,
                                          decode_linear_picks.kind(norm, glu, residual))
    config = DecodeLinearConfig(*pick) if pick else _rule_config(K, n_total, glu, norm, _launch.sm_count(index))
    # fp32 tiles are twice the bytes: down_proj's 80 KiB stages (Triton 3.6 keeps 3 buffers at 4 stages: 240 KiB,
    # which the H200 refused) and the GLU's fit with 2 stages; the 16-bit picks fit as they are
    return _fit_smem(config, esize, glu, norm, _smem_limit(device) if smem_limit is None else smem_limit)


def _split_of(K: int, block_k: int, split: int) -> tuple[int, int]:
    """(K elements per split, splits) a launch runs for `split` asked: whole BLOCK_K steps per split, so fewer
    splits than asked where the K steps do not divide evenly (4 steps in 3 splits: 2 splits of 2 steps)."""
    k_split = _launch.cdiv(_launch.cdiv(K, split), block_k) * block_k
    return k_split, _launch.cdiv(K, k_split)


def _workspace(device, n_sums: int, n_counters: int, per_call: bool = False):
    """The split-K scratch, pinned buffers of the device's workspace arena (`_rolling_buffer.RollingBuffer.pinned`):
    fp32 partial tiles (overwritten by every call) and int32 arrival counters (zeros between calls: the last
    arrival resets its counter, so no memset launch per call). Pinned, not borrowed: the counters are state kept
    between calls, and a captured decode step replays these addresses (docs/ops/decode_linear.md). At least
    1 MiB of partials and 4096 counters, so the first call's size serves every decode projection of a model.
    per_call: the call's own (the custom op under torch.compile: `_rolling_buffer.split_scratch`)."""
    return (_ws.split_scratch(device, "decode_linear.partials", n_sums, torch.float32, least=1 << 18, zeros=True,
                              per_call=per_call),
            _ws.split_scratch(device, "decode_linear.counters", n_counters, torch.int32, least=1 << 12, zeros=True,
                              per_call=per_call))


def _launch_kernel(x, weights, norm_weight, eps, residual, act, config=None, per_call_scratch=False):
    """config: a DecodeLinearConfig, or None to pick one from the shapes. per_call_scratch: see `_workspace`."""
    M, K = x.shape
    ns = [w.shape[0] for w in weights]
    n_out = ns[0] if act else sum(ns)
    y = torch.empty((M, n_out), dtype=x.dtype, device=x.device)
    if M == 0 or n_out == 0:
        return y
    if config is None:
        config = _pick_config(M, K, n_out, bool(act), norm_weight is not None, x.element_size(), x.device,
                              residual=residual is not None)
    block_n, block_k, split = config.block_n, config.block_k, config.split_k
    ns_all = ns + [0] * (MAX_WEIGHTS - len(ns))
    nb = [_launch.cdiv(n, block_n) for n in ns_all]
    if act:
        split = 1  # two accumulators: twice the columns per program fill the GPU without splitting K
    n_blocks = nb[0] if act else sum(nb)
    block_m = _launch.DECODE_ROWS  # tl.dot's least M: batch 1 to 16 cost the same
    m_blocks = _launch.cdiv(M, block_m)
    k_split, split = _split_of(K, block_k, split)
    if split > 1:
        ws, cnt = _workspace(x.device, split * M * n_out, n_blocks * m_blocks, per_call_scratch)
    else:
        ws, cnt = y, y
    esize = x.element_size()
    # Unused offsets get 16: a value Triton neither specializes to a constant nor misaligns.
    deltas = [(w.data_ptr() - weights[0].data_ptr()) // esize for w in weights[1:]] + [16, 16]
    interp = x.device.type == "cpu"
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    stats_m = min(_launch.next_power_of_2(M), block_m)
    stats_k = min(_launch.next_power_of_2(K), max(block_k, (config.stats_elems or STATS_ELEMS) // stats_m))
    pdl = _pdl.enabled(x.device)
    _decode_linear_kernel[(n_blocks, m_blocks, split)](
        x, norm_weight if norm_weight is not None else x, weights[0],
        residual if residual is not None else y, y, ws, cnt,
        M, K, ns_all[0], ns_all[1], ns_all[2], nb[0], nb[1], deltas[0], deltas[1], k_split,
        x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), float(eps),
        NUM_W=len(weights), NORM=norm_weight is not None, ACT=act, RESIDUAL=residual is not None, SPLIT_K=split,
        EVEN_K=K % block_k == 0 and k_split * split == K, UPCAST=interp, PRECISION=precision, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, STATS_M=stats_m, STATS_K=stats_k, PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, **_pdl.launch_options(pdl),
    )
    return y


@torch.library.custom_op("tigon::decode_linear", mutates_args=())
def decode_linear_op(x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None, eps: float,
                     residual: torch.Tensor | None, activation: int, config: list[int] | None = None) -> torch.Tensor:
    """x [M, K], weights 1-3 x [N_i, K]; returns [M, sum N_i] ([M, N] with an activation). config: None or
    `DecodeLinearConfig.ints()` (the launch from the shapes, or that one)."""
    cfg = DecodeLinearConfig(*config) if config is not None else None
    return _launch_kernel(x, weights, norm_weight, eps, residual, activation, cfg, per_call_scratch=True)


@decode_linear_op.register_fake
def _(x, weights, norm_weight, eps, residual, activation, config=None):
    n = weights[0].shape[0] if activation else sum(w.shape[0] for w in weights)
    return x.new_empty((x.shape[0], n))


def _validate(x, weights, norm_weight, eps, residual, activation, config):
    op = "tigon.ops.decode_linear"
    if config is not None and not isinstance(config, DecodeLinearConfig):
        raise TypeError(f"{op}: config must be a tigon.ops.DecodeLinearConfig or None, got "
                        f"{type(config).__name__}")
    _launch.check_tensor(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have shape [..., K], got a 0-d tensor")
    if isinstance(weights, torch.Tensor):
        weights = (weights,)
    if not isinstance(weights, (list, tuple)) or not 1 <= len(weights) <= MAX_WEIGHTS:
        raise TypeError(f"{op}: weights must be a tensor or a list of 1 to {MAX_WEIGHTS} tensors, got {weights!r}")
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if activation is not None and len(weights) != 2:
        raise ValueError(f"{op}: activation={activation!r} needs exactly two weights (gate, up), got {len(weights)}")
    K = x.shape[-1]
    if K < 1:
        raise ValueError(f"{op}: x must have K >= 1 features (its last dim), got shape {tuple(x.shape)}")
    for name, t in (("norm_weight", norm_weight), ("residual", residual)):
        if t is not None:
            _launch.check_tensor(op, name, t, floating=False)  # its dtype: checked against x below
    for i, w in enumerate(weights):
        _launch.check_tensor(op, f"weights[{i}]", w)
        if w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"{op}: weights[{i}] must have shape [N, K={K}], got {tuple(w.shape)}")
        if not w.is_contiguous():
            raise ValueError(f"{op}: weights[{i}] must be contiguous, got strides {w.stride()}")
    if activation is not None and weights[0].shape != weights[1].shape:
        raise ValueError(f"{op}: gate {tuple(weights[0].shape)} and up {tuple(weights[1].shape)} weights differ")
    _launch.check_same_dtype(op, "x", x, **{f"weights[{i}]": w for i, w in enumerate(weights)},
                             norm_weight=norm_weight, residual=residual)
    _launch.check_same_device(op, "x", x, **{f"weights[{i}]": w for i, w in enumerate(weights)},
                              norm_weight=norm_weight, residual=residual)
    if norm_weight is not None:
        _launch.check_shape(op, "norm_weight", norm_weight, (K,))
    n_out = weights[0].shape[0] if activation is not None else sum(w.shape[0] for w in weights)
    if residual is not None:
        _launch.check_shape(op, "residual", residual, tuple(x.shape[:-1]) + (n_out,))
    eps = _launch.check_eps(op, eps)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, norm_weight, residual, *weights)):
        raise RuntimeError(f"{op}: inference only, no backward; call it under torch.no_grad() or on detached "
                           "tensors")
    return tuple(weights), eps, n_out


def decode_linear(x, weights, *, norm_weight=None, eps=1e-6, residual=None, activation=None, config=None):
    """`x @ W^T` for the few rows of a decode step, with an RMSNorm before and a GLU or residual add after.

    x [..., K]; weights: one `[N, K]` tensor or a list of up to three (outputs concatenated along the last dim,
    e.g. q, k, v); norm_weight [K]: `rms_norm(x, norm_weight, eps)` first; activation "silu" / "gelu_tanh":
    weights must be (gate, up) and the result is `act(x gate^T) * (x up^T)`; residual [..., N]: added last.
    All tensors share x's dtype and device; the weights are contiguous. Returns [..., N] in x's dtype.
    Any number of rows is correct; it is fast for up to 16 (one decode step's batch). config: a
    `DecodeLinearConfig` (the launch; None: the measured defaults for the shapes). Inference only.
    """
    weights, eps, n_out = _validate(x, weights, norm_weight, eps, residual, activation, config)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, n_out)
        if n_out > 1 and r2.stride(-1) != 1:
            r2 = r2.contiguous()
    nw = norm_weight.contiguous() if norm_weight is not None else None
    if not _library.use_kernels("decode_linear", x):
        y = reference.decode_linear(x2, weights, norm_weight=nw, eps=eps, residual=r2, activation=activation)
        return y.reshape(*lead, n_out)
    act = ACTIVATIONS[activation]
    y = _library.dispatch(_traced, None, _launch_kernel, x2, weights, nw, eps, r2, act, config)
    return y.reshape(*lead, n_out)


def _traced(x, weights, norm_weight, eps, residual, act, config):
    """torch.compile: the custom op, the config as plain ints across its boundary."""
    return torch.ops.tigon.decode_linear(x, list(weights), norm_weight, eps, residual, act,
                                         config.ints() if config is not None else None)
