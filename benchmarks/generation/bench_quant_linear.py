"""quant_linear against a bf16 matmul at Llama-3-8B projection shapes, as % of the weight-read bound.

For each shape (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096 with the SiLU GLU, down 4096 x 14336), each
weight kind and each row count (1 and 8: decode; 512: prefill), the time of `tigon.ops.quant_linear` and of
`x @ W.T` on the same weight in bf16. Prefill rows: the median of triton.testing.do_bench. Decode rows (M <= 16)
run as in a decode step: replayed from a CUDA graph (triton.testing.do_bench_cudagraph, median), the call made on
one of several copies of the weight in turn, enough copies to pass GRAPH_BYTES (4x an H100's or H200's 50 MiB L2)
so that each call reads its weight from memory as a step's layers do; the time is the graph's over the copies. A
decode-sized call takes a few microseconds of GPU time against ~15-20 of host launch time, so do_bench's
launch-by-launch timing measures the host there. The byte model of one call: the weight's
`QuantizedWeight.nbytes` (packed data, scales, zeros, perm) plus x and y; the bound is those bytes at the copy
ceiling measured in the same run (a device-to-device copy of a 1 GiB buffer: 2 GiB moved), and `pct_of_bound` is
bound time / measured time. Prefill rows report TFLOP/s as well (2 M N K flops), and the tensor-core GEMM's time
(`mm_kernel_ms`, dequant_min_rows=0) beside the default path's (from 256 rows on a GPU: dequantize, then cuBLAS).

    python -m benchmarks quant-linear --out results.json            # on a GPU
    python -m benchmarks quant-linear --sweep --kinds int4 --rows 1   # also a small grid of launch configs
    python -m benchmarks quant-linear --smoke --out /tmp/q.json     # tiny shapes on the CPU (interpreter)
    python -m benchmarks quant-linear --rows 1 8 --kinds int4 --read-floor  # and each weight's read floor
"""

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import torch

SHAPES = {"qkv": (6144, 4096, None), "o": (4096, 4096, None), "gate_up": (28672, 4096, "silu"),
          "down": (4096, 14336, None)}
SMOKE_SHAPES = {"tiny_glu": (48, 256, "silu")}
# kind name -> (QuantizedWeight kind, group size, zero points)
KINDS = {"int4": ("int4", 128, False), "int4_zeros": ("int4", 128, True), "nf4": ("nf4", 64, False),
         "fp8": ("fp8", 128, False), "fp8_channel": ("fp8", 0, False)}
# --sweep: launch configs around the defaults, per kernel (the GEMV at M = 1, the tensor-core kernel above)
SWEEP_GEMV = [dict(block_n=bn, block_k=bk, prefetch=pf) for bn in (32, 64, 128) for bk in (256, 512)
              for pf in (0, 1)]
# the split of K and the warps a program, around the default tile (the shape rule picks the split from the SM count)
SWEEP_GEMV += [dict(block_n=64, block_k=256, split_k=sk, num_warps=w) for sk in (1, 2, 4, 8, 16) for w in (2, 4, 8)]
# fewer splits with the next tile's loads in flight: longer K loops whose loads overlap the math
SWEEP_GEMV += [dict(block_n=bn, block_k=256, split_k=sk, prefetch=1) for bn in (32, 64) for sk in (2, 4)]
SWEEP_DECODE = [dict(block_n=bn, block_k=bk, num_warps=w) for bn in (32, 64, 128) for bk in (64, 128)
                for w in (4, 8)] + [dict(gemv_max_rows=16)]
