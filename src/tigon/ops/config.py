"""Launch settings of the ops as typed, frozen values (each class is also exported from `tigon.ops`).

The defaults are the measured ones (H200 sweeps, docs/ops/<op>.md). A caller, or a benchmark that sweeps a
setting, passes a config to the op (`rms_norm(..., config=RMSNormConfig(bwd_per_sm=4))`, `decode_linear(...,
config=DecodeLinearConfig(...))`, benchmarks/ops/tune.py); nothing assigns module attributes. Every field is a plain
int (a bool is stored as 0 / 1), so `ints()` hands a config across a custom-op boundary (torch.compile), whose
schema takes ints, not dataclasses, and the launcher reads the ints back.
"""

import dataclasses


def _check_fields(cfg, powers_of_two=(), zero_ok=(), bools=(), minus_one_ok=()) -> None:
    """Every field an int (a bool where named in `bools`) >= 1, >= 0 in `zero_ok`, >= -1 in `minus_one_ok` (-1:
    the default); a power of two (or 0) in `powers_of_two`. A ValueError names the class and the field."""
    name = type(cfg).__name__
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in bools:
            if not isinstance(v, bool):
                raise ValueError(f"{name}: {f.name} must be a bool, got {v!r}")
            continue
        least = -1 if f.name in minus_one_ok else 0 if f.name in zero_ok else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"{name}: {f.name} must be an int >= {least}, got {v!r}")
        if f.name in powers_of_two and v & (v - 1):
            raise ValueError(f"{name}: {f.name} must be a power of two, got {v}")


