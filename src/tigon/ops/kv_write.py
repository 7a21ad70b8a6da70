"""RoPE on write: rotate the new keys and store them, with the new values, straight into KV-cache slots.

A decode step otherwise runs RoPE (read k, write k_embed) and then the cache's `index_copy_` (read k_embed and
v, write the slots): three kernels and k's bytes moved three times. Here one launch reads the key and value
once and writes the rotated key and the value into the slot `slots[t]` of the cache; the query can be rotated
in the same launch (`query=`), so a Llama-style decode step needs one kernel before attention. Three programs
per token (b, t): the query's heads, the key's, the value's (at batch 1 a single program took 3 us on an H200).
`rope_kv_append` computes the slot from the cache's next position on the device as well. Forward only.

Layout contract:
- `key`, `value`: `[B, Hkv, T, D]`, any strides (HF's transposed views are read in place);
- `query` (optional): `[B, Hq, T, D]`; the rotated query comes back in query's layout;
- `cos`, `sin`: `[1 or B, T, rd]`, rotate-half convention (`tigon.ops.apply_rope`), rd even <= D: dims rd..D
  pass through (partial rotary);
- `k_cache`, `v_cache`: `[B, Hkv, C, D]` in key's dtype, unit stride on D, written in place;
- `slots`: int64 `[T]` on the device (shared by the batch): token t goes to slot `slots[t]`. A slot outside
  `[0, C)` is skipped (nothing is written), so -1 marks a token not to keep. Two tokens with one slot: which
  one lands is unspecified. The slots are never read by the host.
The math and the byte model are in docs/ops/kv_write.md.
"""

import torch
import triton
import triton.language as tl

from . import _launch, _library, _pdl, reference
from .config import ROPE_KV_WRITE
from .rope import _cos_sin_halves, _rope_heads, check_cos_sin


