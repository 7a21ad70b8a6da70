"""The quantized prefill in L2-sized chunks of W: does dequantizing a chunk into a reused buffer, then its GEMM,
keep the bf16 weight's write in L2?

`quant_linear`'s prefill path (from 256 rows on a GPU) dequantizes the whole weight into a bf16 buffer, then runs
one cuBLAS GEMM. At 512 rows the GEMM is bound by its FLOPs, and the dequantization is bound by its write: the
8B step's ~14 GB of bf16 written at the copy rate, 6.1 of the 17.5 ms of int4 prefill kernels on an H100
(benchmarks/results/h100.md). In chunks of `chunk` output rows, each chunk dequantized into the same buffer (the
allocator hands the freed block back) and multiplied at once, a chunk that fits the L2 (50 MB on an H100) is read
back by its GEMM from there, and written over by the next chunk's dequantization while still resident.

Prediction (before any run): at 512 rows the chunked path saves up to the whole write's time (gate_up's 235 MB,
~78 us of its ~284), less what the chunks' smaller GEMMs lose; a [512, 4096] GEMM is ~one wave of cuBLAS tiles
on 132 SMs, so chunks of 4096 rows (32 MB of bf16) should keep most of the GEMM's rate and chunks of 1024 lose it.

Each row: the whole path (dequantize, then `x @ W.T`), the same product as W @ x.T (the chunked path's
orientation, so the GEMM's kernel choice is compared alike), each chunk size, and the bf16 GEMM alone (its floor);
median of triton.testing.do_bench, which flushes the L2 before each call. Each chunked product is checked against
the whole path's (each output element the same K-long fp32 dot, rounded once to bf16: at most one bf16 ulp apart).

    python -m benchmarks prefill-chunks [--rows 512] [--chunks 1024 2048 4096 8192] [--out FILE]
    python -m benchmarks prefill-chunks --smoke      # tiny shapes (on a CPU through Triton's interpreter)
"""

import argparse
import importlib
import json
import os

import torch

SMOKE_SHAPES = {"tiny": (48, 256)}


def _module():
    """The module tigon.ops.quant_linear (the package's attribute of that name is the function)."""
    return importlib.import_module("tigon.ops.quant_linear")


def _paths(qw, x, plan):
    """{name: fn() -> y or y^T} for the whole path, its transposed twin and (below) the chunks; qw, x on one device."""
    ql = _module()
    kind = ql.KIND_CODES[qw.kind]
    N, K = qw.shape

    def dequant(n0, n1):
        zeros = qw.zeros[n0:n1] if qw.zeros is not None else None
        return ql._dequant(qw.data[n0:n1], qw.scales[n0:n1], zeros, kind, qw.group_size, (n1 - n0, K), x.dtype, plan)

    def whole():
        return torch.mm(x, dequant(0, N).t())

    def whole_t():
        return torch.mm(dequant(0, N), x.t())

    def chunked(chunk):
        def run():
            yt = torch.empty((N, x.shape[0]), dtype=x.dtype, device=x.device)
            for n0 in range(0, N, chunk):
                n1 = min(n0 + chunk, N)
                w = dequant(n0, n1)
                torch.mm(w, x.t(), out=yt[n0:n1])
                del w  # the block goes back to the allocator: the next chunk's dequantization reuses it
            return yt
        return run

    return whole, whole_t, chunked


def measure(name, N, K, rows, chunks, device, bench, gen):
    from benchmarks.generation.bench_quant_linear import make_weight
    from tigon.ops.config import QuantLinearConfig

    ql = _module()
    dtype = torch.bfloat16
    qw = make_weight("int4", N, K, dtype, device, gen)
    x = torch.randn(rows, K, generator=gen, device=device).to(dtype)
    plan = ql._plan(rows, N, K, "int4", qw.group_size, False, device,
                    QuantLinearConfig(dequant_min_rows=1), False, False)
    whole, whole_t, chunked = _paths(qw, x, plan)
    ref = whole()
    w16 = torch.randn(N, K, generator=gen, device=device).to(dtype)
    row = dict(shape=name, N=N, K=K, rows=rows, whole_us=bench(whole) * 1e3, whole_t_us=bench(whole_t) * 1e3,
               gemm_bf16_us=bench(lambda: torch.mm(x, w16.t())) * 1e3, chunks={})
    scale = row["max_abs_out"] = ref.float().abs().max().item()
    for c in chunks:
        fn = chunked(c)
        err = (fn().t().float() - ref.float()).abs().max().item()
        if err > 2 ** -7 * scale:  # one bf16 rounding of each side, at the largest output
            raise AssertionError(f"prefill-chunks: chunk {c} of {name} differs from the whole product by {err}")
        row["chunks"][c] = dict(us=bench(fn) * 1e3, max_abs_diff=err, chunk_mb=min(c, N) * K * 2 / 2 ** 20)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--chunks", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (on a CPU through Triton's interpreter)")
    args = p.parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first tigon import decorates its kernels
    from benchmarks.generation.bench_quant_linear import SHAPES

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # smoke on a GPU: tiny shapes there
    if device.type == "cuda":
        import triton.testing

        def bench(fn):
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    else:
        import time

        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k][:2] for k in SHAPES}
    rows = 17 if args.smoke else args.rows
    chunks = [16, 32] if args.smoke else args.chunks
    gen = torch.Generator(device=device).manual_seed(0)
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", rows=[])
    for name, (N, K) in shapes.items():
        row = measure(name, N, K, rows, chunks, device, bench, gen)
        result["rows"].append(row)
        best = min(row["chunks"].items(), key=lambda kv: kv[1]["us"])
        print(f"{name} [{rows} x {K}] @ [{N} x {K}]^T int4: whole {row['whole_us']:.1f} us (as W x^T "
              f"{row['whole_t_us']:.1f}), bf16 GEMM alone {row['gemm_bf16_us']:.1f}; chunks "
              + ", ".join(f"{c}: {v['us']:.1f}" for c, v in row["chunks"].items())
              + f"; best {best[0]} ({row['whole_us'] / best[1]['us']:.2f}x the whole)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