# the tensor-core kernel with the next step's scales loaded ahead (docs/ops/quant_decode_rows_model.md, change B)
SWEEP_DECODE += [dict(block_n=bn, block_k=bk, prefetch=1) for bn in (64, 128) for bk in (64, 128)]
# the code-MMA kernel (int4; ops/quant_code_mma.py) at one row and at 2 to 16: tiles, pipeline stages, splits,
# a dot's columns (fewer registers, more programs an SM)
SWEEP_MMA = [dict(code_mma=1, block_n=bn, num_stages=st) for bn in (64, 128) for st in (2, 3, 4)] + [
    dict(code_mma=1, split_k=sk) for sk in (2, 4, 8, 16)] + [dict(code_mma=1, block_k=bk) for bk in (32, 64)] + [
    dict(code_mma=1, block_n=256, block_k=64, num_warps=8)] + [
    # tiles below a warpgroup's (64 rows on 4 warps) run mma.sync on sm_90 too: no wait on each step's wgmma
    dict(code_mma=1, block_n=bn, num_warps=w) for bn, w in ((64, 2), (32, 2), (32, 1))]
SWEEP_GEMV += SWEEP_MMA
SWEEP_DECODE += SWEEP_MMA
# (the tensor-core GEMM's tiles: dequant_min_rows=0 keeps prefill rows off the dequantize-then-cuBLAS path)
SWEEP_PREFILL = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st, dequant_min_rows=0)
                 for bm in (64, 128) for bn in (64, 128) for bk in (32, 64) for w in (4, 8) for st in (3, 4)]
# the code-MMA kernel as the prefill GEMM: tiles of x's rows and the weight's, warps
SWEEP_PREFILL += [dict(code_mma=1, block_m=bm, block_n=bn, num_warps=w) for bm in (64, 128) for bn in (64, 128)
                  for w in (4, 8)]
# K split at 17-255 rows, where one program a tile leaves SMs idle (qkv at 128 rows: 48 to 96 tiles on 132 SMs)
SWEEP_PREFILL += [dict(code_mma=1, block_m=bm, block_n=bn, split_k=sk) for bm in (64, 128) for bn in (64, 128)
                  for sk in (2, 4, 8)]
SWEEP_PREFILL += [dict(block_m=bm, split_k=sk, dequant_min_rows=0) for bm in (64, 128) for sk in (2, 4, 8)]