@triton.jit
def _copy_heads(
    X, Y, n_heads, stride_xh, stride_yh, D,
    BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Copy n_heads rows of D elements (unit stride) from X to Y, BLOCK_HEADS rows at a time."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    for h0 in range(0, n_heads, BLOCK_HEADS):
        o_h = tl.cast(h0, tl.int64) + tl.arange(0, BLOCK_HEADS).to(tl.int64)
        m = (o_h < n_heads)[:, None] & m_d[None, :]
        b_x = tl.load(X + o_h[:, None] * stride_xh + o_d[None, :], mask=m, other=0.0)
        tl.store(Y + o_h[:, None] * stride_yh + o_d[None, :], b_x.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _ring_slot(p, sink, recent):
    """reference.ring_slot in a kernel: p below the sinks, else sink + (p - sink) % recent."""
    laps = tl.maximum((p - sink) // recent, 0)  # p - sink < 0 truncates to 0 either way
    return p - laps * recent


# C (the ring's capacity) and T (the chunk's tokens: a prefill's prompt length) are not specialized: Triton would
# compile again when C % 16 or T % 16 changes, and every generate call sizes its ring from its prompt and
# max_new_tokens (one 0.6-1.0 s TTFT in each benchmark's repeats).
@triton.jit(do_not_specialize=["C", "T"])
def _rope_kv_write_kernel(
    K,  # [B, Hkv, T, D] new keys before RoPE, unit stride on D
    V,  # [B, Hkv, T, D] new values, unit stride on D
    Q,  # [B, Hq, T, D] query (read when Hq > 0)
    COS,  # [Bc, T, rd], Bc in (1, B), any strides
    SIN,
    K_CACHE,  # [B, Hkv, C, D] written at slot SLOTS[t], unit stride on D
    V_CACHE,
    SLOTS,  # [T] int64 slot of each token; outside [0, C): not written (unless SLOT_FROM_NEXT)
    NEXT,  # [1] int64 position of token 0 (SLOT_FROM_NEXT)
    POSITIONS,  # [C] int64 position held by each slot, written (SLOT_FROM_NEXT)
    QO,  # [B, Hq, T, D] rotated query (written when Hq > 0)
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_qb, stride_qh, stride_qt,
    stride_qob, stride_qoh, stride_qot,
    stride_cb, stride_ct, stride_cd,  # stride_cb is 0 when cos has batch 1
    stride_sb, stride_st, stride_sd,
    stride_kcb, stride_kch, stride_kcc,
    stride_vcb, stride_vch, stride_vcc,
    stride_slot,
    T,
    Hq,  # 0: no query
    Hkv,
    C,  # cache slots
    D,  # head dim
    HALF,  # rd / 2
    sink,  # SLOT_FROM_NEXT: slots [0, sink) keep their positions; the other C - sink slots roll
    SLOT_FROM_NEXT: tl.constexpr,
    HAS_PASS: tl.constexpr,  # rd < D
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (ops/_pdl.py): every read after the wait
):
    _pdl.wait(PDL)
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # 0: the query, 1: the key (and the slot's position), 2: the value
    b = pid // T
    t = pid % T
    if part == 0:  # the rotated query goes to its own output; the loop runs no step when Hq == 0
        b_c1, b_c2, b_s1, b_s2 = _cos_sin_halves(COS, SIN, b, t, stride_cb, stride_ct, stride_cd,
                                                 stride_sb, stride_st, stride_sd, HALF, BLOCK_R)
        _rope_heads(
            Q, QO, b_c1, b_c2, b_s1, b_s2, b, t,
            stride_qb, stride_qh, stride_qt, stride_qob, stride_qoh, stride_qot,
            Hq, D, HALF, HAS_PASS, BLOCK_HQ, BLOCK_R, BLOCK_P,
        )
    else:
        if SLOT_FROM_NEXT:  # position p = next + t goes to its ring slot
            p = tl.load(NEXT) + t
            slot = _ring_slot(p, sink, C - sink)
            if (b == 0) & (part == 1) & (slot >= 0) & (slot < C):
                tl.store(POSITIONS + slot, p)
        else:
            slot = tl.load(SLOTS + t * stride_slot)
        if (slot >= 0) & (slot < C):
            # The source row (b, t) and the destination row (b, slot) differ along the sequence axis: both are
            # folded into the base pointers, and the helpers walk heads and dims from there (their t is 0).
            if part == 1:
                b_c1, b_c2, b_s1, b_s2 = _cos_sin_halves(COS, SIN, b, t, stride_cb, stride_ct, stride_cd,
                                                         stride_sb, stride_st, stride_sd, HALF, BLOCK_R)
                _rope_heads(
                    K + t * stride_kt, K_CACHE + slot * stride_kcc, b_c1, b_c2, b_s1, b_s2, b, 0,
                    stride_kb, stride_kh, 0, stride_kcb, stride_kch, 0,
                    Hkv, D, HALF, HAS_PASS, BLOCK_HK, BLOCK_R, BLOCK_P,
                )
            else:
                _copy_heads(
                    V + b * stride_vb + t * stride_vt, V_CACHE + b * stride_vcb + slot * stride_vcc,
                    Hkv, stride_vh, stride_vch, D, BLOCK_HV, BLOCK_D,
                )


def _heads_block(n_heads: int, width: int) -> int:
    return max(1, min(_launch.next_power_of_2(max(n_heads, 1)), ROPE_KV_WRITE.tile // width))


def _fwd_launch(key, value, cos, sin, k_cache, v_cache, slots, query, next_pos=None, positions=None, sink=0):
    B, Hkv, T, D = key.shape
    qo = torch.empty_like(query) if query is not None else cos.new_empty(0)
    if B * T == 0 or Hkv == 0:
        return qo
    rd = cos.shape[-1]
    block_r = _launch.next_power_of_2(rd // 2)
    block_d = _launch.next_power_of_2(D)
    Hq = query.shape[1] if query is not None else 0
    qs = query.stride()[:3] if query is not None else (0, 0, 0)
    qos = qo.stride()[:3] if query is not None else (0, 0, 0)
    pdl = _pdl.enabled(key.device)
    _rope_kv_write_kernel[(B * T, 3)](
        key, value, query if query is not None else key, cos, sin, k_cache, v_cache, slots,
        next_pos if next_pos is not None else slots, positions if positions is not None else slots,
        qo if query is not None else key,
        *key.stride()[:3], *value.stride()[:3], *qs, *qos,
        cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1), cos.stride(2),
        sin.stride(0) if sin.shape[0] > 1 else 0, sin.stride(1), sin.stride(2),
        *k_cache.stride()[:3], *v_cache.stride()[:3], slots.stride(0),
        T, Hq, Hkv, k_cache.shape[2], D, rd // 2, sink,
        SLOT_FROM_NEXT=next_pos is not None, HAS_PASS=rd < D, BLOCK_HQ=_heads_block(Hq, block_r),
        BLOCK_HK=_heads_block(Hkv, block_r),
        BLOCK_HV=_heads_block(Hkv, block_d), BLOCK_R=block_r, BLOCK_P=_launch.next_power_of_2(max(D - rd, 1)),
        BLOCK_D=block_d, PDL=pdl, num_warps=ROPE_KV_WRITE.num_warps, **_pdl.launch_options(pdl),
    )
    return qo


@torch.library.custom_op("tigon::rope_kv_write", mutates_args=("k_cache", "v_cache"))
def rope_kv_write_op(
    key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slots: torch.Tensor, query: torch.Tensor | None,
) -> torch.Tensor:
    """Writes RoPE(key) and value into k_cache / v_cache at `slots`; returns RoPE(query) (empty without one)."""
    return _fwd_launch(key, value, cos, sin, k_cache, v_cache, slots, query)


@rope_kv_write_op.register_fake
def _(key, value, cos, sin, k_cache, v_cache, slots, query):
    return torch.empty_like(query) if query is not None else cos.new_empty(0)


def _validate(key, value, cos, sin, k_cache, v_cache, slots, query, op="tigon.ops.rope_kv_write"):
    for name, t in (("key", key), ("value", value), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        _launch.check_tensor(op, name, t)
    if query is not None:
        _launch.check_tensor(op, "query", query)
    _launch.check_tensor(op, "slots", slots, floating=False)
    if key.dim() != 4:
        raise ValueError(f"{op}: key must have shape [B, Hkv, T, D], got {tuple(key.shape)}")
    B, Hkv, T, D = key.shape
    _launch.check_shape(op, "value", value, key.shape)
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[1] != Hkv or k_cache.shape[3] != D:
        raise ValueError(f"{op}: k_cache must have shape [B={B}, Hkv={Hkv}, C, D={D}], got {tuple(k_cache.shape)}")
    _launch.check_shape(op, "v_cache", v_cache, k_cache.shape)
    if query is not None and (query.dim() != 4 or query.shape[0] != B or query.shape[2] != T
                              or query.shape[3] != D):
        raise ValueError(f"{op}: query must have shape [B={B}, Hq, T={T}, D={D}], got {tuple(query.shape)}")
    _launch.check_same_dtype(op, "key", key, value=value, k_cache=k_cache, v_cache=v_cache, query=query)
    _launch.check_same_device(op, "key", key, value=value, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                              slots=slots, query=query)
    check_cos_sin(op, cos, sin, B, T, D)
    if slots.dtype != torch.int64:
        raise TypeError(f"{op}: slots must be int64, got {slots.dtype}")
    if tuple(slots.shape) != (T,):
        raise ValueError(f"{op}: slots must have shape ({T},), one slot per token, got {tuple(slots.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise ValueError(f"{op}: {name} must have unit stride on the head dim (written in place), got "
                             f"strides {t.stride()}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (key, value, query, cos, sin)):
        raise RuntimeError(f"{op}: inference only, no backward; call it under torch.no_grad() or on detached "
                           "tensors")


def rope_kv_write(key, value, cos, sin, k_cache, v_cache, slots, *, query=None):
    """Write RoPE(key) and value into the cache slots `slots` in one kernel; returns RoPE(query) or None.

    key, value [B, Hkv, T, D] (pre-RoPE key), any strides; cos, sin [1 or B, T, rd] (rd even <= D, the rest
    of D passes through); k_cache, v_cache [B, Hkv, C, D] in key's dtype (fp32/fp16/bf16), unit stride on D,
    mutated in place; slots int64 [T]: token t goes to slot slots[t], a slot outside [0, C) is skipped. query
    [B, Hq, T, D] (optional) is rotated in the same pass and returned in its own layout. Math in fp32, one
    rounding at the store. No autograd; no host sync on the kernel path.
    """
    _validate(key, value, cos, sin, k_cache, v_cache, slots, query)
    if not _library.use_kernels("rope_kv_write", key):
        return reference.rope_kv_write(key, value, cos, sin, k_cache, v_cache, slots, query=query)
    key, value = _launch.unit_last(key), _launch.unit_last(value)
    query = _launch.unit_last(query) if query is not None else None
    q_embed = _library.dispatch(torch.ops.tigon.rope_kv_write, None, _fwd_launch, key, value, cos, sin, k_cache,
                                v_cache, slots, query)
    return q_embed if query is not None else None


def _append_launch(key, value, cos, sin, k_cache, v_cache, positions, next_position, sink, query):
    return _fwd_launch(key, value, cos, sin, k_cache, v_cache, next_position, query, next_position, positions, sink)


@torch.library.custom_op("tigon::rope_kv_append", mutates_args=("k_cache", "v_cache", "positions"))
def rope_kv_append_op(
    key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, positions: torch.Tensor, next_position: torch.Tensor, sink: int,
    query: torch.Tensor | None,
) -> torch.Tensor:
    """rope_kv_write at the ring slots of positions next_position + t; records them in `positions`."""
    return _append_launch(key, value, cos, sin, k_cache, v_cache, positions, next_position, sink, query)


@rope_kv_append_op.register_fake
def _(key, value, cos, sin, k_cache, v_cache, positions, next_position, sink, query):
    return torch.empty_like(query) if query is not None else cos.new_empty(0)


def rope_kv_append_rows(key, value, cos, sin, k_cache, v_cache, positions, next_position, sink, query):
    """`rope_kv_append` for a caller whose tensors are its own, without the argument checks: the ring layer of a
    RollingKVCache (k_cache, v_cache, positions, next_position, sink: built with the cache; key and value checked
    by its `_check`) writing the fused prefill's q/k/v (`tigon.decode.layer_step`: views of its own projections,
    cos/sin the model's rotary output for the chunk's positions, which the layer step checks). No autograd. The
    public op's checks cost more host time than its launch (~36 us a call on a 2-core x86 CPU, kernels aside);
    the prefill makes one a layer."""
    if not _library.use_kernels("rope_kv_append", key):
        return reference.rope_kv_append(key, value, cos, sin, k_cache, v_cache, positions, next_position,
                                        sink=sink, query=query)
    key, value = _launch.unit_last(key), _launch.unit_last(value)
    query = _launch.unit_last(query) if query is not None else None
    q_embed = _library.dispatch(torch.ops.tigon.rope_kv_append, None, _append_launch, key, value, cos, sin, k_cache,
                                v_cache, positions, next_position.reshape(1), sink, query)
    return q_embed if query is not None else None


def rope_kv_append(key, value, cos, sin, k_cache, v_cache, positions, next_position, *, sink=0, query=None):
    """`rope_kv_write` for a ring-buffer cache whose slot is computed on the device: token t of the chunk has
    position `p = next_position + t` and goes to slot p while p < sink, else `sink + (p - sink) % (C - sink)`;
    `positions[slot] = p` is recorded in the same kernel. positions int64 [C], next_position int64 [1] (not
    advanced: the caller adds T). Saves a decode step the slot arithmetic kernels. Returns RoPE(query) or None.
    A chunk longer than the ring's rolling part maps two tokens to one slot: which token's key, value and
    position land there is unspecified (they may even come from different tokens); RollingKVCache only
    appends one token at a time. A negative next_position is a ValueError where its value is on the host (a CPU
    tensor, or any device under TIGON_VALIDATE=1); a CUDA one is not read (no host sync in a decode step), and
    both paths then write nothing for a token whose position is negative.
    """
    op = "tigon.ops.rope_kv_append"
    _launch.check_tensor(op, "next_position", next_position, floating=False)
    _launch.check_tensor(op, "positions", positions, floating=False)
    if next_position.dtype != torch.int64:
        raise TypeError(f"{op}: next_position must be int64, got {next_position.dtype}")
    if next_position.numel() != 1:
        raise ValueError(f"{op}: next_position must be one int64 element, got {next_position.dtype} "
                         f"{tuple(next_position.shape)}")
    if positions.dtype != torch.int64:
        raise TypeError(f"{op}: positions must be int64, got {positions.dtype}")
    T = key.shape[2] if isinstance(key, torch.Tensor) and key.dim() == 4 else 0
    _validate(key, value, cos, sin, k_cache, v_cache, next_position.reshape(1).expand(T), query, op=op)
    C = k_cache.shape[2]
    if tuple(positions.shape) != (C,) or positions.stride(0) != 1:
        raise ValueError(f"{op}: positions must be a contiguous int64 [{C}] tensor (one per cache slot), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    _launch.check_same_device(op, "key", key, positions=positions, next_position=next_position)
    if isinstance(sink, bool) or not isinstance(sink, int) or not 0 <= sink < C:
        raise ValueError(f"{op}: sink must be an int in [0, {C}), got {sink!r}")
    if _library.host_checks(next_position.device):
        first = int(next_position.reshape(()))
        if first < 0:
            raise ValueError(f"{op}: next_position must be >= 0 (the absolute position of the chunk's first token), "
                             f"got {first}")
    return rope_kv_append_rows(key, value, cos, sin, k_cache, v_cache, positions, next_position, sink, query)
