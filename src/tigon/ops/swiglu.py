"""SwiGLU and GeGLU: y = act(gate) * up, Triton forward and one-pass backward over 2-D tiles.

act is silu (Llama, Mistral, Qwen, Phi3) or the tanh approximation of gelu (Gemma), math in fp32 with one
cast on store. gate and up may be row-strided views, such as the two halves of a fused gate_up projection
(Phi3), and are read in place. The backward recomputes act(gate) from the saved gate and up (nothing else
is kept) and writes dgate and dup in one pass; with `inplace_backward=True` it writes them over gate and
up, which then hold the gradients. The math and the byte model are in docs/ops/swiglu.md.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _launch, _library, reference
from .config import GLUConfig

_SILU, _GELU_TANH = 0, 1


@triton.jit
def _sigmoid_pair(x):
    """(sigmoid(x), sigmoid(-x)) = (s, 1 - s), both to full relative precision: exp(-|x|) never overflows,
    and 1 - s is not a difference (at x = 6, 1 - s = 2.5e-3 would lose 9 of its 24 bits)."""
    b_e = tl.exp(-tl.abs(x))
    b_r = 1.0 / (1.0 + b_e)
    b_q = b_e * b_r
    return tl.where(x >= 0, b_r, b_q), tl.where(x >= 0, b_q, b_r)


@triton.jit
def _gelu_z2(b_g):
    # gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3): exact, and no
    # tanh (no libdevice). g is clamped to [-20, 20] inside z only: there sigmoid(2z) is already exactly 0 or
    # 1 in fp32 (|2z| > 600), while g^2 would reach inf at |g| > 1.8e19 and turn 0 * inf into NaN in the
    # gradient. NaN fails both compares and goes through.
    b_c = tl.where(b_g > 20.0, 20.0, tl.where(b_g < -20.0, -20.0, b_g))
    b_c2 = b_c * b_c
    return b_c, b_c2, 1.5957691216057308 * (b_c + 0.044715 * b_c2 * b_c)


@triton.jit
def _act_fwd(b_g, ACT: tl.constexpr):
    """act(g) in fp32."""
    if ACT == 0:
        b_s, _ = _sigmoid_pair(b_g)
    else:
        _, _, b_z2 = _gelu_z2(b_g)
        b_s, _ = _sigmoid_pair(b_z2)
    return b_g * b_s


@triton.jit
def _act_bwd(b_g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32."""
    if ACT == 0:
        b_s, b_t = _sigmoid_pair(b_g)  # silu'(g) = s (1 + g (1 - s))
        return b_g * b_s, b_s * (1.0 + b_g * b_t)
    # With s = sigmoid(2z): 1 + tanh(z) = 2s and 1 - tanh(z)^2 = 4s(1 - s), so
    # gelu_tanh'(g) = s * (1 + 2 sqrt(2/pi) g (1 - s) (1 + 3 * 0.044715 g^2)).
    b_c, b_c2, b_z2 = _gelu_z2(b_g)
    b_s, b_t = _sigmoid_pair(b_z2)
    return b_g * b_s, b_s * (1.0 + 1.5957691216057308 * b_c * b_t * (1.0 + 0.134145 * b_c2))


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] tile: one tile per program on a 1-D grid (no 65535 limit on the row
    tiles), column tiles fastest so neighbouring programs stream neighbouring bytes; int64 offsets."""
    pid = tl.program_id(0).to(tl.int64)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    o_m = (pid // n_tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = (pid % n_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return o_m, o_n, (o_m < M)[:, None] & (o_n < N)[None, :]


@triton.jit
def _glu_fwd_kernel(
    G,  # [M, N] gate rows
    U,  # [M, N] up rows
    Y,  # [M, N] act(gate) * up
    stride_g,  # row strides in elements (unused when the launcher flattens to one row)
    stride_u,
    stride_y,
    M,  # rows (1 when every tensor is contiguous: the pass is then one flat row of M * I)
    N,  # columns
    ACT: tl.constexpr,  # 0 silu, 1 gelu_tanh
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    o_m, o_n, m_mn = _tile(M, N, BLOCK_M, BLOCK_N)
    # Read once: evict_first keeps the 50 MB L2 for the stores the next kernel reads.
    b_g = tl.load(G + o_m[:, None] * stride_g + o_n[None, :], mask=m_mn, other=0.0,
                  eviction_policy="evict_first").to(tl.float32)
    b_u = tl.load(U + o_m[:, None] * stride_u + o_n[None, :], mask=m_mn, other=0.0,
                  eviction_policy="evict_first").to(tl.float32)
    b_y = _act_fwd(b_g, ACT) * b_u
    tl.store(Y + o_m[:, None] * stride_y + o_n[None, :], b_y.to(Y.dtype.element_ty), mask=m_mn)


@triton.jit
def _glu_bwd_kernel(
    DY,  # [M, N] gradient of y
    G,  # [M, N] saved gate
    U,  # [M, N] saved up
    DG,  # [M, N] dgate = dy * up * act'(gate); may be G itself (in-place backward)
    DU,  # [M, N] dup = dy * act(gate); may be U itself
    Y,  # [M, N] y = act(gate) * up when STORE_Y (the fused MLP's recompute); may be DY itself
    stride_dy,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    stride_y,
    M,
    N,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_Y: tl.constexpr = False,
):
    # Each element is loaded and stored by the same thread, so DG == G, DU == U and Y == DY are race-free.
    o_m, o_n, m_mn = _tile(M, N, BLOCK_M, BLOCK_N)
    b_dy = tl.load(DY + o_m[:, None] * stride_dy + o_n[None, :], mask=m_mn, other=0.0,
                   eviction_policy="evict_first").to(tl.float32)
    b_g = tl.load(G + o_m[:, None] * stride_g + o_n[None, :], mask=m_mn, other=0.0,
                  eviction_policy="evict_first").to(tl.float32)
    b_u = tl.load(U + o_m[:, None] * stride_u + o_n[None, :], mask=m_mn, other=0.0,
                  eviction_policy="evict_first").to(tl.float32)
    b_a, b_da = _act_bwd(b_g, ACT)
    tl.store(DG + o_m[:, None] * stride_dg + o_n[None, :], (b_dy * b_u * b_da).to(DG.dtype.element_ty), mask=m_mn)
    tl.store(DU + o_m[:, None] * stride_du + o_n[None, :], (b_dy * b_a).to(DU.dtype.element_ty), mask=m_mn)
    if STORE_Y:
        tl.store(Y + o_m[:, None] * stride_y + o_n[None, :], (b_a * b_u).to(Y.dtype.element_ty), mask=m_mn)


# Bytes of each tensor per program on a GPU: 4 KiB (2048 bf16, 16 per thread at 4 warps, two 16-byte vectors),
# ~29k programs at [16384, 14336]; the H200 sweep is in GLUConfig. The interpreter pays ~1 ms per program, so on
# CPU one big tile covers a test case. (tile_bytes, cpu_tile, num_warps) = GLUConfig.ints(), the form a custom
# op takes; None: these defaults.
_DEFAULT = tuple(GLUConfig().ints())


def _tiles(device: torch.device, elem_bytes: int, rows: int, cols: int, config=None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for an elementwise pass over [rows, cols]; config: GLUConfig.ints()."""
    tile_bytes, cpu_tile, num_warps = config or _DEFAULT
    if device.type != "cuda":
        block_n = min(_launch.next_power_of_2(max(cols, 1)), cpu_tile)
        return min(_launch.next_power_of_2(max(rows, 1)), max(1, cpu_tile // block_n)), block_n, 1
    tile = tile_bytes // elem_bytes
    # Rows: the widest power of two up to the tile whose last column tile wastes <= 1/16 of the row
    # (14336 -> 2048, 11008 -> 1024), so few lanes idle on masked columns; 128 bf16 = 256 bytes per row
    # piece still fills whole 32-byte sectors. One row (a contiguous pass is one flat row of M * I) wastes at most
    # one tile, and its width must not follow M: a prefill's M is the prompt length, and a BLOCK_N that changed
    # with it (45 x 96 -> 256, 48 x 96 -> 512) compiled the kernel again at a new prompt length.
    block_n = min(_launch.next_power_of_2(max(cols, 1)), tile)
    while rows > 1 and block_n > 128 and _launch.cdiv(cols, block_n) * block_n * 16 > cols * 17:
        block_n //= 2
    block_m = min(_launch.next_power_of_2(max(rows, 1)), max(1, tile // block_n))
    return block_m, block_n, num_warps


def _pass_geometry(ts, M, N):
    """(rows, cols, row strides) of the pass: one flat row when every tensor is contiguous [M, N]."""
    if all(t.is_contiguous() for t in ts):
        return 1, M * N, [0] * len(ts)
    return M, N, [t.stride(0) for t in ts]


def _halves(gate, up):
    """The [M, I] gate and up row views of the op's arguments: two tensors, or one [M, 2I] gate_up."""
    if up is not None:
        return gate, up
    half = gate.shape[1] // 2
    return gate[:, :half], gate[:, half:]


def _launch_fwd(g, u, y, act, config=None):
    M, N = g.shape
    if M * N == 0:
        return
    rows, cols, strides = _pass_geometry((g, u, y), M, N)
    block_m, block_n, warps = _tiles(g.device, g.element_size(), rows, cols, config)
    grid = (_launch.cdiv(rows, block_m) * _launch.cdiv(cols, block_n),)
    _glu_fwd_kernel[grid](g, u, y, *strides, rows, cols, ACT=act, BLOCK_M=block_m, BLOCK_N=block_n,
                          num_warps=warps)


def _launch_bwd(dy, g, u, dg, du, act, y=None, config=None):
    """dg, du <- the gradients; y (when given) <- act(g) * u in the same pass."""
    M, N = g.shape
    if M * N == 0:
        return
    rows, cols, strides = _pass_geometry((dy, g, u, dg, du, dy if y is None else y), M, N)
    block_m, block_n, warps = _tiles(g.device, g.element_size(), rows, cols, config)
    grid = (_launch.cdiv(rows, block_m) * _launch.cdiv(cols, block_n),)
    _glu_bwd_kernel[grid](dy, g, u, dg, du, dy if y is None else y, *strides, rows, cols, ACT=act, BLOCK_M=block_m,
                          BLOCK_N=block_n, STORE_Y=y is not None, num_warps=warps)


def glu_fwd_launch(gate: torch.Tensor, up: Optional[torch.Tensor], act: int, inplace_backward: bool = False,
                   config: Optional[list[int]] = None) -> torch.Tensor:
    """gate, up [M, I] with unit last stride, or up None and gate [M, 2I] = [gate | up]. Returns y [M, I].
    config: None or `GLUConfig.ints()` (the forward's and the backward's launches)."""
    g, u = _halves(gate, up)
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    _launch_fwd(g, u, y, act, config)
    return y


def _fwd_fake(gate, up, act, inplace_backward=False, config=None):
    return gate.new_empty(_halves(gate, up)[0].shape)


def _bwd_launch(
    dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], act: int, config: Optional[list[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dgate, dup), or (d gate_up [M, 2I], empty) when up is None."""
    return _bwd_out_of_place(dy, gate, up, act, config=config)


def _new_grads(gate, up):
    """Fresh (dgate, dup) in gate's and up's shapes; dup empty when up is None (dgate is then d gate_up)."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    return dgate, (torch.empty(up.shape, dtype=up.dtype, device=up.device) if up is not None else gate.new_empty(0))


def _bwd_out_of_place(dy, gate, up, act, y=None, config=None):
    """The backward pass into new (dgate, dup), and act(gate) * up into y when given."""
    dgate, dup = _new_grads(gate, up)
    g, u = _halves(gate, up)
    dg, du = _halves(dgate, dup if up is not None else None)
    _launch_bwd(_launch.unit_last(dy), g, u, dg, du, act, y=y, config=config)
    return dgate, dup


def _bwd_fake(dy, gate, up, act, config=None):
    return _new_grads(gate, up)


def _bwd_inplace_launch(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], act: int,
                        config: Optional[list[int]] = None) -> None:
    """Overwrites gate with dgate and up with dup (no new memory); gate and up must not overlap."""
    g, u = _halves(gate, up)
    _launch_bwd(_launch.unit_last(dy), g, u, g, u, act, config=config)


def _returns_none(*args):
    return None


def _bwd_recompute_launch(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor], act: int) -> None:
    """One pass for the fused MLP's backward: gate <- dgate, up <- dup, and dy <- y = act(gate) * up (the
    activation the forward did not keep, for the down projection's weight gradient). dy has unit last stride."""
    g, u = _halves(gate, up)
    _launch_bwd(dy, g, u, g, u, act, y=dy)


def _bwd_and_y_launch(dy: torch.Tensor, gate: torch.Tensor, up: Optional[torch.Tensor],
                      act: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """glu_bwd_recompute without mutation, for a traced graph: returns (y, dgate, dup) as new tensors (dup empty
    when up is None and dgate is d gate_up). One op, not glu_fwd then glu_bwd: a compiler would merge that
    glu_fwd with the forward's (common subexpressions) and, not recomputing custom ops, keep y from the
    forward, the [tokens, I] activation the fused MLP exists to drop."""
    y = torch.empty(_halves(gate, up)[0].shape, dtype=gate.dtype, device=gate.device)
    return (y, *_bwd_out_of_place(dy, gate, up, act, y=y))


def _bwd_and_y_fake(dy, gate, up, act):
    return (gate.new_empty(_halves(gate, up)[0].shape), *_new_grads(gate, up))


GLU_BWD = _library.Kernel("glu_bwd", _bwd_launch, _bwd_fake)
# In place: an eager call bumps the versions of what it overwrites, as the custom op does (see swiglu's docstring).
GLU_BWD_INPLACE = _library.Kernel("glu_bwd_inplace", _bwd_inplace_launch, _returns_none, mutates_args=("gate", "up"))
GLU_BWD_RECOMPUTE = _library.Kernel("glu_bwd_recompute", _bwd_recompute_launch, _returns_none,
                                    mutates_args=("dy", "gate", "up"))
GLU_BWD_AND_Y = _library.Kernel("glu_bwd_and_y", _bwd_and_y_launch, _bwd_and_y_fake)


def _rows_disjoint(t):
    return t.shape[0] <= 1 or t.stride(0) >= t.shape[1]


def _apart(a, b):
    """True when the [M, I] row views a and b share no element (checked from their layout, no data)."""
    if a.numel() == 0 or not torch._C._is_alias_of(a, b):  # no data pointers: works on fake tensors
        return True
    M, I = a.shape
    oa, ob = a.storage_offset(), b.storage_offset()
    ea, eb = oa + (M - 1) * a.stride(0) + I, ob + (M - 1) * b.stride(0) + I
    if ea <= ob or eb <= oa:  # one span ends before the other starts
        return True
    s = a.stride(0)
    # Interleaved rows of one stride (the chunked halves of gate_up: s = 2I, offset I apart).
    return M > 1 and b.stride(0) == s and I <= (ob - oa) % s <= s - I


def _may_overwrite(gate, up):
    """inplace_backward is honoured only where writing the gradients over gate and up is invisible: both are
    results of autograd (not leaves, nor views of one), with rows that do not overlap themselves or each
    other. Anything else gets the out-of-place backward, which is always right."""
    if _launch.is_leafish(gate) or (up is not None and _launch.is_leafish(up)):
        return False
    g, u = _halves(gate, up)
    return _rows_disjoint(g) and _rows_disjoint(u) and (up is None or _apart(g, u))


def _setup(ctx, inputs, output):
    gate, up, act, inplace_backward = inputs[:4]
    ctx.config, ctx.n_inputs = (inputs[4] if len(inputs) > 4 else None), len(inputs)
    ctx.save_for_backward(gate, up)
    ctx.act, ctx.packed = act, up is None
    ctx.inplace = inplace_backward and _may_overwrite(gate, up)


_REFERENCE = {_SILU: reference.swiglu, _GELU_TANH: reference.geglu}


def _backward(ctx, dy):
    rest = (None,) * (ctx.n_inputs - 2)
    gate, up = ctx.saved_tensors
    if _library.double_backward():
        # create_graph=True: the reference's differentiable ops on the saved gate and up, for double backward
        # (never in place: the graph of the gradients reads gate and up)
        ref = _REFERENCE[ctx.act]
        if ctx.packed:
            (dgate,) = _library.reference_grads(lambda gu: ref(*gu.chunk(2, dim=-1)), (gate,),
                                                  ctx.needs_input_grad[:1], (dy,))
            return (dgate, None) + rest
        dgate, dup = _library.reference_grads(ref, (gate, up), ctx.needs_input_grad[:2], (dy,))
        return (dgate, dup) + rest
    if ctx.inplace:
        # Saved tensors are unpacked (version-checked) above; the write bumps their version, so any other
        # user that saved gate or up and runs its backward later fails loudly instead of reading gradients.
        GLU_BWD_INPLACE.on(ctx)(dy, gate, up, ctx.act, ctx.config)
        return (gate.detach(), (None if ctx.packed else up.detach())) + rest
    dgate, dup = GLU_BWD.on(ctx)(dy, gate, up, ctx.act, ctx.config)
    return (dgate, (None if ctx.packed else dup)) + rest


GLU = _library.Op("glu_fwd", glu_fwd_launch, _fwd_fake, _setup, _backward)


def _validate(op, gate, up, inplace_backward):
    _launch.check_tensor(op, "gate", gate)
    _launch.check_tensor(op, "up", up)
    _launch.check_shape(op, "up", up, gate.shape)
    _launch.check_same_dtype(op, "gate", gate, up=up)
    _launch.check_same_device(op, "gate", gate, up=up)
    _launch.check_bool(op, "inplace_backward", inplace_backward)


def _config_ints(op, config):
    if config is None:
        return None
    if not isinstance(config, GLUConfig):
        raise TypeError(f"{op}: config must be a tigon.ops.GLUConfig or None, got {type(config).__name__}")
    return config.ints()


def _as_rows(t):
    # elementwise: a 0-d tensor is one row of one element
    return t.reshape(1, 1) if t.dim() == 0 else _launch.as_rows(t)


def _glu(op, act, ref_fn, gate, up, inplace_backward, config):
    _validate(f"tigon.ops.{op}", gate, up, inplace_backward)
    cfg = _config_ints(f"tigon.ops.{op}", config)
    if not _library.use_kernels(op, gate):
        return ref_fn(gate, up)
    y = GLU(_as_rows(gate), _as_rows(up), act, inplace_backward, cfg, grad_from=(gate, up))
    return y.view(gate.shape)


def _glu_packed(op, act, ref_fn, gate_up, inplace_backward, config):
    name = f"tigon.ops.{op}"
    _launch.check_tensor(name, "gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"{name}: gate_up must be [..., 2 * I], got shape {tuple(gate_up.shape)}")
    _launch.check_bool(name, "inplace_backward", inplace_backward)
    cfg = _config_ints(name, config)
    if not _library.use_kernels(op, gate_up):
        return ref_fn(*gate_up.chunk(2, dim=-1))
    y = GLU(_as_rows(gate_up), None, act, inplace_backward, cfg, grad_from=(gate_up,))
    return y.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


_ACT_CODES = {"silu": _SILU, "gelu_tanh": _GELU_TANH}


def glu_rows(gate, up, activation):
    """act(gate) * up for a caller that built its inputs itself, without argument checks (`rms_norm_rows`
    says why): gate, up [M, I] with unit last stride (up None: gate is a packed [M, 2 * I] gate_up), one dtype
    and device, no autograd; activation "silu" or "gelu_tanh"."""
    act = _ACT_CODES[activation]
    ref_fn = _REFERENCE[act]
    if not _library.use_kernels("swiglu" if act == _SILU else "geglu", gate):
        return ref_fn(gate, up) if up is not None else ref_fn(*gate.chunk(2, dim=-1))
    return GLU(gate, up, act, False)  # no autograd: the launcher (while traced, the custom op: one graph node)


def swiglu(gate, up, *, inplace_backward=False, config=None):
    """silu(gate) * up. gate, up [..., I] fp32/fp16/bf16, same shape, dtype and device; row-strided views
    (e.g. `gate_up.chunk(2, -1)`) are read without a copy. Returns a new [..., I] tensor in gate.dtype.

    inplace_backward=True writes dgate and dup over gate's and up's storage (no new memory in backward): only
    for tensors nobody reads after this op's backward, such as fresh projection outputs. Leaves, views of
    leaves and overlapping gate/up silently get the out-of-place backward; another op that saved gate or up
    and runs its backward after this one raises autograd's "modified by an inplace operation" error.
    config: a `GLUConfig` (the launches; None: the measured defaults).
    """
    return _glu("swiglu", _SILU, reference.swiglu, gate, up, inplace_backward, config)


def geglu(gate, up, *, inplace_backward=False, config=None):
    """gelu(gate, approximate="tanh") * up (GemmaMLP). Same contract as `swiglu`."""
    return _glu("geglu", _GELU_TANH, reference.geglu, gate, up, inplace_backward, config)


def swiglu_packed(gate_up, *, inplace_backward=False, config=None):
    """swiglu(*gate_up.chunk(2, -1)) for a fused [..., 2I] projection (Phi3MLP): one [..., 2I] gradient,
    written over gate_up itself with inplace_backward=True, and no concatenation in backward."""
    return _glu_packed("swiglu", _SILU, reference.swiglu, gate_up, inplace_backward, config)


def geglu_packed(gate_up, *, inplace_backward=False, config=None):
    """geglu(*gate_up.chunk(2, -1)); see `swiglu_packed`."""
    return _glu_packed("geglu", _GELU_TANH, reference.geglu, gate_up, inplace_backward, config)
