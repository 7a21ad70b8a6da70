"""The `quant_linear` decode launches measured per shape: a data table `quant_linear._plan` reads before its rule.

`lookup` answers from the user cache first (`tuned_cache`: the picks `tigon tune --quant-linear` measured on this
card, for this torch and Triton), then from `MEASURED_PICKS` below, and None sends the launch to the shape rule in
`quant_linear._plan`; `source` says which in words (`tigon env`). Picks apply only where the caller passed no config,
to 16-bit activations on a CUDA device; a config passed, fp32 activations and the CPU keep the rule.

`MEASURED_PICKS[gpu name][(K, N, rows bucket, fmt, group_size, glu)]` is the `QuantLinearConfig.ints()` tuple
(block_m, block_n, block_k, num_warps, num_stages, split_k, gemv_max_rows, prefetch, dequant_min_rows[, code_mma]) that
`python -m benchmarks quant-linear --sweep --out FILE` (benchmarks/generation/bench_quant_linear.py) timed fastest for
that shape in bf16: a row's `config` where the sweep's best beat the default launch (`default_ms`) by >= 2%; no entry
where it did not. Cards without rows run the rule until `tigon tune --quant-linear` measures them.

Keys: K the input width; N the output width of the launch (one of gate / up with a GLU: half the stored rows);
fmt the stored format, as the benchmark's kinds spell it: "int4" (symmetric), "int4_zeros" (int4 with zero points),
"nf4", "fp8" (`format_of`); group_size the weight's (fp8 per channel: 0); glu whether the launch fuses the GLU.
Rows buckets: 1 (one row: the GEMV), 16 (2 to 16 rows: the decode kernels pad rows to 16, so these share one tile
shape; measured at 8 rows), 32 (17 to 32 rows) and 128 (33 to 128 rows: GEMMs of a serving batch, measured at 32 and
128 rows). More rows take no picks: the rule, and from 256 rows on a GPU the dequantize-then-cuBLAS path.
"""

from . import tuned_cache

ROWS_BUCKETS = (1, 16, 32, 128)
FORMATS = ("int4", "int4_zeros", "nf4", "fp8")

