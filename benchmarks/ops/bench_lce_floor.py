"""Where the fused linear cross-entropy's floor lies inside a memory budget, at the Llama-3-8B head
(h [16384, 4096], W [128256, 4096] bf16, mean): everything timed in one process on the GPU.

- torch.compile of HF's path (the [N, V] logits built whole) and tigon.ops.linear_cross_entropy, fwd + bwd;
- the three GEMMs at full size (logits = h W^T, dh = g W, dW = g^T h with K = 16384), what torch.compile runs;
- the same three GEMMs at the chunk the op uses inside its 1.3 GiB (768 rows; dW accumulates: addmm into a bf16
  dW, and the plain product for comparison), times the number of chunks; also with the operands ordered the
  other way (dW^T = h^T g, a [V, C] chunk) and with dh and dW of a chunk on two streams;
- the cross-entropy row kernel alone over one chunk (gradient in place), times the number of chunks.

The floor of a chunked op is its chunk GEMMs plus the row kernel's bytes at the copy ceiling (also timed here);
issue #15 asks <= 0.95 x torch.compile. Prints one JSON object per line and a summary.

    PYTHONPATH=src python -m benchmarks lce-floor [--rows 768,1024,2048] [--out FILE]
"""

import argparse
import json
import sys

import torch
import triton

N, H, V = 16384, 4096, 128256


def bench(fn, rep=300):
    return triton.testing.do_bench(fn, warmup=25, rep=rep)  # median ms, L2 cleared before each run


def _ceilings(emit, dev):
    sq = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: sq @ sq)
    emit(what="ceiling: 8192^3 bf16 GEMM", ms=ms, tflops=2 * 8192 ** 3 / ms / 1e9)
    src, dst = (torch.empty(1 << 30, dtype=torch.uint8, device=dev) for _ in range(2))
    ms = bench(lambda: dst.copy_(src))
    emit(what="ceiling: 1 GiB device copy", ms=ms, gb_s=2 * (1 << 30) / ms / 1e6)
    return 2 * (1 << 30) / ms / 1e6


def _full_gemms(emit, hd, wd):
    lg = torch.empty(N, V, device=hd.device, dtype=hd.dtype)
    full = {"logits": lambda: torch.mm(hd, wd.t(), out=lg), "dh": lambda: lg @ wd, "dW": lambda: lg.t() @ hd}
    out = {k: bench(fn) for k, fn in full.items()}
    for k, v in out.items():
        emit(what=f"full-size GEMM {k}", ms=v, tflops=2.0 * N * H * V / v / 1e9)
    return out


def _chunk(emit, C, hd, wd, t, dW, dWt, side, copy_gbs, gen):
    """The chunk GEMMs (several operand orders) and the row kernel at C rows: a summary dict."""
    from tigon.ops.cross_entropy import launch as ce_launch

    chunks = N / C
    hc = hd[:C]
    g = (1e-3 * torch.randn(C, V, device=hd.device, generator=gen)).to(hd.dtype)
    gT = g.t().contiguous()
    logits, dh = torch.empty_like(g), torch.empty(C, H, device=hd.device, dtype=hd.dtype)

    def two_streams():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            dW.addmm_(g.t(), hc)
        torch.mm(g, wd, out=dh)
        cur.wait_stream(side)

    cases = {
        "logits": lambda: torch.mm(hc, wd.t(), out=logits),
        "dh": lambda: torch.mm(g, wd, out=dh),
        "dW accumulate": lambda: dW.addmm_(g.t(), hc),
        "dW plain": lambda: torch.mm(g.t(), hc, out=dW),
        "dW^T accumulate (h^T g)": lambda: dWt.addmm_(hc.t(), g),
        "dW accumulate from a [V, C] chunk": lambda: dW.addmm_(gT, hc),
        "dh + dW accumulate, two streams": two_streams,
    }
    got = {k: bench(fn) for k, fn in cases.items()}
    for k, v in got.items():
        emit(what=f"chunk GEMM {k}", rows=C, ms=v, ms_per_op=v * chunks,
             tflops=None if "two" in k else 2.0 * C * H * V / v / 1e9)
    x, loss = torch.randn_like(g), torch.empty(C, device=hd.device, dtype=torch.float32)
    ce_ms = bench(lambda: ce_launch(x, t[:C], loss, x, None, None, ignore_index=-100, label_smoothing=0.0,
                                    z_loss_scale=0.0, softcap=0.0))
    floor = chunk_floor(C, got, ce_ms, copy_gbs)
    emit(what="row kernel over a chunk (gradient in place)", rows=C, ms=ce_ms, ms_per_op=floor["row_kernel_ms"],
         gb_s=2 * C * V * 2 / ce_ms / 1e6, copy_ceiling_ms_per_op=floor["row_kernel_at_ceiling_ms"])
    return floor


