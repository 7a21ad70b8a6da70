"""Importers: a quantized checkpoint's module -> QuantizedWeight, by repacking its tensors (never re-quantizing).

Each importer reads the module's tensors and writes new ones; the module is left untouched. Modules are recognized
by their tensors and documented attributes, so no quantizer package is imported here. Formats (K = in_features,
N = out_features, G = K / group_size groups; "packed along K" means element k of a word sits at bits 4 * (k % 8)):

- GPTQ (auto-gptq / GPTQModel `QuantLinear`, bits 4): qweight int32 [K / 8, N] packed along K, qzeros int32
  [G, N / 8] packed along N, scales [G, N], g_idx int32 [K] (the group of input column k). w = (q - z) * s. The
  "v1" zero convention (auto-gptq, GPTQModel's v1 kernels) stores z - 1, "v2" (GPTQModel's torch and Triton
  kernels) stores z: read from `module.qzero_format()` where the module has it, v1 for auto-gptq's classes. An
  act-order g_idx becomes `perm` (stored column j = input column perm[j]) with the groups stored in order.
- AWQ (AutoAWQ `WQLinear_GEMM`, GPTQModel's AWQ GEMM / torch kernels): qweight int32 [K, N / 8] and qzeros
  [G, N / 8] packed along N in AWQ's interleaved order (nibble i of a word holds column 8c + [0,2,4,6,1,3,5,7][i]),
  scales [G, N]; w = (q - z) * s, z stored as is.
- compressed-tensors "pack-quantized" (int 4-bit): weight_packed int32 [N, K / 8] packed along K, each value the
  signed code plus 8; weight_scale [N, G]; weight_zero_point absent (symmetric), or signed [N, G], or packed along N
  (int32 [N / 8, G], plus 8); weight_g_idx optional (as GPTQ's). w = (q - zp) * s.
- FP8 (e4m3): compressed-tensors "float-quantized" and fbgemm (`weight` + `weight_scale` per tensor [1] or per
  channel [N, 1]); transformers' finegrained `FP8Linear` (`weight` + `weight_scale_inv` [ceil(N / B), ceil(K / B)]
  for B x B blocks, or a scalar). Both scales multiply: w = q * s. UE8M0 scales (powers of two) convert exactly.
- bitsandbytes `Linear4bit`, NF4 and FP4: the [N, K] codes flattened row-major, two a byte, the first in the HIGH
  nibble; absmax per block of `blocksize` codes (dequantized first when double-quantized: code2[q] * absmax2 +
  offset); w = code[q] * absmax, code bitsandbytes' NF4 or FP4 table (the layout's nf4 / fp4).
- torchao (an `nn.Linear` whose `weight` is a torchao tensor subclass, groups of `block_size` (1, G)):
  `IntxUnpackedToInt8Tensor` with target_dtype int4 (IntxWeightOnlyConfig; the weights of
  Int8DynamicActivationIntxWeightConfig): qdata int8 [N, K] holding q in [-8, 7], scale and zero_point [N, K / G]
  (int8 or float), w = (q - zp) * s. `Int4Tensor` (Int4WeightOnlyConfig's "plain" packing, mslk's kernels): qdata
  [N, K / 2], element k of a row in byte k // 2, the low nibble for even k, each a two's-complement q in [-8, 7];
  scale and zero_point [K / G, N]; w = q * s + z. `Int4OpaqueTensor` (PrototypeInt4WeightOnlyConfig, CPU) and
  `Int4TilePackedTo4dTensor` ("tile_packed_to_4d", CUDA): torch's tinygemm packing of codes q in [0, 15] (read
  back through torch's own packer, `_tinygemm_codes`), scale_and_zero [K / G, N, 2]; w = (q - 8) * s + z.
  The float zero points z become the layout's zeros 8 - z / s, rounded once to fp32 (`_float_zeros`).

Not imported (each raises ValueError with the reason; `tigon.quant.adopt` logs it and leaves the module alone):
bits other than 4, GPTQ/AWQ kernels that repack the tensors for themselves (Marlin, ExLlama, Machete, BitBLAS,
IPEX, fused CPU), bitsandbytes 8-bit and 4-bit code books other than NF4 and FP4, blocks that straddle rows,
non-square FP8 blocks, the other torchao layouts (mslk's preshuffled int4, XPU / NPU "plain_int32", the
int8-activation DA8W4 packing, packed intx, version-1 AffineQuantizedTensor, float8, nf4) and torchao tensors that
pre-scale the activations.
"""