MEASURED_PICKS: dict = {
    # quant-linear --sweep --rows 1 8 --kinds int4 fp8 at c9c55da (torch 2.11, triton 3.6; benchmarks/results/
    # h100_quant_sweep.json): Llama-3-8B's launches, int4 symmetric and fp8 in groups / blocks of 128. Comments:
    # default -> pick, per call from CUDA graphs. Without an entry (the default within 2%): int4 down at one row and
    # every fp8 launch at one row.
    "NVIDIA H100 80GB HBM3": {
        (4096, 6144, 1, "int4", 128, False): (0, 64, 512, 0, 0, 0, -1, 1, -1),  # qkv: 9.2 -> 8.9 us
        (4096, 4096, 1, "int4", 128, False): (0, 64, 256, 0, 0, 0, -1, 1, -1),  # o: 7.3 -> 7.1 us
        (4096, 14336, 1, "int4", 128, True): (0, 32, 256, 0, 0, 2, -1, 1, -1),  # gate/up + GLU: 34.4 -> 28.5 us
        # int4 at 8 rows: code-MMA launches as `tigon tune --quant-linear` picked them at 40189fe
        # (h100_tune_8b_ab.txt; the batch-8 step 3.913 -> 3.684 ms in the same call), against the rule's launch, which
        # on Hopper is the code-MMA kernel's own plan (h100_tune_8b_ab_times.json); qkv's best (split 8, 11.55 us)
        # is within 2% of that plan's 11.56: no entry
        (4096, 4096, 16, "int4", 128, False): (0, 64, 0, 0, 3, 0, -1, -1, -1, 1),  # o, 8 rows: 13.0 -> 10.7 us
        (4096, 14336, 16, "int4", 128, True): (0, 32, 0, 2, 0, 0, -1, -1, -1, 1),  # gate/up + GLU: 39.5 -> 36.4 us
        (14336, 4096, 16, "int4", 128, False): (0, 64, 0, 0, 3, 0, -1, -1, -1, 1),  # down: 24.8 -> 21.9 us
        (4096, 6144, 16, "fp8", 128, False): (0, 64, 64, 4, 0, 0, -1, -1, -1),  # qkv, 8 rows: 20.0 -> 16.1 us
        (4096, 4096, 16, "fp8", 128, False): (0, 64, 64, 8, 0, 0, -1, -1, -1),  # o: 18.3 -> 12.5 us
        (4096, 14336, 16, "fp8", 128, True): (0, 32, 128, 4, 0, 0, -1, -1, -1),  # gate/up + GLU: 65.9 -> 60.2 us
        (14336, 4096, 16, "fp8", 128, False): (0, 64, 64, 0, 0, 0, -1, 1, -1),  # down: 45.2 -> 33.2 us
        # int4 at 32 and 128 rows (quant-linear --sweep --rows 32 128 --kinds int4 at 40189fe, do_bench timing;
        # h100_quant_sweep_32_128.json): the code-MMA GEMM where it beat the tensor-core kernel's rule, else that
        # kernel's best tile; o at 32 rows keeps the rule
        (4096, 6144, 32, "int4", 128, False): (64, 128, 0, 8, 0, 0, -1, -1, -1, 1),  # qkv, 32 rows: 50.8 -> 47.4 us
        (4096, 14336, 32, "int4", 128, True): (64, 64, 0, 4, 0, 0, -1, -1, -1, 1),  # gate/up + GLU: 75.6 -> 73.0 us
        (14336, 4096, 32, "int4", 128, False): (64, 64, 0, 4, 0, 0, -1, -1, -1, 1),  # down: 156.2 -> 86.5 us
        (4096, 6144, 128, "int4", 128, False): (128, 64, 0, 4, 0, 0, -1, -1, -1, 1),  # qkv, 128 rows: 95.6 -> 59.2 us
        (4096, 4096, 128, "int4", 128, False): (128, 64, 32, 8, 4, 0, -1, -1, -1),  # o: 91.3 -> 60.1 us
        (4096, 14336, 128, "int4", 128, True): (128, 128, 64, 8, 3, 0, -1, -1, -1),  # gate/up + GLU: 120.0 -> 110.4 us
        (14336, 4096, 128, "int4", 128, False): (64, 64, 0, 4, 0, 0, -1, -1, -1, 1),  # down: 192.3 -> 87.2 us
    },
}


def rows_bucket(m: int) -> int | None:
    """The bucket of a launch with m rows: the least bucket >= m, None past the last (no measured picks)."""
    return next((b for b in ROWS_BUCKETS if m <= b), None)


def format_of(kind: str, zeros: bool) -> str:
    """The table's spelling of a QuantizedWeight format: kind "int4" / "nf4" / "fp8", "int4_zeros" with zero points."""
    return "int4_zeros" if kind == "int4" and zeros else kind


def lookup(gpu: str | None, K: int, N: int, m: int, fmt: str, group_size: int, glu: bool,
           table: dict | None = None) -> tuple | None:
    """The measured `QuantLinearConfig.ints()` tuple for this launch on `gpu` (torch.cuda.get_device_name; None: no
    GPU), or None where nothing was measured. table: None for the user cache then MEASURED_PICKS, or a
    {gpu: {key: config}} table to read alone."""
    bucket = rows_bucket(m)
    if bucket is None or not gpu:
        return None
    return tuned_cache.pick("quant_linear", gpu, (K, N, bucket, fmt, group_size, bool(glu)), MEASURED_PICKS, table)


def source(gpu: str | None) -> str:
    """Where the launches of quant_linear come from on `gpu`, in words (for `tigon env`)."""
    return tuned_cache.picks_source("quant_linear", gpu, MEASURED_PICKS,
                                    "the shape rule (quant_linear._plan; int4 at 2-16 rows on Hopper: the code-MMA "
                                    "kernel)", "ops/quant_linear_picks.py", "--quant-linear",
                                    past_picks="over 128 rows or with a config passed")
