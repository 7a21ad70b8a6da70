"""Launch settings of the decode ops as typed, frozen values.

The defaults are the measured ones (H200 sweeps, docs/ops/decode_linear.md and decode_attention.md). A benchmark
that sweeps a setting passes a config to the op (`decode_linear(..., config=DecodeLinearConfig(...))`,
`decode_attention(..., config=DecodeAttentionConfig(...))`); nothing assigns module attributes. Every field is
a plain int, so `ints()` hands a config across a custom-op boundary (torch.compile) and the op rebuilds it.
"""

import dataclasses


def _check_fields(cfg, powers_of_two=(), zero_ok=()) -> None:
    name = type(cfg).__name__
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if f.name in zero_ok else 1):
            least = "0" if f.name in zero_ok else "1"
            raise ValueError(f"{name}: {f.name} must be an int >= {least}, got {v!r}")
        if f.name in powers_of_two and v & (v - 1):
            raise ValueError(f"{name}: {f.name} must be a power of two, got {v}")


@dataclasses.dataclass(frozen=True)
class DecodeLinearConfig:
    """One launch of `tigon.ops.decode_linear`: each program owns `block_n` output columns and walks K in
    `block_k` steps; `split_k` programs share one output tile's K (ignored with an activation: two
    accumulators already give twice the columns per program). Without a config the op picks one from the
    shapes (`decode_linear._pick_config`)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def __post_init__(self):
        _check_fields(self, powers_of_two=("block_n", "block_k", "num_warps"))
        if self.block_k < 16:
            raise ValueError(f"DecodeLinearConfig: block_k must be >= 16 (tl.dot), got {self.block_k}")

    def ints(self) -> list[int]:
        return [self.block_n, self.block_k, self.num_warps, self.num_stages, self.split_k]


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """The launch of `tigon.ops.decode_attention`. n_splits 0: `min(cdiv(splits_per_sm * SMs, programs),
    cdiv(C, min_split_slots), max_splits)` on a GPU, 2 on the interpreter; block_n 0: 64 slots a loop step for
    a head dim <= 128 on a GPU, 32 above, 16 on the interpreter (several steps on small test caches)."""

    n_splits: int = 0
    block_n: int = 0
    num_warps: int = 4
    num_stages: int = 3
    splits_per_sm: int = 2
    # A split reads >= 64 slots: swept on an H200 (bench_decode_ops, 1.5B Llama shapes, C = 768): 256 -> 64 took
    # the step's attention from 9.3 to 5.4 us per layer at batch 1 (more programs in flight for a short cache).
    min_split_slots: int = 64
    max_splits: int = 64

    def __post_init__(self):
        _check_fields(self, powers_of_two=("block_n", "num_warps"), zero_ok=("n_splits", "block_n"))
        if self.block_n and self.block_n < 16:
            raise ValueError(f"DecodeAttentionConfig: block_n must be 0 or >= 16 (tl.dot), got {self.block_n}")

    def ints(self) -> list[int]:
        return [self.n_splits, self.block_n, self.num_warps, self.num_stages, self.splits_per_sm,
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
    """The chunking of `tigon.ops.linear_cross_entropy`: `chunk_bytes` of chunk logits (rows = chunk_bytes / (V x
    itemsize), a multiple of 64, balanced over the chunks), or exactly `chunk_rows` rows when > 0. Each chunk's
    dW GEMM reads and writes the whole [V, H] gradient once, so larger chunks move fewer bytes and cost memory:
    peak extra = dh (N H b) + dW (V H b) + one chunk (docs/ops/cross_entropy.md has the model and the H200
    sweep)."""

    # 128 MiB: 512 rows at V = 128256 bf16; peak 1.23 GiB at h [16384, 4096], W [128256, 4096]
    chunk_bytes: int = 128 << 20
    chunk_rows: int = 0

    def __post_init__(self):
        _check_fields(self, zero_ok=("chunk_rows",))


LINEAR_CROSS_ENTROPY = LinearCrossEntropyConfig()
