"""FlexAttention tile sweep: fwd and fwd+bwd time of compiled flex_attention per kernel_options, beside SDPA cuDNN's
dense causal rate on the same shape, to fill attention_table.FLEX_KERNEL_OPTIONS.

Shape (head 256, the Gemma-2 default): batch 8 x 2048 tokens, 8 query / 4 KV heads, causal, softcap 50, bf16;
--head 128: 1 x 8192 tokens, 32 / 8 heads. Forward configs are (BLOCK_M, BLOCK_N, num_stages, num_warps) timed
without grad; backward configs (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps) are timed as
fwd+bwd with the default forward. A config past shared memory reports inductor's error.

    PYTHONPATH=src python -m benchmarks sweep-flex [--head 256] [--budget 200] [--json OUT]
"""

import argparse
import json
import time

import torch

FWD = [None, (128, 64, 2, 8), (128, 32, 2, 8), (64, 64, 2, 4), (64, 64, 3, 8), (128, 64, 3, 8), (64, 32, 3, 4)]
BWD = [None, (64, 64, 64, 64, 2, 8), (32, 64, 64, 32, 2, 4), (32, 64, 64, 32, 2, 8), (64, 128, 128, 64, 2, 8),
       (32, 128, 128, 32, 2, 8), (64, 64, 64, 64, 1, 8), (32, 32, 32, 32, 2, 4), (64, 64, 64, 64, 3, 8)]


def options(fwd=None, bwd=None):
    out = {}
    if fwd:
        out.update(zip(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps"), fwd))
    if bwd:
        out.update(zip(("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_stages",
                        "bwd_num_warps"), bwd))
    return out


def main(argv=None):
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", type=int, default=256)
    p.add_argument("--budget", type=float, default=200.0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    b, hq, hk, t = (8, 8, 4, 2048) if a.head == 256 else (1, 32, 8, 8192)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, a.head, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (hq, hk, hk))
    go = torch.randn(b, hq, t, a.head, device="cuda", generator=g, dtype=torch.bfloat16)
    block_mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, t, t, device="cuda")
    flops = 4 * b * hq * a.head * t * (t + 1) / 2  # forward; fwd+bwd is 3.5x

    def softcap(s, b_, h_, qi, ki):
        return 50.0 * torch.tanh(s / 50.0)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(go)

    ms = bench(cudnn)
    rows = [dict(what="SDPA cuDNN dense causal fwd+bwd (no softcap)", ms=ms, tflops=3.5 * flops / ms / 1e9)]
    print(rows[-1], flush=True)
    deadline = time.time() + a.budget
    for kind, cfg in [("fwd", c) for c in FWD] + [("fwd+bwd", c) for c in BWD]:
        if time.time() > deadline:
            break
        torch._dynamo.reset()
        opts = options(**{"fwd" if kind == "fwd" else "bwd": cfg})
        f = torch.compile(flex_attention)

        def run(f=f, kind=kind, opts=opts):
            with torch.set_grad_enabled(kind != "fwd"):
                o = f(q, k, v, score_mod=softcap, block_mask=block_mask, enable_gqa=True, kernel_options=opts)
                if kind != "fwd":
                    o.backward(go)

        row = dict(what=f"{kind} {cfg or 'inductor default'}")
        try:
            t0 = time.time()
            run()
            row["compile_s"] = round(time.time() - t0, 1)
            row["ms"] = bench(run)
            row["tflops"] = (1 if kind == "fwd" else 3.5) * flops / row["ms"] / 1e9
        except Exception as e:  # noqa: BLE001 (a config past shared memory: inductor's error is the result)
            row["error"] = str(e).strip().splitlines()[0][:200]
        rows.append(row)
        print(row, flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, head=a.head, rows=rows), fh,
                      indent=1)


if __name__ == "__main__":
    main()
