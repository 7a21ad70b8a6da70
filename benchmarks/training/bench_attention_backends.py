"""Which SDPA backend trains the end-to-end config's attention fastest (fwd + bwd, causal, bf16).

The 1.5B Llama of bench_e2e: batch 8 x 2048, 32 query heads, 8 KV heads, head_dim 64. Times every backend
PyTorch has for that shape side by side (median GPU time, random data, L2 flushed by do_bench), with K/V
given both repeated to 32 heads (what HF's sdpa path does) and as 8 heads with enable_gqa=True, and checks
each backend's output and gradients against the math backend in fp32.

    PYTHONPATH=src python -m benchmarks attention-backends --out DIR
"""

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.tools.checkout import DEFAULT_OUT


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    a = p.parse_args(argv)
    from triton.testing import do_bench

    torch.manual_seed(0)
    B, T, H, Hk, D = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hk, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hk, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    go = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    flops = 4 * B * H * T * T * D / 2 * 3.5  # causal: half the square; bwd = 2.5x fwd

    def run(backend, gqa):
        def step():
            kk, vv = (k, v) if gqa else (k.repeat_interleave(H // Hk, 1), v.repeat_interleave(H // Hk, 1))
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
            return torch.autograd.grad(o, (q, k, v), go)
        return step

    with sdpa_kernel([SDPBackend.MATH]):
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        of = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, enable_gqa=True)
        ref = torch.autograd.grad(of, (qf, kf, vf), go.float())
    rows = []
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        for gqa in (False, True):
            row = dict(backend=name, gqa=gqa)
            try:
                got = run(backend, gqa)()
                row["max_rel_err"] = max(float((g.float() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref))
                ms = do_bench(run(backend, gqa), return_mode="median")
                row.update(ms=ms, tflops=flops / ms / 1e9)
            except Exception as e:  # a backend that does not take this shape says why
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(row, flush=True)
    md = [f"SDPA fwd+bwd, q [{B}, {H}, {T}, {D}], k/v {Hk} heads, causal, bf16 ({torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}); GQA=False repeats K/V to {H} heads as HF's sdpa path does.", "",
          "| backend | enable_gqa | ms | TFLOP/s | max rel err vs fp32 math |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['backend']} | {r['gqa']} | {r['error']} | | |")
        else:
            md.append(f"| {r['backend']} | {r['gqa']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['max_rel_err']:.1e} |")
    print("\n".join(md))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "attention_backends.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "attention_backends.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