import torch
from torch import nn

from tigon.ops.quantized_weight import TABLES, QuantizedWeight, pack_int4, unpack_int4

# GPTQ / AWQ kernels whose buffers keep the checkpoint's packing after loading (the others repack at post_init)
GPTQ_KERNELS = ("torch", "triton", "tritonv2", "cuda", "cuda-old")
AWQ_KERNELS = ("awq_gemm", "awq_torch", "awq_gemm_triton", "WQLinear_GEMM")
_AWQ_SLOT = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in nibble _AWQ_SLOT[j]
_FP8 = (torch.float8_e4m3fn,)


def _fail(where, message):
    raise ValueError(f"tigon.quant.{where}: {message}")


def _tensor(where, module, name, dtypes=None, required=True):
    t = getattr(module, name, None)
    if t is None and not required:
        return None
    if not isinstance(t, torch.Tensor):
        _fail(where, f"module.{name} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(where, f"module.{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    return t.detach()


def _unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Integer words packed with 4-bit fields along `dim` (field i of a word at bits 4 * i) -> int16 codes, the
    fields of word w at positions w * per .. w * per + per - 1 of `dim`."""
    bits = packed.element_size() * 8
    words = packed.movedim(dim, -1).to(torch.int64) & ((1 << bits) - 1)
    shifts = torch.arange(0, bits, 4, device=packed.device)
    codes = (words[..., None] >> shifts) & 0xF
    return codes.reshape(*words.shape[:-1], -1).movedim(-1, dim).to(torch.int16)


def _act_order(where, g_idx, k, group_size):
    """None when g_idx is the plain k // group_size; else the permutation that sorts the columns by group."""
    if g_idx is None:
        return None
    plain = torch.arange(k, device=g_idx.device) // group_size
    g = g_idx.to(torch.int64).reshape(-1)
    if g.numel() != k:
        _fail(where, f"g_idx must have {k} entries, got {g.numel()}")
    if torch.equal(g, plain):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], plain):
        _fail(where, f"g_idx must put exactly group_size={group_size} input columns in each group")
    return perm


def _int4(where, codes, scales, zeros, group_size, g_idx, dtype):
    """codes [N, K] (input column order), scales / zeros [N, G] (group order) -> the layout, zeros dropped when all
    are 8 (symmetric), columns sorted by group under act-order."""
    n, k = codes.shape
    if k % group_size or group_size % 2:
        _fail(where, f"group_size {group_size} must be even and divide in_features {k}")
    perm = _act_order(where, g_idx, k, group_size)
    if perm is not None:
        codes = codes[:, perm]
    if zeros is not None:
        zeros = None if bool((zeros == 8).all()) else zeros.contiguous()
    return QuantizedWeight("int4", pack_int4(codes), scales.contiguous(), zeros, group_size, (n, k), dtype, perm)


def _check_features(where, module, n, k):
    """The packed shape must be the module's own: a padded packing would not match the activations."""
    for name, want in (("in_features", k), ("out_features", n)):
        got = getattr(module, name, want)
        if got != want:
            _fail(where, f"module.{name} is {got} but the packed tensors hold {want} (padded packing)")


def _group_size(where, module, k, groups):
    g = getattr(module, "group_size", None)
    g = k if g in (None, -1) else g
    if not isinstance(g, int) or g <= 0 or groups * g != k:
        _fail(where, f"group_size {g} and {groups} scale rows do not cover in_features {k}")
    return g


