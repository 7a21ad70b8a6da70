"""Host time per op of one prefill layer at the Llama-3-8B shape (B 1, prompt 512), and the GPU time of the
attention backends: where a host-bound prefill's time to first token goes, op by op (GPU).

Host time = wall time of n back-to-back calls without a sync, over n (the GPU queue never fills: n x the
launches stays far under its depth), so it is what the host spends to enqueue one call. GPU time =
triton.testing.do_bench's median.

    PYTHONPATH=src python -m benchmarks prefill-host [--tokens 512] [--json FILE]
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from tigon import ops
from tigon.ops.rms_norm import rms_norm_rows
from tigon.ops.swiglu import glu_rows

H, I, NQ, NKV, D = 4096, 14336, 32, 8, 128  # Llama-3-8B
BF16 = torch.bfloat16


@triton.jit
def _noop_kernel(X, N, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(X + o, tl.load(X + o, mask=o < N), mask=o < N)


def host_us(fn, n=60):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return round(1e6 * host, 1)


def device_us(fn):
    return round(1e3 * triton.testing.do_bench(fn, warmup=25, rep=200), 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    t = a.tokens
    x = torch.randn(t, H, device=dev, dtype=BF16)
    wq, wk = (torch.randn(n, H, device=dev, dtype=BF16) * 0.02 for n in (NQ * D, NKV * D))
    wn = torch.ones(H, device=dev, dtype=BF16)
    g, u = (torch.randn(t, I, device=dev, dtype=BF16) for _ in range(2))
    q = torch.randn(1, NQ, t, D, device=dev, dtype=BF16)
    k, v = (torch.randn(1, NKV, t, D, device=dev, dtype=BF16) for _ in range(2))
    small = torch.zeros(16, device=dev)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    cases = {
        "linear q [t,4096]x[4096,4096]": lambda: F.linear(x, wq),
        "linear k [t,4096]x[1024,4096]": lambda: F.linear(x, wk),
        "torch add": lambda: x + x,
        "torch empty": lambda: torch.empty_like(x),
        "view": lambda: x.view(1, t, -1, D),
        "sdpa default (enable_gqa)": sdpa,
        "sdpa flash (enable_gqa)": flash,
        "sdpa cudnn (enable_gqa)": cudnn,
        "tigon rms_norm": lambda: ops.rms_norm(x, wn, 1e-5),
        "tigon add_rms_norm": lambda: ops.add_rms_norm(x, x, wn, 1e-5),
        "tigon swiglu": lambda: ops.swiglu(g, u),
        "tigon rms_norm_rows (unchecked)": lambda: rms_norm_rows(x, wn, 1e-5),
        "tigon rms_norm_rows + residual": lambda: rms_norm_rows(x, wn, 1e-5, residual=x),
        "tigon glu_rows (unchecked)": lambda: glu_rows(g, u, "silu"),
        "triton no-op kernel (3 args)": lambda: _noop_kernel[(1,)](small, 16, BLOCK=16),
    }
    out = {"tokens": t, "host_us": {}, "device_us": {}}
    with torch.no_grad():
        for name, fn in cases.items():
            try:
                out["host_us"][name] = host_us(fn)
            except Exception as e:  # a backend this build lacks is a row, not a crash
                out["host_us"][name] = f"error: {type(e).__name__}: {str(e)[:120]}"
            print(f"host  {name:34s} {out['host_us'][name]}", flush=True)
        for tt in sorted({t, 8192}):
            q, k, v = (torch.randn(1, n, tt, D, device=dev, dtype=BF16) for n in (NQ, NKV, NKV))
            for name, fn in (("default", sdpa), ("flash", flash), ("cudnn", cudnn)):
                try:
                    us = device_us(fn)
                except Exception as e:
                    us = f"error: {type(e).__name__}"
                out["device_us"][f"sdpa {name} T={tt}"] = us
                print(f"device sdpa {name:8s} T={tt}: {us}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
