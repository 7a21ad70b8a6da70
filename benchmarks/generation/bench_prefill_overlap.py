"""Whether the quantized prefill's dequantizations can hide under its GEMMs: one Llama-3-8B layer's four projections
(qkv, o, gate|up, down) at M prompt rows, timed from CUDA graphs three ways: serial (quant_linear's prefill path,
each weight dequantized by `_dequant_kernel`, then its cuBLAS GEMM), overlapped (every dequantization queued on a
second stream, each GEMM waiting only for its own weight: the next weights dequantize under this GEMM), and the
bf16 GEMMs alone (the floor: the bf16 model's projections).

hidden = (serial - overlapped) / (serial - floor): the share of the dequantizations' cost a second stream takes
back, measured before any of it is built into quant_linear (docs/ops/quant_linear.md, "Prefill"; the int4 prefill at
512 tokens spends ~5.8 ms over bf16's on an H100). The overlapped form keeps all four weights in 16 bits at once (a
layer's ~0.44 GB at 8B), as a real one double-buffering weights would not; the epilogues (GLU, residual) are left
out of all three, being the same in each.

    PYTHONPATH=src python -m benchmarks prefill-overlap [--rows 512 4096] [--kinds int4 fp8] [--json FILE]

On a CPU (`--quick`, the tests): tiny shapes, one call each, no second stream: it checks the code path only.
"""

import argparse
import importlib
import json
import time

import torch

from benchmarks.generation.bench_quant_linear import KINDS, make_weight

LAYER = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))  # N, K
QUICK = (("qkv", 48, 256), ("o", 32, 256), ("gate_up", 96, 256), ("down", 32, 384))


def _dequantizer(qw, rows):
    """A function making qw's [N, K] weight in 16 bits as quant_linear's prefill path does (its plan at `rows`)."""
    from tigon.ops import QuantLinearConfig

    ql = importlib.import_module("tigon.ops.quant_linear")  # the module (tigon.ops.quant_linear is also the op)

    N, K = qw.shape
    plan = ql._plan.__wrapped__(rows, N, K, qw.kind, qw.group_size, False, qw.data.device,
                                QuantLinearConfig(dequant_min_rows=1), False, qw.zeros is not None)
    code = ql.KIND_CODES[qw.kind]
    return lambda: ql._dequant(qw.data, qw.scales, qw.zeros, code, qw.group_size, (N, K), qw.dtype, plan)


def layer_fns(rows, kind, shapes, device, gen):
    """(serial, overlapped, floor): callables running one layer's four projections at `rows` rows."""
    dtype = torch.bfloat16
    xs = [torch.randn(rows, K, generator=gen, device=device).to(dtype) for _, _, K in shapes]
    qws = [make_weight(kind, N, K, dtype, device, gen) for _, N, K in shapes]
    w16 = [torch.randn(N, K, generator=gen, device=device).to(dtype) * 0.02 for _, N, K in shapes]
    deq = [_dequantizer(qw, rows) for qw in qws]
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def serial():
        return [torch.mm(x, d().t()) for x, d in zip(xs, deq)]

    def overlapped():
        if side is None:
            return serial()
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)  # fork: inside a capture, the second stream joins the graph here
        ready, ws = [], []
        with torch.cuda.stream(side):
            for d in deq:
                ws.append(d())
                ready.append(torch.cuda.Event())
                ready[-1].record(side)
        outs = []
        for x, w, ev in zip(xs, ws, ready):
            main.wait_event(ev)
            outs.append(torch.mm(x, w.t()))
        main.wait_stream(side)  # join; every weight stays referenced until here, so no block is reused early
        return outs

    def floor():
        return [torch.mm(x, w.t()) for x, w in zip(xs, w16)]

    return serial, overlapped, floor


def time_ms(fn, device) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    fn()  # compiles and allocates outside the capture
    torch.cuda.synchronize(device)
    return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))


def measure(rows_list, kinds, device, quick=False) -> list:
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for kind in kinds:
        for rows in rows_list:
            serial, overlapped, floor = layer_fns(rows, kind, QUICK if quick else LAYER, device, gen)
            if not quick:  # the two paths compute the same products
                for a, b in zip(serial(), overlapped()):
                    assert torch.equal(a, b), "prefill-overlap: the overlapped layer differs from the serial one"
            t = {name: time_ms(fn, device) for name, fn in (("serial", serial), ("overlapped", overlapped),
                                                             ("floor", floor))}
            cost = t["serial"] - t["floor"]
            hidden = (t["serial"] - t["overlapped"]) / cost if cost > 0 else float("nan")
            out.append(dict(kind=kind, rows=rows, serial_ms=t["serial"], overlapped_ms=t["overlapped"],
                            floor_ms=t["floor"], hidden=hidden))
            del serial, overlapped, floor
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def render(rows, device_name) -> str:
    lines = [f"Prefill dequantization under the GEMMs, one Llama-3-8B layer ({device_name}; CUDA-graph medians)", "",
             "| weights | rows | serial ms | overlapped ms | bf16 GEMMs ms | hidden share | 32 layers saved ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['rows']} | {r['serial_ms']:.3f} | {r['overlapped_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['hidden']:.0%} | {32 * (r['serial_ms'] - r['overlapped_ms']):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512, 4096], help="prompt rows (default 512 4096)")
    p.add_argument("--kinds", nargs="+", default=["int4", "fp8"], choices=sorted(KINDS),
                   help="weight formats (bench_quant_linear's names; default int4 fp8)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, one call each (the tests; any device)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if any(r < 1 for r in args.rows):
        p.error(f"--rows must be >= 1, got {args.rows}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        print("prefill-overlap times CUDA graphs and a second stream: it needs a CUDA GPU (--quick runs the code "
              "path on this device)")
        return 2
    with torch.inference_mode():
        rows = measure(args.rows, args.kinds, device, quick=args.quick)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(render(rows, name))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
