"""First-call cost of torch's SDPA backends at shapes the process has not run, beside their warm time: what the
prefill's attention pays at a new prompt length or a new ring capacity (GPU).

The Llama-3-8B prefill's attention: q [1, 32, P, 128] contiguous, K/V with 8 heads, causal, GQA, bf16. K/V are
either contiguous [1, 8, P, 128] or the first P slots of a ring [1, 8, C, 128] (what `RollingKVLayer.update_rope`
hands the prefill: its strides depend on the capacity C). For each backend and case: the wall time of the first
call, synced (it holds whatever the backend builds for that shape), and do_bench's median after. Each backend
gets lengths of its own, so that none finds a shape another backend already ran; within a backend, the three
layouts at one P run in the order below, so the second and third tell whether new strides alone cost a build.

    PYTHONPATH=src python -m benchmarks sdpa-new-shapes [--lengths 512,8192] [--json FILE]
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

NQ, NKV, D = 32, 8, 128
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def layouts(p):
    """(name, K/V slots allocated) of the three layouts at prompt length p."""
    return (("contiguous", p), ("ring C = P + 1", p + 1), ("ring C = P + 256", p + 256))


def attention(backend, q, k, v):
    if BACKENDS[backend] is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def case(backend, p, slots):
    dev = torch.device("cuda")
    q = torch.randn(1, NQ, p, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, NKV, slots, D, device=dev, dtype=torch.bfloat16)[:, :, :p] for _ in range(2))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    attention(backend, q, k, v)
    torch.cuda.synchronize()
    first_ms = 1e3 * (time.perf_counter() - t0)
    warm_ms = triton.testing.do_bench(lambda: attention(backend, q, k, v), warmup=10, rep=50)
    return dict(backend=backend, prompt=p, slots=slots, first_ms=round(first_ms, 2), warm_ms=round(warm_ms, 4))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,8192", help="base prompt lengths, comma-separated")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sdpa_new_shapes: needs a CUDA GPU (the backends it times are CUDA kernels)")
        return 2
    rows = []
    print("| backend | P | K/V layout | first call ms | warm ms |\n|---|---|---|---|---|")
    with torch.no_grad():
        for j, backend in enumerate(BACKENDS):
            for base in (int(x) for x in a.lengths.split(",")):
                p = base - 1 - 3 * j  # lengths of this backend's own
                for name, slots in layouts(p):
                    try:
                        row = dict(case(backend, p, slots), layout=name)
                    except Exception as e:  # a backend this build or shape lacks is a row, not a crash
                        row = dict(backend=backend, prompt=p, slots=slots, layout=name,
                                   error=f"{type(e).__name__}: {str(e)[:160]}")
                    rows.append(row)
                    print(f"| {backend} | {p} | {name} | {row.get('first_ms', row.get('error'))} | "
                          f"{row.get('warm_ms', '-')} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