def chunk_floor(C, gemm_ms, ce_ms, copy_gbs, n=N, h=H, v=V, itemsize=2):
    """The op's floor at C-row chunks from the times of one chunk: its three GEMMs (logits, dh, the accumulating
    dW) times the chunks, plus the row kernel's bytes (read + write the chunk) at the copy ceiling; and the peak
    the op adds (dh + dW + one chunk), MiB."""
    chunks = n / C
    gemms = (gemm_ms["logits"] + gemm_ms["dh"] + gemm_ms["dW accumulate"]) * chunks
    at_ceiling = 2 * n * v * itemsize / (copy_gbs * 1e6)
    return dict(chunk_gemms_ms=gemms, row_kernel_ms=ce_ms * chunks, row_kernel_at_ceiling_ms=at_ceiling,
                floor_ms=gemms + at_ceiling, peak_extra_mib=(n * h + v * h + C * v) * itemsize / 2 ** 20)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="768,1024,2048", help="chunk rows to time the GEMMs at")
    p.add_argument("--out", help="write the JSON lines here too")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_lce_floor: needs a CUDA GPU")
    from benchmarks.ops.bench_cross_entropy import flce_eager  # HF's path, the one bench_cross_entropy compiles
    from tigon.ops import linear_cross_entropy
    from tigon.ops.linear_cross_entropy import chunk_rows

    rows_out = []

    def emit(**row):
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(N, H, device=dev, generator=gen).to(bf16).requires_grad_()
    w = (0.02 * torch.randn(V, H, device=dev, generator=gen)).to(bf16).requires_grad_()
    t = torch.randint(0, V, (N,), device=dev, generator=gen)
    copy_gbs = _ceilings(emit, dev)

    tigon_ms = bench(lambda: torch.autograd.grad(linear_cross_entropy(h, w, t), (h, w)), rep=1500)
    emit(what="tigon linear_cross_entropy fwd+bwd", ms=tigon_ms, chunk_rows=chunk_rows(N, V, 2))
    f = torch.compile(flce_eager, dynamic=False)
    torch.autograd.grad(f(h, w, t), (h, w))
    compile_ms = bench(lambda: torch.autograd.grad(f(h, w, t), (h, w)), rep=1500)
    emit(what="torch.compile fwd+bwd", ms=compile_ms)
    torch._dynamo.reset()

    full_ms = _full_gemms(emit, h.detach(), w.detach())
    dW, dWt = torch.zeros(V, H, device=dev, dtype=bf16), torch.zeros(H, V, device=dev, dtype=bf16)
    side = torch.cuda.Stream()
    summary = {C: _chunk(emit, C, h.detach(), w.detach(), t, dW, dWt, side, copy_gbs, gen)
               for C in (int(r) for r in a.rows.split(","))}
    emit(what="summary", tigon_ms=tigon_ms, compile_ms=compile_ms, target_ms=0.95 * compile_ms,
         full_gemms_ms=sum(full_ms.values()), by_rows=summary)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(json.dumps(r) for r in rows_out) + "\n")


if __name__ == "__main__":
    sys.exit(main())