def _bits(where, module, name="bits"):
    bits = getattr(module, name, 4)
    if bits != 4:
        _fail(where, f"only 4-bit weights are supported, got {name}={bits}")


def import_gptq(module: nn.Module, *, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """A GPTQ QuantLinear (auto-gptq, GPTQModel) -> int4 QuantizedWeight; `dtype` defaults to the scales'."""
    where = "import_gptq"
    kernel = getattr(module, "QUANT_TYPE", None)
    if kernel not in GPTQ_KERNELS:
        _fail(where, f"kernel {kernel!r} ({type(module).__name__}) keeps its own packing; load the checkpoint with "
                     f"one of the kernels {GPTQ_KERNELS} (GPTQConfig(backend='torch') or 'triton')")
    if getattr(module, "planar", False):
        _fail(where, "planar (bit-plane) packing is not supported")
    _bits(where, module)
    ints = (torch.int8, torch.int16, torch.int32)
    qweight = _tensor(where, module, "qweight", ints)
    qzeros = _tensor(where, module, "qzeros", ints)
    scales = _tensor(where, module, "scales", (torch.float16, torch.bfloat16, torch.float32))
    g_idx = _tensor(where, module, "g_idx", required=False)
    codes = _unpack(qweight, 0).T  # [N, K]
    n, k = codes.shape
    if scales.dim() != 2 or scales.shape[1] != n:
        _fail(where, f"scales must be [groups, {n}], got {list(scales.shape)}")
    zeros = _unpack(qzeros, 1)[:, :n]
    if tuple(zeros.shape) != tuple(scales.shape):
        _fail(where, f"qzeros must unpack to {list(scales.shape)}, got {list(zeros.shape)}")
    fmt = module.qzero_format() if callable(getattr(module, "qzero_format", None)) else \
        1 if type(module).__module__.startswith("auto_gptq") else None
    if fmt not in (1, 2):
        _fail(where, f"cannot tell the zero-point convention (v1 or v2) of {type(module).__name__}")
    zeros = zeros + 1 if fmt == 1 else zeros
    _check_features(where, module, n, k)
    gs = _group_size(where, module, k, scales.shape[0])
    return _int4(where, codes, scales.T, zeros.T.to(scales.dtype), gs, g_idx, dtype or scales.dtype)


def import_awq(module: nn.Module, *, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """An AWQ GEMM module (AutoAWQ WQLinear_GEMM, GPTQModel) -> int4 QuantizedWeight; `dtype`: the scales'."""
    where = "import_awq"
    kernel = getattr(module, "QUANT_TYPE", type(module).__name__)
    if kernel not in AWQ_KERNELS:
        _fail(where, f"kernel {kernel!r} ({type(module).__name__}) has its own packing; only the GEMM packing "
                     f"{AWQ_KERNELS} is read")
    _bits(where, module, "w_bit" if hasattr(module, "w_bit") else "bits")
    qweight = _tensor(where, module, "qweight", (torch.int32,))
    qzeros = _tensor(where, module, "qzeros", (torch.int32,))
    scales = _tensor(where, module, "scales", (torch.float16, torch.bfloat16, torch.float32))
    slot = torch.tensor(_AWQ_SLOT, device=qweight.device)

    def columns(packed):  # [R, N / 8] -> [R, N] in column order
        c = _unpack(packed, 1)
        return c.reshape(c.shape[0], -1, 8)[..., slot].reshape(c.shape[0], -1)

    codes, zeros = columns(qweight), columns(qzeros)
    k, n = codes.shape
    if tuple(scales.shape) != tuple(zeros.shape) or scales.shape[1] != n:
        _fail(where, f"scales {list(scales.shape)} and qzeros {list(zeros.shape)} must both be [groups, {n}]")
    _check_features(where, module, n, k)
    gs = _group_size(where, module, k, scales.shape[0])
    return _int4(where, codes.T, scales.T, zeros.T.to(scales.dtype), gs, None, dtype or scales.dtype)


def import_compressed_tensors(module: nn.Module, *, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """A compressed-tensors module: "pack-quantized" int4 (`weight_packed`) -> int4, FP8 (`weight` float8) ->
    fp8 (`import_fp8`). `dtype` defaults to the scales' (bf16 for fp32 scales)."""
    where = "import_compressed_tensors"
    if getattr(module, "weight_packed", None) is None:
        return import_fp8(module, dtype=dtype)
    weights = getattr(getattr(module, "quantization_scheme", None), "weights", None)
    if weights is not None and (getattr(weights, "num_bits", 4) != 4 or getattr(weights, "type", "int") != "int"):
        _fail(where, f"only int 4-bit pack-quantized weights are supported, got {weights.type} {weights.num_bits}")
    packed = _tensor(where, module, "weight_packed", (torch.int32,))
    scale = _tensor(where, module, "weight_scale", (torch.float16, torch.bfloat16, torch.float32))
    shape = getattr(module, "weight_shape", None)
    n = packed.shape[0]
    k = int(shape[1]) if isinstance(shape, torch.Tensor) else getattr(module, "in_features", packed.shape[1] * 8)
    if packed.dim() != 2 or packed.shape[1] != -(-k // 8) or scale.dim() != 2 or scale.shape[0] != n:
        _fail(where, f"weight_packed must be [N, ceil({k} / 8)] and weight_scale [N, groups], got "
                     f"{list(packed.shape)} and {list(scale.shape)}")
    codes = _unpack(packed, 1)[:, :k]
    gs = k // scale.shape[1]
    if weights is not None and getattr(weights, "group_size", None) not in (None, gs):
        _fail(where, f"weight_scale has {scale.shape[1]} groups, not in_features / group_size = {k} / "
                     f"{weights.group_size}")
    zp = _tensor(where, module, "weight_zero_point", required=False)
    zeros = None
    if zp is not None and not (weights is not None and getattr(weights, "symmetric", False)):
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // 8), scale.shape[1]):
            zeros = _unpack(zp, 0)[:n]  # packed along N, plus 8: the code of zero already
        elif tuple(zp.shape) == tuple(scale.shape):
            zeros = zp.to(torch.int16) + 8
        else:
            _fail(where, f"weight_zero_point must be [N, groups] or packed [ceil(N / 8), groups], got "
                         f"{list(zp.shape)}")
        zeros = zeros.to(scale.dtype)
    g_idx = _tensor(where, module, "weight_g_idx", required=False)
    if dtype is None:
        dtype = scale.dtype if scale.dtype != torch.float32 else torch.bfloat16
    return _int4(where, codes, scale, zeros, gs, g_idx, dtype)


def _fp8_block(module, scale_shape, n, k):
    """The square block size of a [ceil(N / B), ceil(K / B)] scale grid, from the module or the shape."""
    block = getattr(module, "block_size", None)
    if block is None:
        weights = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        block = getattr(weights, "block_structure", None)
    candidates = [tuple(block)] if block is not None else [(128, 128)]
    for b0, b1 in candidates:
        if b0 == b1 and tuple(scale_shape) == (-(-n // b0), -(-k // b1)):
            return b0
    _fail("import_fp8", f"scales {list(scale_shape)} are not square blocks of the weight [{n}, {k}] "
                        f"(block_size {block})")


def import_fp8(module: nn.Module, *, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """An FP8 e4m3 module (finegrained FP8Linear, fbgemm, compressed-tensors FP8) -> fp8 QuantizedWeight, the
    weight's bytes shared, not copied. `dtype` defaults to the bias's, else bf16."""
    where = "import_fp8"
    weight = _tensor(where, module, "weight", _FP8)
    if weight.dim() != 2:
        _fail(where, f"weight must be [N, K], got {list(weight.shape)}")
    n, k = weight.shape
    name = "weight_scale_inv" if getattr(module, "weight_scale_inv", None) is not None else "weight_scale"
    scale = _tensor(where, module, name)
    if not scale.is_floating_point():
        _fail(where, f"module.{name} must be floating point, got {scale.dtype}")
    scale = scale.float()
    if scale.numel() == 1:
        scales, block = scale.reshape(1).expand(n).contiguous(), 0
    elif scale.numel() == n and scale.dim() in (1, 2) and scale.shape[0] == n:
        scales, block = scale.reshape(n), 0
    elif scale.dim() == 2:
        scales, block = scale, _fp8_block(module, scale.shape, n, k)
    else:
        _fail(where, f"module.{name} must be per tensor, per channel [N] / [N, 1] or blocks, got {list(scale.shape)}")
    bias = getattr(module, "bias", None)
    if dtype is None:
        dtype = bias.dtype if isinstance(bias, torch.Tensor) and bias.is_floating_point() else torch.bfloat16
    return QuantizedWeight("fp8", weight, scales, None, block, (n, k), dtype)


def import_bnb4(module: nn.Module, *, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """A bitsandbytes Linear4bit (NF4 or FP4, plain or double-quantized absmax) -> nf4 / fp4 QuantizedWeight;
    `dtype` defaults to the module's compute dtype. The state's code book must be the layout's table, value for
    value (`TABLES`), so the kernels' lookup is bitsandbytes' dequantization."""
    where = "import_bnb4"
    state = getattr(getattr(module, "weight", None), "quant_state", None)
    if state is None:
        _fail(where, "module.weight has no quant_state (not a quantized bitsandbytes Linear4bit)")
    n, k = tuple(state.shape)
    kind = state.quant_type
    if kind not in TABLES:
        _fail(where, f"quant_type must be 'nf4' or 'fp4' (the NF4 and FP4 code books), got {kind!r}")
    if not torch.equal(state.code.float().cpu(), torch.tensor(TABLES[kind])):
        _fail(where, f"the state's {kind} code book differs from bitsandbytes' {kind.upper()} table "
                     f"(tigon.ops.quantized_weight.TABLES[{kind!r}]): got {state.code.float().cpu().tolist()}")
    block = state.blocksize
    if k % block or k % 2:
        _fail(where, f"blocksize {block} must divide in_features {k}: its blocks would straddle rows")
    absmax = state.absmax
    if state.nested:  # bitsandbytes' dequantize_blockwise of the absmax, then the offset, in fp32
        inner = state.state2
        outer = inner.absmax.float().repeat_interleave(inner.blocksize)[: absmax.numel()]
        absmax = inner.code.float()[absmax.long()] * outer + state.offset
    raw = module.weight.detach().reshape(-1).view(torch.uint8)[: n * k // 2].reshape(n, k // 2)
    data = (raw >> 4) | (raw << 4)  # the first code of a byte moves from the high nibble to the low one
    if dtype is None:
        dtype = getattr(module, "compute_dtype", None) or state.dtype
    return QuantizedWeight(kind, data, absmax.float().reshape(n, k // block), None, block, (n, k), dtype)


def _float_zeros(where, scales, zeros):
    """Zero points in the float domain (w = (q - 8) * s + z) -> the layout's (w = (q - z') * s): z' = 8 - z / s,
    computed in fp64 and rounded once to fp32, so w moves by at most half an fp32 ulp of z' times s."""
    z = (8.0 - zeros.double() / scales.double()).float()
    if not bool(torch.isfinite(z).all()):
        _fail(where, "a group's zero point over its scale overflows fp32 (a constant group quantized with a "
                     "vanishing scale)")
    return z


def _nibbles(t):
    """The 4-bit fields of a tensor's bytes in memory order, the low nibble of each byte first."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(-1)


def _tinygemm_codes(where, packed, pack, n, k, device):
    """The [N, K] codes that torch's int4 packer `pack` ([N, K] int32 codes -> its packed tensor) put into
    `packed`. The packers (tinygemm's tensor-core tiles on CUDA, the vector-width blocks on CPU) only move each
    4-bit code to a place set by the shape (and the CPU's vector width), so packing the codes' own flat indices a
    nibble at a time, with the same op on `device`, says where each code went. Assumed: the codes move unchanged
    (checked in part: each place must be filled once)."""
    if n * k >= 2**31:
        _fail(where, f"a [{n}, {k}] weight is too large to read back (2^31 codes or more)")
    idx = torch.arange(n * k, dtype=torch.int32, device=device).reshape(n, k)
    src = torch.zeros(n * k, dtype=torch.int32, device=device)
    for b in range(max(1, ((n * k - 1).bit_length() + 3) // 4)):
        src |= _nibbles(pack((idx >> (4 * b)) & 0xF)).to(torch.int32) << (4 * b)
    src = src.long()
    seen = torch.zeros(n * k, dtype=torch.bool, device=device)
    if src.numel() == n * k and int(src.max()) < n * k:
        seen[src] = True
    if not bool(seen.all()):
        _fail(where, "torch's int4 packer does not place each code once on this machine; cannot read it back")
    nib = _nibbles(packed)
    if nib.numel() != n * k:
        _fail(where, f"the packed weight holds {nib.numel()} codes, not {n} x {k}")
    codes = torch.empty(n * k, dtype=torch.int16, device=packed.device)
    codes[src.to(packed.device)] = nib.to(torch.int16)
    return codes.reshape(n, k)


def _torchao_intx(where, w, n, k, gs):
    if w.target_dtype != torch.int4:
        _fail(where, f"only int4 IntxUnpackedToInt8Tensor is read, got target_dtype {w.target_dtype}")
    codes = w.qdata.to(torch.int16) + 8
    if int(codes.min()) < 0 or int(codes.max()) > 15:
        _fail(where, "IntxUnpackedToInt8Tensor qdata holds values outside int4's [-8, 7]")
    zp = w.zero_point
    zeros = (zp.float() + 8) if zp.is_floating_point() else (zp.to(torch.int16) + 8).to(w.scale.dtype)
    return codes, w.scale, zeros


def _torchao_int4_plain(where, w, n, k, gs):
    if w.qdata.dim() != 2 or tuple(w.qdata.shape) != (n, k // 2):
        _fail(where, f"Int4Tensor qdata must be [{n}, {k // 2}], got {list(w.qdata.shape)}")
    codes = unpack_int4(w.qdata.view(torch.uint8)) ^ 8  # two's-complement q -> q + 8
    scales = w.scale.T
    return codes, scales, _float_zeros(where, scales, w.zero_point.T)


def _torchao_int4_cpu(where, w, n, k, gs):
    if getattr(w, "act_mapping_type", None) is not None:
        _fail(where, "Int4OpaqueTensor's int8-activation (DA8W4) packing is not read, only its weight-only one")
    codes = _tinygemm_codes(where, w.qdata, lambda c: torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, 1),
                            n, k, torch.device("cpu"))
    sz = w.scale_and_zero
    return codes, sz[..., 0].T, _float_zeros(where, sz[..., 0].T, sz[..., 1].T)


def _torchao_int4_tiles(where, w, n, k, gs):
    if not torch.cuda.is_available():
        _fail(where, "reading Int4TilePackedTo4dTensor needs CUDA (torch's tinygemm packer)")
    q = w.qdata
    if q.dim() != 4:
        _fail(where, f"Int4TilePackedTo4dTensor qdata must be 4-d, got {list(q.shape)}")
    inner = q.shape[3] * 2
    n_pad, k_pad = q.shape[0] * 8, q.shape[1] * inner * 16

    def pack(c):
        pairs = (c[:, ::2] << 4 | c[:, 1::2]).to(torch.uint8)  # as torchao hands the codes to the packer
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner)

    codes = _tinygemm_codes(where, q, pack, n_pad, k_pad, q.device if q.is_cuda else torch.device("cuda"))
    sz = w.scale_and_zero[: k // gs, :n]
    return codes[:n, :k], sz[..., 0].T, _float_zeros(where, sz[..., 0].T, sz[..., 1].T)


_TORCHAO = {"IntxUnpackedToInt8Tensor": _torchao_intx, "Int4Tensor": _torchao_int4_plain,
            "Int4OpaqueTensor": _torchao_int4_cpu, "Int4TilePackedTo4dTensor": _torchao_int4_tiles}


def import_torchao(module: nn.Module, *, dtype: torch.dtype | None = None) -> QuantizedWeight:
    """An nn.Linear whose weight is a torchao int4 tensor (`_TORCHAO` lists the layouts read) -> int4
    QuantizedWeight; `dtype` defaults to the weight's. Where the tensor quantizes the activations too (int8 per
    token, fp8 rows), the weights are read and the activations stay in the model's dtype, as for FP8 checkpoints."""
    where = "import_torchao"
    w = getattr(module, "weight", None)
    name = type(w).__name__
    if not isinstance(w, torch.Tensor) or "torchao" not in type(w).__module__:
        _fail(where, f"module.weight must be a torchao tensor, got {name}")
    if name not in _TORCHAO:
        _fail(where, f"unsupported torchao layout {name}; the layouts read are {sorted(_TORCHAO)}")
    if not isinstance(module, nn.Linear):
        _fail(where, f"only nn.Linear modules are read, got {type(module).__name__}")
    if w.dim() != 2:
        _fail(where, f"only 2-d weights are read, got a {w.dim()}-d {name}")
    if getattr(w, "act_pre_scale", None) is not None:
        _fail(where, f"{name} multiplies the activations by act_pre_scale first, which the layout has no place for")
    n, k = w.shape
    block = [int(b) for b in w.block_size]
    if len(block) != 2 or block[0] != 1 or block[1] <= 0 or k % block[1]:
        _fail(where, f"only groups along K are read (block_size (1, G), G dividing {k}), got {tuple(block)}")
    codes, scales, zeros = _TORCHAO[name](where, w, n, k, block[1])
    _check_features(where, module, n, k)
    return _int4(where, codes, scales, zeros, block[1], None, dtype or w.dtype)


IMPORTERS = {"gptq": import_gptq, "awq": import_awq, "compressed-tensors": import_compressed_tensors,
             "fp8": import_fp8, "bnb4": import_bnb4, "torchao": import_torchao}


def format_of(module: nn.Module) -> str | None:
    """The quantized format `module` holds ("gptq", "awq", "compressed-tensors", "fp8", "bnb4", "torchao", or
    "bnb8", "quantized" for ones no importer reads), or None for a module with no quantized weight."""
    if not isinstance(module, nn.Module) or isinstance(getattr(module, "base_layer", None), nn.Module):
        return None  # a wrapper (PEFT's LoRA layers) whose `weight` is its base layer's: the base layer is the one
    if all(isinstance(getattr(module, a, None), torch.Tensor) for a in ("qweight", "qzeros", "scales")):
        kind = str(getattr(module, "QUANT_TYPE", type(module).__name__))
        return "awq" if "awq" in kind.lower() or type(module).__name__.startswith("WQLinear") else "gptq"
    if isinstance(getattr(module, "weight_packed", None), torch.Tensor):
        return "compressed-tensors"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None
    if getattr(weight, "quant_state", None) is not None:
        return "bnb4"
    if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "compressed-tensors" if hasattr(module, "quantization_scheme") else "fp8"
    if "torchao" in type(weight).__module__:
        return "torchao"
    if type(module).__name__.startswith("Linear8bit") or hasattr(weight, "SCB"):
        return "bnb8"
    if not weight.is_floating_point():
        return "quantized"
    return None
