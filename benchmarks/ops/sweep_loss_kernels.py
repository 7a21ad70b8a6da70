"""The fused-linear losses' row kernels (ops/losses: `_stats_kernel`, `_grad_kernel`, `_jsd_kernel`) over their
launch settings, on one chunk of logits at the bench shapes, then the whole losses with the best settings.

Each kernel runs one program per row of a [C, V] bf16 chunk (C = 512 rows, V = 128256: the 128 MiB chunk of
the default config). Byte model (each element once): stats reads the chunk (C V 2 bytes), grad reads and writes
it (2 C V 2), JSD reads the student and teacher chunks and writes the student's gradient (3 C V 2). Times are
triton.testing.do_bench medians (L2 flushed between calls); GB/s of the byte model as a fraction of a D2D copy
measured in the same run. The whole losses are bench_losses.py's tigon calls (fwd+bwd) timed the same way.

    PYTHONPATH=src python -m benchmarks sweep-loss-kernels [--out FILE.md] [--rows 512] [--vocab 128256]
"""

import argparse
import itertools
import sys

import torch
import triton

BLOCKS = (2048, 4096, 8192, 16384)
WARPS = (4, 8, 16, 32)


def _copy_gbps():
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=100)
    return 2 * n / ms / 1e6


def _kernels(C, V):
    from tigon.ops.losses import _engine, distill

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(C, V, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    zt = torch.randn(C, V, device="cuda", dtype=torch.bfloat16, generator=g) * 2
    t = torch.randint(0, V, (C,), device="cuda", generator=g)
    f32 = [torch.empty(C, device="cuda") for _ in range(7)]
    lse = torch.logsumexp(x.float(), -1)
    ent = torch.rand(C, device="cuda")
    a = torch.randn(C, device="cuda")
    n = torch.full((1,), float(C), device="cuda")
    work = x.clone()

    def stats(bv, nw):
        return lambda: _engine._stats_kernel[(C,)](x, t, t, *f32, x.stride(0), V, 1.0, HAS_T2=False, BLOCK_V=bv,
                                                   num_warps=nw)

    def grad(bv, nw):
        return lambda: _engine._grad_kernel[(C,)](work, t, t, lse, ent, a, a, a, work.stride(0), V, 1.0,
                                                  HAS_T2=False, HAS_E=True, BLOCK_V=bv, num_warps=nw)

    def jsd(bv, nw):
        return lambda: distill._jsd_kernel[(C,)](work, zt, t, f32[0], f32[1], n, work.stride(0), zt.stride(0), V,
                                                 -100, 1.0, 0.5, 0.5, 0.5, MODE=2, BLOCK_V=bv, UNTEMPERED=True,
                                                 FAST_LOG=True, num_warps=nw)  # the op's path at temperature 1

    return {"stats": (stats, C * V * 2), "grad": (grad, 2 * C * V * 2), "jsd": (jsd, 3 * C * V * 2)}


def _whole(cfg):
    """ms of bench_losses' tigon fwd+bwd calls (dpo, grpo, jsd) with `cfg` as their config."""
    import functools

    from benchmarks.ops.profile_losses import run_call, tigon_call
    from tigon import ops

    out = {}
    for k in ("dpo", "grpo", "jsd"):
        name = f"fused_linear_{k}"
        real = getattr(ops, name)
        setattr(ops, name, functools.partial(real, config=cfg))  # bench_losses reads ops.<name> at call time
        try:
            out[k] = triton.testing.do_bench(functools.partial(run_call, tigon_call(k)), warmup=2, rep=300)
        finally:
            setattr(ops, name, real)
        torch.cuda.empty_cache()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--out", default=None)
    p.add_argument("--no-whole", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_loss_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    from tigon.ops.losses._engine import FusedLinearLossConfig

    ceiling = _copy_gbps()
    lines = [f"# Loss row kernels on {torch.cuda.get_device_name()}: [{a.rows}, {a.vocab}] bf16 chunk",
             "", f"D2D copy ceiling in this run: {ceiling:.0f} GB/s", "",
             "| kernel | BLOCK_V | num_warps | us | GB/s | % of copy |", "|---|---|---|---|---|---|"]
    best = {}
    for name, (make, nbytes) in _kernels(a.rows, a.vocab).items():
        for bv, nw in itertools.product(BLOCKS, WARPS):
            try:
                ms = triton.testing.do_bench(make(bv, nw), warmup=3, rep=60)
            except Exception as e:  # noqa: BLE001  (out of resources for this tile: a row note)
                lines.append(f"| {name} | {bv} | {nw} | {type(e).__name__} | | |")
                continue
            gbps = nbytes / ms / 1e6
            lines.append(f"| {name} | {bv} | {nw} | {ms * 1e3:.0f} | {gbps:.0f} | {100 * gbps / ceiling:.0f}% |")
            if name not in best or ms < best[name][0]:
                best[name] = (ms, bv, nw)
        print("\n".join(lines[-len(BLOCKS) * len(WARPS):]), flush=True)
    lines += ["", "Best per kernel: " + ", ".join(f"{k} BLOCK_V {v[1]} warps {v[2]} ({v[0] * 1e3:.0f} us)"
                                                 for k, v in best.items())]
    if not a.no_whole:
        # the default: each kernel's own launch defaults (block_v / num_warps 0); a set value applies to all three
        cfgs = {"default": FusedLinearLossConfig()}
        for k, (_, bv, nw) in best.items():
            cfgs[f"best of {k}"] = FusedLinearLossConfig(block_v=bv, num_warps=nw)
        lines += ["", "Whole losses, fwd+bwd ms (bench_losses.py shapes):", "",
                  "| config | dpo | grpo | jsd |", "|---|---|---|---|"]
        for label, cfg in cfgs.items():
            w = _whole(cfg)
            lines.append(f"| {label} ({cfg}) | {w['dpo']:.1f} | {w['grpo']:.1f} | {w['jsd']:.1f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