@dataclasses.dataclass(frozen=True)
class DecodeLinearConfig:
    """One launch of `tigon.ops.decode_linear`: each program owns `block_n` output columns and walks K in
    `block_k` steps; `split_k` programs share one output tile's K (ignored with an activation: two
    accumulators already give twice the columns per program). With a fused norm, each step of the row statistics
    loads `stats_elems` elements of x (rows x columns, a power of two; 0: `decode_linear.STATS_ELEMS`). Without a
    config the op picks one from the shapes (`decode_linear._pick_config`)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    stats_elems: int = 0

    def __post_init__(self):
        _check_fields(self, powers_of_two=("block_n", "block_k", "num_warps", "stats_elems"),
                      zero_ok=("stats_elems",))
        if self.block_k < 16:
            raise ValueError(f"DecodeLinearConfig: block_k must be >= 16 (tl.dot), got {self.block_k}")

    def ints(self) -> list[int]:
        return [self.block_n, self.block_k, self.num_warps, self.num_stages, self.split_k, self.stats_elems]


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """The launch of `tigon.ops.decode_attention`. n_splits 0: on a GPU the split count that fills the last wave
    of programs best at the kernel's compiled occupancy (`decode_attention._splits_for`: within `wave_slack_pct`
    percent of the best fill, the fewest splits; each split at least `min_split_slots` slots, at most
    `max_splits`), 2 on the interpreter. num_warps 0: 2 a program, 4 when the grid stays under one program per
    SM. block_n 0: 64 slots a loop step for a head dim <= 128 on a GPU, 32 above, 16 on the interpreter
    (several steps on small test caches)."""

    n_splits: int = 0
    block_n: int = 0
    num_warps: int = 0
    num_stages: int = 2
    # Swept on an H200 (bench_decode_ops --attention-splits, h200_decode_attention_splits_*.json): the rule's pick
    # against every split count at 2 and 4 warps, batch 1 and 8, caches of 768 to 33024 slots.
    wave_slack_pct: int = 5
    # A split reads >= 64 slots: swept on an H200 (bench_decode_ops, 1.5B Llama shapes, C = 768): 256 -> 64 took
    # the step's attention from 9.3 to 5.4 us per layer at batch 1 (more programs in flight for a short cache).
    min_split_slots: int = 64
    max_splits: int = 64

    def __post_init__(self):
        _check_fields(self, powers_of_two=("block_n", "num_warps"), zero_ok=("n_splits", "block_n", "num_warps",
                                                                             "wave_slack_pct"))
        if self.block_n and self.block_n < 16:
            raise ValueError(f"DecodeAttentionConfig: block_n must be 0 or >= 16 (tl.dot), got {self.block_n}")
        if self.wave_slack_pct >= 100:
            raise ValueError(f"DecodeAttentionConfig: wave_slack_pct must be < 100, got {self.wave_slack_pct}")

    def ints(self) -> list[int]:
        return [self.n_splits, self.block_n, self.num_warps, self.num_stages, self.wave_slack_pct,
                self.min_split_slots, self.max_splits]


@dataclasses.dataclass(frozen=True)
class RopeKVWriteConfig:
    """The launch of `rope_kv_write` / `rope_kv_append`: heads are processed in tiles of at most `tile` elements
    (`[heads, rd / 2]` or `[heads, D]`), as in rope.py."""

    tile: int = 512
    num_warps: int = 4

    def __post_init__(self):
        _check_fields(self, powers_of_two=("tile", "num_warps"))


DECODE_ATTENTION = DecodeAttentionConfig()
ROPE_KV_WRITE = RopeKVWriteConfig()


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyConfig:
    """The chunking of `tigon.ops.linear_cross_entropy`: rows = max(chunk_bytes / (V x itemsize), min_rows), a
    multiple of 64, balanced over the chunks; or exactly `chunk_rows` rows when > 0. Each chunk's dW GEMM has
    K = rows and adds into the whole [V, H] gradient, so short chunks run it below the full-size GEMM rate: fewer,
    larger chunks are faster and cost memory (peak extra = dh (N H b) + dW (V H b) + one chunk). min_rows keeps a
    large vocabulary, whose chunk_bytes hold few rows, from the shortest chunks (docs/ops/cross_entropy.md has the
    model, the H200 sweeps and the measured floor)."""

    # H200 (benchmarks/results/h200_tune.json, flce_chunks; two calls): 768 rows at the Llama-3-8B head (192 MiB)
    # 79.9-82.5 ms at a 1.29 GiB peak against 84.4 ms at 1.23 GiB for 512 rows (128 MiB); at Gemma-3's head
    # (V 262144, H 2304) 768 rows (384 MiB) 100.2 ms against 112.2 ms for 384 rows (192 MiB), 129.7 ms for 256.
    chunk_bytes: int = 192 << 20
    chunk_rows: int = 0
    min_rows: int = 768

    def __post_init__(self):
        _check_fields(self, zero_ok=("chunk_rows", "min_rows"))


LINEAR_CROSS_ENTROPY = LinearCrossEntropyConfig()


def _ints(cfg) -> list[int]:
    return [int(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)]


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    """The launches of `rms_norm` / `add_rms_norm`: warps of the forward and of the backward, backward programs
    per SM (each loops over rows and keeps one fp32 partial dw row), and the elements of a tile of rows a
    program takes at once (`tile_elems`, a power of two; rows wider than it go one a program). 0 (every
    default): from the shape, as measured (`rms_norm._launch_plan`, `rms_norm._rows_per_tile`: tiles of 8192
    elements for rows of <= 512, else one row)."""

    fwd_warps: int = 0
    bwd_warps: int = 0
    bwd_per_sm: int = 0
    tile_elems: int = 0

    def __post_init__(self):
        _check_fields(self, powers_of_two=("fwd_warps", "bwd_warps", "tile_elems"),
                      zero_ok=("fwd_warps", "bwd_warps", "bwd_per_sm", "tile_elems"))

    ints = _ints


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """The launch of `apply_rope`: q and k heads in tiles of at most `tile` elements of `[heads, rd / 2]`.
    H200 at Llama-8B shapes: 512 x 4 warps, 180 us fwd+bwd (2048 x 4: 194 us)."""

    tile: int = 512
    num_warps: int = 4

    def __post_init__(self):
        _check_fields(self, powers_of_two=("tile", "num_warps"))

    ints = _ints


@dataclasses.dataclass(frozen=True)
class QKNormRopeConfig:
    """The launches of `qk_norm_rope`: tiles of `tile_elems` elements of one tensor (tokens x heads x head_dim, all
    heads of a token where they fit), one a program, forward and backward warps (the backward writes one fp32
    partial row of dw a tile, summed after). 0 (every default): from the shape, as swept on the H200
    (`qk_norm_rope._plan`: 32 heads a tile up to 4096 elements, a forward warp per 1024 elements, 2 backward warps)."""

    tile_elems: int = 0
    fwd_warps: int = 0
    bwd_warps: int = 0

    def __post_init__(self):
        _check_fields(self, powers_of_two=("tile_elems", "fwd_warps", "bwd_warps"),
                      zero_ok=("tile_elems", "fwd_warps", "bwd_warps"))

    ints = _ints


@dataclasses.dataclass(frozen=True)
class GLUConfig:
    """The launches of `swiglu` / `geglu` (and the packed forms): `tile_bytes` of each tensor a program covers
    on a GPU, `cpu_tile` elements a program on the interpreter (~1 ms a program: one big tile a test case),
    `num_warps` on a GPU. H200 at [16384, 14336] bf16: 4 KiB x 4 warps, 912 us fwd+bwd (16 KiB x 8: 940)."""

    tile_bytes: int = 4096
    cpu_tile: int = 1 << 16
    num_warps: int = 4

    def __post_init__(self):
        _check_fields(self, powers_of_two=("tile_bytes", "cpu_tile", "num_warps"))

    ints = _ints


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig:
    """The launches of `cross_entropy` on a GPU: `block_v` logits a loop step (0: 8192) with `num_warps` (0:
    block_v / 512, at most 16), programs per SM of the grad_output scaling, and `l2_hints` (evict_last on the
    first pass over a row, evict_first on the gradient pass). The interpreter always uses 512-wide steps."""

    block_v: int = 0
    num_warps: int = 0
    scale_per_sm: int = 4
    l2_hints: bool = True

    def __post_init__(self):
        _check_fields(self, powers_of_two=("block_v", "num_warps"), zero_ok=("block_v", "num_warps"),
                      bools=("l2_hints",))

    ints = _ints


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
    """The launches of `adamw_step_` and `grad_norm`: a program owns `chunk_blocks` blocks of `block` elements of
    one tensor (its tail chunk is masked, the others are not), with `num_warps`. Picked on an H200 over the 1.5B
    Llama's parameters (docs/ops/adamw.md): 1024 x 1 with 4 warps was the fastest or within 1.2% of it in two
    sweeps."""

    block: int = 1024
    chunk_blocks: int = 1
    num_warps: int = 4

    def __post_init__(self):
        _check_fields(self, powers_of_two=("block", "chunk_blocks", "num_warps"))

    @property
    def chunk(self) -> int:
        """Elements a program owns."""
        return self.block * self.chunk_blocks

    ints = _ints


ADAMW = AdamWConfig()


@dataclasses.dataclass(frozen=True)
class AdamW8bitConfig:
    """The launch of `adamw8bit_step_`: a program owns `blocks_per_program` blocks of 256 elements (one
    [blocks, 256] tile: a row a block, its absmax a row reduction), with `num_warps`. 4 x 4 is the element count
    and warps of the measured AdamW default (1024 elements, 4 warps); not swept for this kernel."""

    blocks_per_program: int = 4
    num_warps: int = 4

    def __post_init__(self):
        _check_fields(self, powers_of_two=("blocks_per_program", "num_warps"))

    ints = _ints


ADAMW8BIT = AdamW8bitConfig()


@dataclasses.dataclass(frozen=True)
class QuantLinearConfig:
    """The launch of `tigon.ops.quant_linear` (speed only, never the result); 0 = chosen from the shapes
    (`_plan`). Powers of two: block_m (>= 16), block_n, block_k (>= 16), num_warps. gemv_max_rows: up to this many
    rows run the FMA kernel, more the tensor-core one (-1: the default, 1). split_k: programs sharing one K range.
    prefetch: 1 loads ahead, 0 does not (-1: the default, 0): the GEMV the next tile before summing this one, the
    tensor-core kernel the next step's scales (the codes and x are pipelined by Triton, bf16 scales are not).
    dequant_min_rows: from this many rows (past `gemv_max_rows`, 16-bit x) W is dequantized into a buffer and one
    cuBLAS GEMM runs (-1: the default, 256 on a GPU, never elsewhere; 0: never); block_n, block_k and num_warps
    then set the dequantization's tile. code_mma: 1 runs launches of 16-bit x over int4 weights (K a multiple of 128;
    groups of 32, 64 or a multiple of 128) on the code-MMA kernel (`ops/quant_code_mma.py`: the codes as the dot's
    register operand): up to 16 rows as a GEMV with K split, more as a GEMM of block_m rows of x a program
    (default 128, 64 with an activation); block_n, block_k (a dot's columns), num_warps, num_stages and split_k
    set its launch; other launches run as without it. 0: not. -1 (the default): on for int4 at 2 to 16 rows on a
    Hopper GPU where every other field is left at its default (`quant_linear._mma_by_rule`), else not."""

    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0
    split_k: int = 0
    gemv_max_rows: int = -1
    prefetch: int = -1
    dequant_min_rows: int = -1
    code_mma: int = -1

    def __post_init__(self):
        _check_fields(self, powers_of_two=("block_m", "block_n", "block_k", "num_warps"),
                      zero_ok=tuple(f.name for f in dataclasses.fields(self)),
                      minus_one_ok=("gemv_max_rows", "prefetch", "dequant_min_rows", "code_mma"))
        for name in ("block_m", "block_k"):
            if 0 < getattr(self, name) < 16:
                raise ValueError(f"QuantLinearConfig: {name} must be 0 or >= 16 (tl.dot), got {getattr(self, name)}")
        for name in ("prefetch", "code_mma"):
            if getattr(self, name) > 1:
                raise ValueError(f"QuantLinearConfig: {name} must be -1, 0 or 1, got {getattr(self, name)}")

    def ints(self) -> list[int]:
        """The fields in order: the custom op's `config` argument (`QuantLinearConfig(*ints)` reads it back)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]
