"""The chunked engine under every fused-linear preference, RL and distillation loss.

The losses here are functions of per-token log-softmax statistics of x = scale * (h W^T + b) (scale = 1 / T
times a model's logit scale): log p(t) = x_t - lse, the entropy H = lse - sum p x, and a few metrics. So the
engine walks row chunks of C tokens twice, never holding more than a [C, V] chunk of logits:

  stats pass: logits_c = h_c W^T (+ b) by one cuBLAS GEMM into workspace scratch, then `_stats_kernel`, one
              program per row, folds the row into lse, x_t, H, the row's sum of x, log sum p^2 and is-top-1
              (one read of the chunk; online max per slot of VEC ids, one cross-slot combine per row);
  the loss:   torch on the [N] statistics (tiny): the loss, its metrics, and by autograd the coefficients
              a_i = dL / d log p_i(t), a2_i = dL / d log p_i(t2) (a second target, the NLL of ORPO/CPO), and
              e_i = dL / dH_i;
  grad pass:  logits_c again, `_grad_kernel` turns the chunk in place into
              dL/dz = scale (a (1[t] - p) + a2 (1[t2] - p) - e p (log p + H)), then dh_c = dz_c W and
              dW += dz_c^T h_c, db += sum_rows dz_c.

The gradients exist after the forward (backward scales them by grad_output). Sequence-level losses (DPO's
log-sigmoid of a difference of sums over two sequences) need every token's statistic before any coefficient
is known, hence two passes: 4 GEMMs of 2 N V H FLOPs where a single-pass head has 3 (docs/ops/losses.md).
Token-local losses (token-level GRPO) pass `coef_fn` to `logp_grads`: stats, coefficients and gradient per chunk
in one pass, 3 GEMMs.
No host sync: every count stays a tensor.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from .. import _launch, _library
from .._rolling_buffer import workspace
from ..linear_cross_entropy import _add_dw as add_dw  # dW += dlogits^T h, fp32 C in one cuBLAS call


@dataclasses.dataclass(frozen=True)
class FusedLinearLossConfig:
    """Chunking and row-kernel launch of the fused-linear losses. chunk_rows 0: rows such that a chunk of logits
    is about chunk_bytes (192 MiB is 768 rows of V = 128256 in bf16; against 128 MiB it measured faster for DPO,
    GRPO and JSD on an H200: fewer, larger dW GEMMs, docs/ops/losses.md); block_v: vocabulary tile of the row
    kernels, num_warps: warps of each row program (0 for either: that kernel's own default on CUDA, `ROW_DEFAULTS`;
    under the interpreter the whole padded row). one_pass_bytes: the pairwise preference losses (DPO, ORPO, CPO,
    SimPO) run one pass of 3 policy GEMMs instead of two passes of 4 when the [2 T, V] logits of one chosen +
    rejected pair fit in it (chunks then hold whole pairs, so a pair's coefficients are known before its gradient;
    1 GiB holds a pair of 2 x 2048 tokens at V 128256 in bf16), and KTO when one sequence's do; 0: always two
    passes."""

    chunk_rows: int = 0
    chunk_bytes: int = 192 << 20
    block_v: int = 0
    num_warps: int = 0
    one_pass_bytes: int = 1 << 30

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if f.name == "chunk_bytes" else 0):
                raise ValueError(f"FusedLinearLossConfig: {f.name} must be an int >= "
                                 f"{1 if f.name == 'chunk_bytes' else 0}, got {v!r}")
        for name in ("block_v", "num_warps"):
            v = getattr(self, name)
            if v and v & (v - 1):
                raise ValueError(f"FusedLinearLossConfig: {name} must be a power of two, got {v}")

    def ints(self) -> list[int]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


DEFAULT = FusedLinearLossConfig()


def config_from(ints) -> FusedLinearLossConfig:
    return FusedLinearLossConfig(*[int(i) for i in ints])


def check_config(op, config):
    if config is None:
        return DEFAULT
    if not isinstance(config, FusedLinearLossConfig):
        raise TypeError(f"{op}: config must be a FusedLinearLossConfig or None, got {type(config).__name__}")
    return config


def chunk_rows(N: int, V: int, itemsize: int, cfg: FusedLinearLossConfig) -> int:
    if cfg.chunk_rows:
        return max(1, min(N, cfg.chunk_rows))
    rows = max(1, cfg.chunk_bytes // max(1, V * itemsize))
    if rows >= N:
        return max(1, N)
    step = 64 if rows >= 64 else 1
    rows = rows // step * step
    per_chunk = _launch.cdiv(N, _launch.cdiv(N, rows))  # balanced chunks, rounded up to the GEMM step
    return min(rows, _launch.cdiv(per_chunk, step) * step)


# (BLOCK_V, num_warps) of each row kernel on CUDA when the config leaves them 0. grad: the best of the H200 sweep
# (benchmarks/ops/sweep_loss_kernels.py, [512, 128256] bf16: 74 us, 84% of a D2D copy; 4096 x 4 warps was 98 us).
# stats and jsd were swept before their rewrite to per-slot accumulators (no barrier inside a loop now); their
# values are chosen from ptxas's register counts (sm_90a, bf16), not timed: stats 4096 x 8 is 48 registers, so 5
# programs fit an SM and a 512-row chunk is resident at once, ~32 KB of loads in flight per SM as the grad kernel's
# best has; jsd 8192 x 32 is 47 registers, one program an SM: 32 KB in flight and only ~132 rows (68 MB of
# student + teacher at V 128256) live, so its second and third walks can find part of each row in L2.
ROW_DEFAULTS = {"stats": (4096, 8), "grad": (8192, 32), "jsd": (8192, 32)}


def row_launch(kernel: str, V: int, itemsize: int, device, cfg) -> tuple[int, int, int]:
    """(BLOCK_V, VEC, num_warps) of row kernel `kernel` ("stats", "grad", "jsd") over rows of V logits of
    `itemsize` bytes. VEC: elements of a slot (one 16-byte load), the unit each thread reduces on its own."""
    vec = max(1, 16 // itemsize)
    if device.type == "cuda":
        block, warps = ROW_DEFAULTS[kernel]
        block = cfg.block_v or min(block, max(vec, _launch.next_power_of_2(V)))
        warps = cfg.num_warps or max(1, min(warps, block // (32 * vec)))  # >= one slot per thread
    else:  # interpreter: one numpy step per row is cheaper than a loop
        block = cfg.block_v or max(vec, _launch.next_power_of_2(V))
        warps = cfg.num_warps or 4
    return block, min(vec, block), warps


@triton.jit
def _stats_tile(p_x, o_s, V, sc, tt, b_m, b_s, b_w, b_q, b_sum, b_mb, MASKED: tl.constexpr, VEC: tl.constexpr):
    """Folds the [R, VEC] tile whose slots start at ids o_s [R] into the per-slot accumulators: one thread owns
    a slot's VEC elements, so the axis-1 reductions are in-thread (no shuffles, no shared memory, no barrier)."""
    o = o_s[:, None] + tl.arange(0, VEC)[None, :]
    if MASKED:
        m_ = o < V
        b_x = tl.load(p_x + o, mask=m_, other=0.0).to(tl.float32) * sc
        b_x0 = tl.where(m_, b_x, 0.0)
        b_xm = tl.where(m_, b_x, float("-inf"))
    else:
        b_x = tl.load(p_x + o).to(tl.float32) * sc
        b_x0 = b_x
        b_xm = b_x
    b_mx = tl.max(b_xm, axis=1)
    m_new = tl.maximum(b_m, b_mx)  # b_m starts finite: exp(b_m - m_new) is never exp(-inf + inf)
    alpha = tl.exp(b_m - m_new)
    b_e = tl.exp(b_xm - m_new[:, None])  # 0 at masked ids
    b_s = b_s * alpha + tl.sum(b_e, axis=1)
    b_w = b_w * alpha + tl.sum(b_e * b_x0, axis=1)
    b_q = b_q * (alpha * alpha) + tl.sum(b_e * b_e, axis=1)
    b_sum += tl.sum(b_x0, axis=1)
    b_mb = tl.maximum(b_mb, tl.where(o_s + VEC <= tt, b_mx, float("-inf")))  # slots wholly before the target
    return m_new, b_s, b_w, b_q, b_sum, b_mb


