"""The `decode_linear` launches measured per shape: a data table `decode_linear._pick_config` reads before its rule.

`lookup` answers from the user cache first (`tuned_cache`: the picks `tigon tune --decode-linear` measured on this
card, for this torch and Triton), then from `MEASURED_PICKS` below, and None sends the launch to the rule
(`decode_linear._rule_config`); `source` says which in words (`tigon env`).

`MEASURED_PICKS[gpu name][(K, N, batch bucket, kind)]` is the `DecodeLinearConfig.ints()` tuple
(block_n, block_k, num_warps, num_stages, split_k[, stats_elems]) that `benchmarks/generation/bench_decode_ops.py` timed
fastest for that projection in 16-bit weights, where it beat the rule's own launch (`--emit-picks FILE` writes the
entries of a run as a dict literal to paste under the GPU's name). N is the output width of the launch (q + k + v
for the fused projection; one of gate / up with a GLU). A launch with no entry, a 4-byte dtype, more than 16 rows or an
unmeasured GPU runs the rule (`decode_linear._rule_config`), so the shapes the rule was tuned at (the 1.5B Llama
of benchmarks/generation/bench_decode.py) launch as the rule says, but for the one 1.5B entry.

Batch buckets: 1 (one row) and 16 (2 to 16 rows: the kernel pads rows to 16, so these share one tile shape;
measured at batch 8). Kinds name what the launch fuses: "plain", or "+"-joined "norm", "glu", "residual"
(`kind`): a Llama layer's q/k/v is "norm", o_proj and down_proj "residual", gate/up "norm+glu".
"""

from . import tuned_cache

BATCH_BUCKETS = (1, 16)

MEASURED_PICKS: dict = {
    # bench_decode_ops.py --model llama3-8b at f2868a9 (torch 2.11, triton 3.6; benchmarks/results/
    # h200_decode_ops_llama3-8b.json): the winners >= 2% faster than the rule's launch. Comments: rule -> pick.
    # The norm+qkv entries are from bench_decode_ops.py --norm-cost at 172ddf9, after the norm's statistics
    # became a few wide steps (h200_decode.json "decode_linear_norm_picks"): at batch 1 the rule's 32 columns
    # now beat the 64 picked before (19.88 against 21.55 us: no entry); at 2-16 rows, 512-wide statistics steps
    # (for callers that fuse the norm there: the decode layer step launches it on its own from 2 rows).
    "NVIDIA H200": {
        (4096, 4096, 1, "residual"): (32, 128, 4, 4, 2),  # o+residual, batch 1: 12.48 -> 11.74 us
        (14336, 4096, 1, "residual"): (64, 256, 4, 4, 2),  # down+residual, batch 1: 34.10 -> 31.75 us
        (4096, 6144, 16, "norm"): (64, 256, 4, 4, 1, 4096),  # norm+qkv, batch 8: 26.13 -> 21.30 us
        (4096, 4096, 16, "residual"): (32, 128, 4, 4, 2),  # o+residual, batch 8: 12.46 -> 11.90 us
        (14336, 4096, 16, "residual"): (64, 256, 8, 4, 2),  # down+residual, batch 8: 36.53 -> 32.67 us
        # the 1.5B Llama of bench_decode.py, --norm-cost at 172ddf9: norm+qkv, batch 8, 10.80 -> 10.09 us
        (2048, 3072, 16, "norm"): (32, 256, 4, 4, 1, 4096),
    },
}


def batch_bucket(m: int) -> int | None:
    """The bucket of a launch with m rows: the least bucket >= m, None past the last (no measured picks)."""
    return next((b for b in BATCH_BUCKETS if m <= b), None)


def kind(norm: bool, glu: bool, residual: bool) -> str:
    """What a launch fuses, as the table's keys spell it: "plain", "norm", "residual", "norm+glu", ..."""
    return "+".join(p for p, on in (("norm", norm), ("glu", glu), ("residual", residual)) if on) or "plain"


def lookup(gpu: str | None, K: int, N: int, m: int, launch_kind: str, table: dict | None = None) -> tuple | None:
    """The measured (block_n, block_k, num_warps, num_stages, split_k[, stats_elems]) for this launch on `gpu`
    (torch.cuda.get_device_name; None: no GPU), or None where nothing was measured. table: None for the user cache
    then MEASURED_PICKS, or a {gpu: {key: config}} table to read alone."""
    bucket = batch_bucket(m)
    if bucket is None or not gpu:
        return None
    return tuned_cache.pick("decode_linear", gpu, (K, N, bucket, launch_kind), MEASURED_PICKS, table)


def source(gpu: str | None) -> str:
    """Where the launches of decode_linear come from on `gpu`, in words (for `tigon env`)."""
    return tuned_cache.picks_source("decode_linear", gpu, MEASURED_PICKS, "the shape rule (decode_linear._rule_config)",
                                    "ops/decode_linear_picks.py", "--decode-linear")