def make_weight(kind, N, K, dtype, device, gen):
    from tigon.ops import QuantizedWeight
    from tigon.ops.quantized_weight import pack_int4

    qkind, G, zeros = KINDS[kind]
    if qkind == "fp8":
        data = torch.randn(N, K, generator=gen, device=device).to(torch.float8_e4m3fn)
        shape = (N,) if G == 0 else (-(-N // G), -(-K // G))
        return QuantizedWeight("fp8", data, torch.rand(shape, generator=gen, device=device).to(dtype) * 0.01,
                               None, G, (N, K), dtype)
    codes = torch.randint(0, 16, (N, K), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=gen, device=device) * 0.01).to(dtype)
    z = torch.full((N, K // G), 8.0, device=device, dtype=dtype) if zeros else None
    return QuantizedWeight(qkind, pack_int4(codes), scales, z, G, (N, K), dtype)


GRAPH_BYTES = 200 << 20  # weight bytes a decode-row graph cycles through: 4x a 50 MiB L2
GRAPH_MAX_COPIES = 32


def timer(device, smoke):
    """ms of one call: triton.testing.do_bench's median on a GPU, one timed call after a warm-up on the CPU."""
    if not smoke:
        import triton

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_time(fn):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return cpu_time


def copy_ceiling_gbps(device, smoke, bench):
    n = (16 << 20) if smoke else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def copies_for(nbytes: int) -> int:
    """How many copies of an `nbytes` weight a decode-row graph cycles through: GRAPH_BYTES at least, 2..32."""
    return max(2, min(GRAPH_MAX_COPIES, -(-GRAPH_BYTES // nbytes)))


def graph_timer(copies_of, key):
    """A timer for decode rows: bench(call, weight) runs call(w) on each w of `copies_of(key(weight))` in turn
    inside one CUDA graph; ms per call (the graph's median over the copies)."""
    import triton

    def bench(call, weight):
        ws = copies_of(key(weight))

        def step():
            for w in ws:
                call(w)

        step()  # compiles and allocates outside the capture
        return triton.testing.do_bench_cudagraph(step, rep=50, return_mode="median") / len(ws)

    return bench


def measure(bench, ceiling, x, qw, w16, act, sweep, graph_bench=None, mma_only=False) -> dict:
    """One row: quant_linear (the default launch, or the best of SWEEP; of its code-MMA configs only with
    `mma_only`) and x @ w16.T, timed and checked. With `graph_bench` (decode rows on a GPU) both are timed from a
    CUDA graph over copies of the weight."""
    from tigon.ops import QuantLinearConfig, quant_linear
    from tigon.ops.quant_linear import quant_linear_reference

    (M, K), N = x.shape, qw.shape[0]
    if graph_bench is not None:
        def timed(fn_of_w, w):
            return graph_bench(fn_of_w, w)
    else:
        def timed(fn_of_w, w):
            return bench(lambda: fn_of_w(w))
    n_out = N // 2 if act else N
    io_bytes = (M * K + M * n_out) * x.element_size()
    moved = qw.nbytes + io_bytes
    best = default_ms = best_mma = None
    grid = SWEEP_GEMV if M == 1 else SWEEP_DECODE if M <= 16 else SWEEP_PREFILL
    if mma_only or qw.kind != "int4":  # the code-MMA kernel's configs alone, or (it takes int4 only) none of them
        grid = [c for c in grid if (c.get("code_mma") == 1) == mma_only]
    for cfg in [None] + ([QuantLinearConfig(**c) for c in grid] if sweep else []):
        try:
            ms = timed(lambda w, cfg=cfg: quant_linear(x, w, activation=act, config=cfg), qw)
        except Exception as e:  # a swept config the GPU cannot run (shared memory): a note, not a stop
            print(f"  M={M} {cfg}: {type(e).__name__}", file=sys.stderr)
            continue
        if cfg is None:
            default_ms = ms
        if best is None or ms < best[0]:
            best = (ms, cfg)
        if cfg is not None and cfg.code_mma == 1 and (best_mma is None or ms < best_mma[0]):
            best_mma = (ms, cfg)
    ms, cfg = best
    got = quant_linear(x, qw, activation=act, config=cfg)
    want = quant_linear_reference(x, qw, activation=act)
    rel = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()
    bf16_ms = timed(lambda w: x @ w.T, w16)
    # prefill rows: the tensor-core GEMM too (the default at these rows dequantizes, then runs cuBLAS)
    mm_ms = bench(lambda: quant_linear(x, qw, activation=act, config=QuantLinearConfig(dequant_min_rows=0))) \
        if M > 16 else None
    bound_ms = moved / (ceiling * 1e9) * 1e3
    return dict(N=N, K=K, activation=act, group_size=qw.group_size, M=M, ms=ms, gbps=moved / (ms * 1e-3) / 1e9,
                bytes=moved, bound_ms=bound_ms, pct_of_bound=100 * bound_ms / ms, bf16_ms=bf16_ms,
                bf16_pct_of_bound=100 * (w16.numel() * 2 + io_bytes) / (ceiling * 1e9) * 1e3 / bf16_ms,
                speedup_vs_bf16=bf16_ms / ms, default_ms=default_ms, mm_kernel_ms=mm_ms,
                tflops=2 * M * N * K / (ms * 1e-3) / 1e12,
                max_rel_err_vs_reference=rel, config=None if cfg is None else dataclasses.asdict(cfg),
                mma_ms=best_mma and best_mma[0], mma_config=best_mma and dataclasses.asdict(best_mma[1]),
                timing="cuda graph over weight copies" if graph_bench is not None else "do_bench")


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16
    bench = timer(device, args.smoke)
    ceiling = copy_ceiling_gbps(device, args.smoke, bench)
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: copy ceiling {ceiling:.0f} GB/s")
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in args.shapes}
    rows_list = args.rows or ([1, 17] if args.smoke else [1, 8, 512])
    gen = torch.Generator(device=device).manual_seed(0)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, triton=_triton_version(), copy_ceiling_gbps=ceiling, dtype=str(dtype))
    rows = []
    for shape, (N, K, act) in shapes.items():
        w16 = torch.randn(N, K, generator=gen, device=device).to(dtype)
        for kind in args.kinds:
            qw = make_weight(kind, N, K, dtype, device, gen)
            for M in rows_list:
                x = torch.randn(M, K, generator=gen, device=device).to(dtype)
                graph = None
                if device.type == "cuda" and M <= 16:  # a decode-sized call: timed as a decode step runs it
                    copies = {id(qw): [qw] + [make_weight(kind, N, K, dtype, device, gen)
                                              for _ in range(copies_for(qw.nbytes) - 1)],
                              id(w16): [w16] + [torch.randn_like(w16) for _ in range(copies_for(w16.nbytes) - 1)]}
                    graph = graph_timer(copies.__getitem__, id)
                row = measure(bench, ceiling, x, qw, w16, act, args.sweep, graph, args.mma_only)
                if args.read_floor and M == rows_list[0]:  # a property of the weight: once, at the first rows
                    from benchmarks.generation import read_floor  # after main() chose the interpreter or not

                    if read_floor.runs_on(device):  # a Triton kernel: the smoke's CPU tensors on a GPU machine skip it
                        floor = read_floor.read_floor(graph or (lambda call, w: bench(lambda: call(w))), qw)
                        row.update(read_floor=dict(floor, gbps=floor["bytes"] / (floor["ms"] * 1e-3) / 1e9))
                        print(f"  read floor of the codes: {floor['ms'] * 1e3:.1f} us "
                              f"({row['read_floor']['gbps']:.0f} GB/s; {floor['block']} words x {floor['steps']} a "
                              f"program, {floor['warps']} warps)", flush=True)
                graph = copies = None
                row.update(shape=shape, kind=kind)
                rows.append(row)
                print(f"{shape:8s} {kind:11s} M={M:<4d} {row['ms'] * 1e3:9.1f} us {row['gbps']:7.0f} GB/s "
                      f"{row['pct_of_bound']:5.1f}% of bound | bf16 {row['bf16_ms'] * 1e3:8.1f} us "
                      f"({row['speedup_vs_bf16']:.2f}x) err {row['max_rel_err_vs_reference']:.1e}"
                      + (f" | GEMM kernel {row['mm_kernel_ms'] * 1e3:8.1f} us" if row["mm_kernel_ms"] else "")
                      + (f" | best of the sweep: {_changed(row['config'])}, default "
                         + (f"{row['default_ms'] * 1e3:.1f} us" if row["default_ms"] else "failed")
                         + (f", code-MMA kernel {row['mma_ms'] * 1e3:.1f} us ({_changed(row['mma_config'])})"
                            if row["mma_ms"] else "")
                         if args.sweep else ""), flush=True)
                if args.out:  # after every row: a run cut off by its time limit keeps what it measured
                    _write(args.out, dict(meta, rows=rows))
    return dict(meta, rows=rows)


def _changed(config) -> str:
    """The swept fields of a config that differ from the defaults ("default" for the shape rule's launch)."""
    from tigon.ops import QuantLinearConfig

    if config is None:
        return "default"
    base = dataclasses.asdict(QuantLinearConfig())
    return " ".join(f"{k}={v}" for k, v in config.items() if v != base[k]) or "default"


def _write(path, result):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _triton_version():
    import triton

    return triton.__version__


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    p.add_argument("--sweep", action="store_true", help="also time a grid of launch configs; report the best")
    p.add_argument("--mma-only", action="store_true",
                   help="with --sweep: only the code-MMA kernel's configs (beside the default launch)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, help="rows M (default 1 8 512; 1 17 with --smoke)")
    p.add_argument("--read-floor", action="store_true",
                   help="also time a kernel that only reads each weight's codes (read_floor.py), at the first rows")
    args = p.parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        # before the first tigon import decorates its kernels (a no-op when the caller set it already)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    result = run(args)
    if args.out:
        _write(args.out, result)
    return result


if __name__ == "__main__":
    main()