@triton.jit
def _stats_kernel(
    X,  # [C, V] chunk logits (bias included), unit last stride
    T,  # [C] target ids (ignore_index or out of range: no target)
    T2,  # [C] second target ids (read when HAS_T2)
    LSE, XT, XT2, ENT, XSUM, LSQ, TOP1,  # [C] fp32 outputs (TOP1: 1.0 when the target is the first argmax)
    stride_x,
    V,
    scale,  # x = scale * logits (1 / temperature times a logit scale): runtime float, no recompile
    HAS_T2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    VEC: tl.constexpr = 8,  # elements of a slot (16 bytes of bf16); BLOCK_V // VEC slots a tile
):
    # Each slot keeps its own online max m and the sums s = sum exp(x - m), w = sum exp(x - m) x,
    # q = sum exp(2 (x - m)), sum x and the max over ids before t, across the row's tiles; one cross-slot combine
    # after the loop. Full tiles load unmasked, the ragged tail once with a mask.
    row = tl.program_id(0).to(tl.int64)
    p_x = X + row * stride_x
    t = tl.load(T + row).to(tl.int64)
    has_t = (t >= 0) & (t < V)
    tt = tl.where(has_t, t, 0)
    sc = tl.cast(scale, tl.float32)
    R: tl.constexpr = BLOCK_V // VEC
    o_r = tl.arange(0, R) * VEC
    b_m = tl.full([R], -1e30, tl.float32)
    b_s = tl.zeros([R], dtype=tl.float32)
    b_w = tl.zeros([R], dtype=tl.float32)
    b_q = tl.zeros([R], dtype=tl.float32)
    b_sum = tl.zeros([R], dtype=tl.float32)
    b_mb = tl.full([R], float("-inf"), tl.float32)
    n_full = V // BLOCK_V
    for i in range(0, n_full):
        b_m, b_s, b_w, b_q, b_sum, b_mb = _stats_tile(p_x, i * BLOCK_V + o_r, V, sc, tt, b_m, b_s, b_w, b_q, b_sum,
                                                      b_mb, MASKED=False, VEC=VEC)
    if n_full * BLOCK_V < V:
        b_m, b_s, b_w, b_q, b_sum, b_mb = _stats_tile(p_x, n_full * BLOCK_V + o_r, V, sc, tt, b_m, b_s, b_w, b_q,
                                                      b_sum, b_mb, MASKED=True, VEC=VEC)
    mx = tl.max(b_m, axis=0)
    c = tl.exp(b_m - mx)  # 0 for a slot that saw no id (m -1e30)
    s = tl.sum(b_s * c, axis=0)
    w = tl.sum(b_w * c, axis=0)
    q = tl.sum(b_q * (c * c), axis=0)
    # the slot holding t: its ids before t, which the in-loop slot test left out
    o_c = tt - tt % VEC + tl.arange(0, VEC)
    b_xb = tl.load(p_x + o_c, mask=o_c < tt, other=0.0).to(tl.float32) * sc
    mb = tl.maximum(tl.max(b_mb, axis=0), tl.max(tl.where(o_c < tt, b_xb, float("-inf")), axis=0))
    lse = mx + tl.log(s)
    xt = tl.load(p_x + tt).to(tl.float32) * sc
    xt = tl.where(has_t, xt, 0.0)
    tl.store(LSE + row, lse)
    tl.store(XT + row, xt)
    tl.store(ENT + row, lse - w / s)
    tl.store(XSUM + row, tl.sum(b_sum, axis=0))
    tl.store(LSQ + row, tl.log(q) - 2.0 * tl.log(s))
    tl.store(TOP1 + row, tl.where(has_t & (xt >= mx) & (xt > mb), 1.0, 0.0))
    if HAS_T2:
        t2 = tl.load(T2 + row).to(tl.int64)
        has_t2 = (t2 >= 0) & (t2 < V)
        xt2 = tl.load(p_x + tl.where(has_t2, t2, 0)).to(tl.float32) * sc
        tl.store(XT2 + row, tl.where(has_t2, xt2, 0.0))


@triton.jit
def _grad_kernel(
    X,  # [C, V] chunk logits; overwritten in place by dL/dlogits (X's dtype, one cast on store)
    T, T2,  # [C] target ids (T2 read when HAS_T2)
    LSE, ENT,  # [C] fp32 statistics from the stats pass
    A, A2, E,  # [C] fp32 coefficients dL/dlogp(t), dL/dlogp(t2), dL/dH (A2 read when HAS_T2, E when HAS_E)
    stride_x,
    V,
    scale,
    HAS_T2: tl.constexpr,
    HAS_E: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_x = X + row * stride_x
    t = tl.load(T + row).to(tl.int64)
    sc = tl.cast(scale, tl.float32)
    lse = tl.load(LSE + row)
    a = tl.load(A + row)
    a_sum = a
    t2 = t
    a2 = tl.zeros([], dtype=tl.float32)
    if HAS_T2:
        t2 = tl.load(T2 + row).to(tl.int64)
        a2 = tl.load(A2 + row)
        a_sum += a2
    e = tl.zeros([], dtype=tl.float32)
    ent = tl.zeros([], dtype=tl.float32)
    if HAS_E:
        e = tl.load(E + row)
        ent = tl.load(ENT + row)
    o_v = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        o = v0 + o_v
        m_ = o < V
        b_x = tl.load(p_x + o, mask=m_, other=0.0).to(tl.float32) * sc
        b_lp = b_x - lse
        b_p = tl.exp(b_lp)
        b_g = tl.where(o == t, a, 0.0) + tl.where(o == t2, a2, 0.0) - a_sum * b_p
        if HAS_E:
            b_g -= e * b_p * (b_lp + ent)
        tl.store(p_x + o, (b_g * sc).to(X.dtype.element_ty), mask=m_)


def kernels_on(device) -> bool:
    """Whether the row kernels run for tensors on `device` (CUDA, or CPU under TRITON_INTERPRET=1). Elsewhere
    (CPU without the interpreter: a custom op called directly, or opcheck) the same per-row math runs in torch,
    in fp32, so the op bodies never hand a CPU pointer to a compiled Triton launcher."""
    return _library.backend_for(device) == "triton"


def _stats_rows_torch(logits, t, t2, outs, V, scale):
    """_stats_kernel's results in torch (fp32): outs is (lse, xt, xt2, ent, xsum, lsq, top1), written in place."""
    lse_o, xt_o, xt2_o, ent_o, xsum_o, lsq_o, top1_o = outs
    x = logits.float() * scale
    lse = torch.logsumexp(x, -1)
    has = (t >= 0) & (t < V)
    ti = torch.where(has, t, 0).long()
    xt = torch.where(has, x.gather(1, ti[:, None])[:, 0], 0.0)
    lse_o.copy_(lse)
    xt_o.copy_(xt)
    ent_o.copy_(lse - (torch.softmax(x, -1) * x).sum(-1))
    xsum_o.copy_(x.sum(-1))
    lsq_o.copy_(torch.logsumexp(2.0 * x, -1) - 2.0 * lse)
    top1_o.copy_((has & (x.argmax(-1) == ti)).float())  # argmax: the first maximum, the kernel's tie rule
    if t2 is not None:
        has2 = (t2 >= 0) & (t2 < V)
        xt2 = x.gather(1, torch.where(has2, t2, 0).long()[:, None])[:, 0]
        xt2_o.copy_(torch.where(has2, xt2, 0.0))


def _grad_rows_torch(logits, t, t2, lse, ent, a, a2, e, V, scale):
    """_grad_kernel in torch (fp32): overwrites the chunk logits with dL/dlogits."""
    lp = logits.float() * scale - lse[:, None]
    p = torch.exp(lp)
    cols = torch.arange(V, device=logits.device)
    g = torch.where(cols == t[:, None], a[:, None], 0.0) - (a if a2 is None else a + a2)[:, None] * p
    if a2 is not None:
        g += torch.where(cols == t2[:, None], a2[:, None], 0.0)
    if e is not None:
        g -= e[:, None] * p * (lp + ent[:, None])
    logits.copy_(g * scale)


def _gemm_logits(h_c, w_t, bias, out):
    if bias is None:
        torch.mm(h_c, w_t, out=out)
    else:
        torch.addmm(bias, h_c, w_t, out=out)


def _lowp(weight, bias, dtype):
    """Autocast-style: the GEMMs run in hidden's dtype (a transient copy of an fp32 master weight)."""
    w = weight if weight.dtype == dtype else weight.to(dtype)
    b = bias if bias is None or bias.dtype == dtype else bias.to(dtype)
    return w, b


def logp_stats(hidden, weight, bias, target, target2=None, *, scale=1.0, cfg=DEFAULT):
    """Per-row statistics of x = scale * (hidden @ weight.T + bias) for hidden [N, H], weight [V, H]:
    a dict of [N] fp32 tensors lse, xt (x at target, 0 without one), xt2, ent, xsum, lsq, top1."""
    N, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    target = target.contiguous()  # the row kernels read ids at unit stride
    target2 = None if target2 is None else target2.contiguous()
    names = ("lse", "xt", "xt2", "ent", "xsum", "lsq", "top1")
    out = {k: torch.empty(N, dtype=torch.float32, device=dev) for k in names}
    if target2 is None:
        out["xt2"] = out["xt"]
    w, b = _lowp(weight, bias, hidden.dtype)
    w_t = w.t()
    rows = chunk_rows(N, V, hidden.element_size(), cfg)
    block, vec, warps = row_launch("stats", V, hidden.element_size(), dev, cfg)
    kernels = kernels_on(dev)
    with workspace(dev).borrow(((rows, V), hidden.dtype)) as (buf,):
        for s in range(0, N, rows):
            e = min(N, s + rows)
            logits = buf[: e - s]
            _gemm_logits(hidden[s:e], w_t, b, logits)
            if not kernels:
                _stats_rows_torch(logits, target[s:e], None if target2 is None else target2[s:e],
                                  tuple(out[k][s:e] for k in names), V, float(scale))
                continue
            _stats_kernel[(e - s,)](
                logits, target[s:e], target[s:e] if target2 is None else target2[s:e],
                *(out[k][s:e] for k in names), logits.stride(0), V, float(scale),
                HAS_T2=target2 is not None, BLOCK_V=block, VEC=vec, num_warps=warps,
            )
    return out


def logp_grads(hidden, weight, bias, target, lse, ent, a, a2=None, e=None, target2=None, *, scale=1.0,
               need_dh=True, need_dw=True, need_db=False, cfg=DEFAULT, coef_fn=None, want_e=False):
    """The grad pass: gradients (dh [N, H] hidden.dtype, dW [V, H] weight.dtype, db [V]) of
    sum_i a_i log p_i(t_i) + a2_i log p_i(t2_i) + e_i H_i, each None when not asked. dW accumulates in fp32
    when the weight is an fp32 master copy of lower-precision hidden states, else in the weight's dtype
    (cuBLAS addmm, like linear_cross_entropy).

    One pass (coef_fn given; lse, ent, a, e None): for losses whose coefficients for a chunk's tokens depend only on
    that chunk's statistics, each chunk runs the stats kernel, then coef_fn(start, end, chunk stats dict) -> (a, e
    or None[, a2]) for its rows, then the grad kernel on the same chunk: 3 GEMMs instead of 4. want_e: coef_fn
    returns e; a2 (the coefficient of target2's log-prob) when target2 is given."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    target = target.contiguous()  # the row kernels read ids and per-row values at unit stride
    target2 = None if target2 is None else target2.contiguous()
    lse, ent, a, a2, e = (None if x is None else x.contiguous() for x in (lse, ent, a, a2, e))
    w, b = _lowp(weight, bias, hidden.dtype)
    w_t = w.t()
    dh = torch.empty((N, H), dtype=hidden.dtype, device=dev) if need_dh else None
    dw = torch.zeros((V, H), dtype=torch.float32 if weight.dtype != hidden.dtype else weight.dtype,
                     device=dev) if need_dw else None
    db = torch.zeros(V, dtype=torch.float32, device=dev) if need_db else None
    rows = chunk_rows(N, V, hidden.element_size(), cfg)
    s_block, s_vec, s_warps = row_launch("stats", V, hidden.element_size(), dev, cfg)
    g_block, _, g_warps = row_launch("grad", V, hidden.element_size(), dev, cfg)
    names = ("lse", "xt", "xt2", "ent", "xsum", "lsq", "top1")
    st = {k: torch.empty(N, dtype=torch.float32, device=dev) for k in names} if coef_fn is not None else None
    kernels = kernels_on(dev)
    with workspace(dev).borrow(((rows, V), hidden.dtype)) as (buf,):
        for s in range(0, N, rows):
            end = min(N, s + rows)
            logits, h_c = buf[: end - s], hidden[s:end]
            _gemm_logits(h_c, w_t, b, logits)
            if coef_fn is not None:
                chunk = {k: v[s:end] for k, v in st.items()}
                t2_s = None if target2 is None else target2[s:end]
                if kernels:
                    _stats_kernel[(end - s,)](logits, target[s:end], target[s:end] if t2_s is None else t2_s,
                                              *(chunk[k] for k in names), logits.stride(0), V, float(scale),
                                              HAS_T2=t2_s is not None, BLOCK_V=s_block, VEC=s_vec, num_warps=s_warps)
                else:
                    _stats_rows_torch(logits, target[s:end], t2_s, tuple(chunk[k] for k in names), V, float(scale))
                got = coef_fn(s, end, chunk)
                a_c, e_c = got[0], got[1] if want_e else None
                a2_c = got[2] if target2 is not None else None
                lse_c, ent_c = chunk["lse"], chunk["ent"]
            else:
                lse_c, ent_c, a_c = lse[s:end], ent[s:end], a[s:end]
                a2_c = None if a2 is None else a2[s:end]
                e_c = None if e is None else e[s:end]
            if kernels:
                _grad_kernel[(end - s,)](
                    logits, target[s:end], target[s:end] if target2 is None else target2[s:end], lse_c, ent_c, a_c,
                    a_c if a2_c is None else a2_c, a_c if e_c is None else e_c, logits.stride(0), V, float(scale),
                    HAS_T2=a2_c is not None, HAS_E=e_c is not None, BLOCK_V=g_block, num_warps=g_warps,
                )
            else:
                t2_c = (target if target2 is None else target2)[s:end]
                _grad_rows_torch(logits, target[s:end], t2_c, lse_c, ent_c, a_c, a2_c, e_c, V, float(scale))
            if need_dh:
                torch.mm(logits, w, out=dh[s:end])
            if need_dw:
                add_dw(dw, logits.t(), h_c, first=False)
            if need_db:
                db += logits.sum(0, dtype=torch.float32)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None:
        db = db.to(bias.dtype)
    return dh, dw, db


class autograd_inside:
    """Autograd inside a custom op's body. torch.library runs the body below the Autograd dispatch key (its TLS
    exclude set holds it), so ops there record no graph even under enable_grad. The losses differentiate their
    small [N] per-token math there (a few KB, not the logits); this lifts the exclusion for that block only."""

    def __enter__(self):
        K = torch._C.DispatchKey
        excl = torch._C._dispatch_tls_local_exclude_set()
        for k in (K.AutogradOther, K.AutogradCPU, K.AutogradCUDA):
            excl = excl.remove(k)
        self._guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excl)
        self._grad = torch.enable_grad()
        self._guard.__enter__()
        self._grad.__enter__()
        return self

    def __exit__(self, *exc):
        self._grad.__exit__(*exc)
        self._guard.__exit__(*exc)


def coefficients(loss, stats):
    """d loss / d each of `stats` (fp32 tensors that require grad), zeros where unused; no graph kept. Call
    inside `autograd_inside()`."""
    got = torch.autograd.grad(loss, stats, allow_unused=True)
    return [torch.zeros_like(s) if g is None else g.detach().float().contiguous() for s, g in zip(stats, got)]


def empty(t):
    return t.new_empty(0)


def grads_out(hidden, weight, dh, dw, db):
    """(dh, dW, db) as custom-op outputs: an empty tensor for each one not computed."""
    return (empty(hidden) if dh is None else dh, empty(weight) if dw is None else dw,
            empty(weight) if db is None else db)
