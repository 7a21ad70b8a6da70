"""Sweep the launch settings of the bandwidth-bound kernels at the benchmark shapes (GPU), and profile
where the host time of one small-op fwd+bwd goes. Each setting is a frozen config passed to the op
(`tigon.ops.config`); the winners become the configs' defaults.

    PYTHONPATH=src python -m benchmarks tune [--out DIR]
        [--ops rms_norm,rms_norm_heads,rms_norm_hidden,qk_norm_rope,rope,glu,ce,flce]
"""

import argparse
import cProfile
import dataclasses
import importlib
import io
import itertools
import json
import os
import pstats
import time

import torch

from benchmarks.ops import bench_norms
from benchmarks.tools import harness as H
from benchmarks.tools.checkout import DEFAULT_OUT
from tigon.ops.config import (
    CrossEntropyConfig,
    GLUConfig,
    LinearCrossEntropyConfig,
    QKNormRopeConfig,
    RMSNormConfig,
    RopeConfig,
)

BF16 = torch.bfloat16


def _fb(fn, inputs, grads_out):
    def run():
        out = fn()
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(out, inputs, grads_out[: len(out)])
    return run


def _time(ctx, fn):
    return H.bench(ctx, fn, min_rep=10, max_rep=20, rep_ms=100.0)["ms"] * 1e3


def sweep(ctx, config_cls, grid, make, fb=True, tag=None):
    """Time fwd and fwd+bwd for each config of `config_cls` with the fields in `grid` (the others default; or a
    list of field dicts, one per config); make(config) returns the (fwd, fwd+bwd) callables that pass it to the
    op. fb=False: the forward alone. tag: merged into every row."""
    settings = grid if isinstance(grid, list) else [dict(zip(grid, v)) for v in itertools.product(*grid.values())]
    rows = []
    for fields in settings:
        config = config_cls(**fields)
        fwd, fwd_bwd = make(config)
        row = {**(tag or {}), **dataclasses.asdict(config)}
        try:
            row.update(fwd_us=_time(ctx, fwd))
            if fb:
                row.update(fb_us=_time(ctx, fwd_bwd))
        except Exception as e:  # a setting that does not compile (too many registers) is a row, not a crash
            row.update(error=H.short_error(e))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def tune_rms_norm(ctx):
    m = importlib.import_module("tigon.ops.rms_norm")

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16384, 4096, device="cuda", generator=g).to(BF16).requires_grad_()
    r = torch.randn(16384, 4096, device="cuda", generator=g).to(BF16).requires_grad_()
    w = (1 + 0.1 * torch.randn(4096, device="cuda", generator=g)).to(BF16).requires_grad_()
    dy = torch.randn_like(x)
    def plain(c):
        f = lambda: m.rms_norm(x, w, config=c)
        return f, _fb(f, (x, w), (dy,))

    def add(c):
        f = lambda: m.add_rms_norm(x, r, w, config=c)
        return f, _fb(f, (x, r, w), (dy, dy))

    grid = {"fwd_warps": [4, 8, 16], "bwd_warps": [4, 8, 16], "bwd_per_sm": [1, 2, 4, 8]}
    return {"rms_norm": sweep(ctx, RMSNormConfig, grid, plain),
            "add_rms_norm": sweep(ctx, RMSNormConfig, {"fwd_warps": [4, 8, 16], "bwd_warps": [8, 16],
                                                       "bwd_per_sm": [2, 4]}, add)}


def tune_rms_norm_heads(ctx):
    """rms_norm over head_dim (the QK-norm: 524288 rows of 64, 128, 256): rows per tile x warps x backward
    programs per SM; the first row of each head is the default launch."""
    m = importlib.import_module("tigon.ops.rms_norm")
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for h in (64, 128, 256):
        x = torch.randn(524288, h, device="cuda", generator=g).to(BF16).requires_grad_()
        w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(BF16).requires_grad_()
        dy = torch.randn_like(x)

        def make(c, x=x, w=w, dy=dy):
            f = lambda: m.rms_norm(x, w, config=c)
            return f, _fb(f, (x, w), (dy,))

        grid = [{}] + [dict(tile_elems=t, fwd_warps=nw, bwd_warps=nw, bwd_per_sm=p)
                       for t in (2048, 4096, 8192) for nw in (4, 8) for p in (2, 4, 8)]
        out[f"head_{h}"] = sweep(ctx, RMSNormConfig, grid, make)
        del x, w, dy
    return out


def tune_rms_norm_hidden(ctx):
    """rms_norm at the hidden sizes of 0.5-1.5B models (64M elements: 65536 x 1024, 32768 x 2048), where the
    default backward (one row a loop step, 2 programs an SM) ran at 1.41x / 1.67x torch.compile's fwd+bwd (H100 /
    H200) at 1024: one row a step with more programs or warps, and tiles of rows; the first row is the default."""
    m = importlib.import_module("tigon.ops.rms_norm")
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for h in (1024, 2048):
        x = torch.randn((1 << 26) // h, h, device="cuda", generator=g).to(BF16).requires_grad_()
        w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(BF16).requires_grad_()
        dy = torch.randn_like(x)

        def make(c, x=x, w=w, dy=dy):
            f = lambda: m.rms_norm(x, w, config=c)
            return f, _fb(f, (x, w), (dy,))

        grid = ([{}] + [dict(bwd_warps=nw, bwd_per_sm=p) for nw in (2, 4, 8) for p in (2, 4, 8, 16)]
                + [dict(tile_elems=t, fwd_warps=nw, bwd_warps=nw, bwd_per_sm=p)
                   for t in (2 * h, 4 * h, 8 * h) for nw in (4, 8) for p in (2, 4, 8)])
        out[f"hidden_{h}"] = sweep(ctx, RMSNormConfig, grid, make)
        del x, w, dy
    return out


# qk_norm_rope at Qwen3's attention input: 8 x 2048 tokens, 32 q heads, 8 kv heads (q, k views of the projections)
QK_SHAPE = dict(B=8, T=2048, Hq=32, Hk=8)
QK_HEAD_DIMS = (64, 128)
QK_TILES, QK_WARPS = (1024, 2048, 4096, 8192), (2, 4, 8)


def tune_qk_norm_rope(ctx):
    """qk_norm_rope's QKNormRopeConfig at head_dim 64 and 128. The forward and backward are separate kernels that
    share only tile_elems, so the grid is factored: "fwd" rows time the forward alone over tile x fwd_warps (12),
    "bwd" rows time fwd and fwd+bwd over tile x bwd_warps (12, fwd_warps at its default; the backward is fb_us -
    fwd_us); "best" is the tile whose best forward + best backward is lowest, timed as one config beside the
    "default" row (the first). 26 settings a head size instead of the full product's 36."""
    m = importlib.import_module("tigon.ops.qk_norm_rope")
    dev = ctx.device
    g = torch.Generator(device=dev).manual_seed(0)
    B, T, Hq, Hk = QK_SHAPE["B"], QK_SHAPE["T"], QK_SHAPE["Hq"], QK_SHAPE["Hk"]
    out = {}
    for D in QK_HEAD_DIMS:
        qp = torch.randn(B, T, Hq * D, device=dev, generator=g).to(BF16).requires_grad_()
        kp = torch.randn(B, T, Hk * D, device=dev, generator=g).to(BF16).requires_grad_()
        wq = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(BF16).requires_grad_()
        wk = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(BF16).requires_grad_()
        cos, sin = bench_norms._qwen3_cos_sin(ctx, B, T, D)
        dq = torch.randn(B, T, Hq, D, device=dev, generator=g).to(BF16)
        dk = torch.randn(B, T, Hk, D, device=dev, generator=g).to(BF16)

        def make(c, qp=qp, kp=kp, wq=wq, wk=wk, cos=cos, sin=sin, dq=dq, dk=dk, D=D):
            f = lambda: m.qk_norm_rope(qp.view(B, T, Hq, D), kp.view(B, T, Hk, D), wq, wk, cos, sin, config=c)
            return f, _fb(f, (qp, kp, wq, wk), (dq, dk))

        rows = sweep(ctx, QKNormRopeConfig, [{}], make, tag={"stage": "default"})
        rows += sweep(ctx, QKNormRopeConfig, {"tile_elems": QK_TILES, "fwd_warps": QK_WARPS}, make, fb=False,
                      tag={"stage": "fwd"})
        rows += sweep(ctx, QKNormRopeConfig, {"tile_elems": QK_TILES, "bwd_warps": QK_WARPS}, make,
                      tag={"stage": "bwd"})
        for r in rows:
            if r["stage"] == "bwd" and "fb_us" in r:
                r["bwd_us"] = r["fb_us"] - r["fwd_us"]
        best = _qk_best(rows)
        if best is not None:
            fields, predicted = best
            rows += sweep(ctx, QKNormRopeConfig, [fields], make, tag={"stage": "best", "predicted_fb_us": predicted})
        out[f"head_{D}"] = rows
        del qp, kp, wq, wk, cos, sin, dq, dk
    return out


def _qk_best(rows):
    """(config fields, predicted fwd+bwd us) of the tile with the lowest best-forward + best-backward, or None."""
    best = None
    for tile in {r["tile_elems"] for r in rows}:
        fwd = [r for r in rows if r["stage"] == "fwd" and r["tile_elems"] == tile and "fwd_us" in r]
        bwd = [r for r in rows if r["stage"] == "bwd" and r["tile_elems"] == tile and "bwd_us" in r]
        if not fwd or not bwd:
            continue
        f = min(fwd, key=lambda r: r["fwd_us"])
        b = min(bwd, key=lambda r: r["bwd_us"])
        predicted = f["fwd_us"] + b["bwd_us"]
        if best is None or predicted < best[1]:
            best = (dict(tile_elems=tile, fwd_warps=f["fwd_warps"], bwd_warps=b["bwd_warps"]), predicted)
    return best


def tune_rope(ctx):
    m = importlib.import_module("tigon.ops.rope")

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 4096, 32, 128, device="cuda", generator=g).to(BF16).transpose(1, 2).requires_grad_()
    k = torch.randn(4, 4096, 8, 128, device="cuda", generator=g).to(BF16).transpose(1, 2).requires_grad_()
    ang = torch.arange(4096, device="cuda")[:, None] * 500000.0 ** (-torch.arange(0, 128, 2, device="cuda") / 128)
    ang = torch.cat([ang, ang], -1)[None].expand(4, -1, -1)
    cos, sin = ang.cos().to(BF16).contiguous(), ang.sin().to(BF16).contiguous()
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    def make(c):
        f = lambda: m.apply_rope(q, k, cos, sin, config=c)
        return f, _fb(f, (q, k), (dq, dk))

    return {"rope": sweep(ctx, RopeConfig, {"num_warps": [1, 2, 4, 8], "tile": [512, 1024, 2048, 4096]}, make)}


def tune_glu(ctx):
    m = importlib.import_module("tigon.ops.swiglu")

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(16384, 14336, device="cuda", generator=g).to(BF16).requires_grad_()
    b = torch.randn(16384, 14336, device="cuda", generator=g).to(BF16).requires_grad_()
    dy = torch.randn_like(a)
    out = {}
    for name in ("swiglu", "geglu"):
        def make(c, name=name):
            f = lambda: getattr(m, name)(a, b, config=c)
            return f, _fb(f, (a, b), (dy,))

        out[name] = sweep(ctx, GLUConfig, {"tile_bytes": [4096, 8192, 16384, 32768], "num_warps": [4, 8, 16]}, make)
    return out


def tune_ce(ctx):
    """The row kernel at the CE op's shape [4096, 128256] and at the fused linear CE's chunks (768 rows of the
    8B head's vocabulary, 1024 of Gemma-3's): tile, warps, L2 hints."""
    m = importlib.import_module("tigon.ops.cross_entropy")
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    shapes = {"cross_entropy": ((4096, 128256), {"block_v": [8192, 16384, 32768], "num_warps": [16, 32],
                                                 "l2_hints": [True, False]}),
              "chunk 768 x 128256": ((768, 128256), {"block_v": [8192, 16384], "num_warps": [8, 16]}),
              "chunk 1024 x 262144": ((1024, 262144), {"block_v": [8192], "num_warps": [16]})}
    for name, (shape, grid) in shapes.items():
        logits = torch.randn(*shape, device="cuda", generator=g).to(BF16).requires_grad_()
        target = torch.randint(0, shape[1], (shape[0],), device="cuda", generator=g)

        def make(c, logits=logits, target=target):
            f = lambda: m.cross_entropy(logits, target, config=c)
            return f, _fb(f, (logits,), (None,))

        out[name] = sweep(ctx, CrossEntropyConfig, grid, make)
        del logits
    return out


def tune_flce(ctx):
    """Chunk size against time and peak at three lm_head shapes (Llama-3-8B's, the 1.5B e2e model's, Gemma-3's),
    and the kernel time by name at the default chunk: how much the dW read-modify-write costs."""
    m = importlib.import_module("tigon.ops.linear_cross_entropy")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for H_, V_ in ((4096, 128256), (2048, 128256), (2304, 262144)):
        h = torch.randn(16384, H_, device="cuda", generator=g).to(BF16).requires_grad_()
        w = (0.02 * torch.randn(V_, H_, device="cuda", generator=g)).to(BF16).requires_grad_()
        t = torch.randint(0, V_, (16384,), device="cuda", generator=g)
        for chunk_mib in (128, 192, 256, 384, 512):
            cfg = LinearCrossEntropyConfig(chunk_bytes=chunk_mib << 20)
            fn = lambda cfg=cfg, h=h, w=w, t=t: torch.autograd.grad(m.linear_cross_entropy(h, w, t, config=cfg),
                                                                    (h, w))
            try:
                ms = H.bench(ctx, fn, min_rep=3, max_rep=4, rep_ms=100.0, passes=1)["ms"]
                peak = H.peak_mib(ctx, fn)  # the arena released first: the chunk it lends counts
                row = dict(hidden=H_, vocab=V_, chunk_mib=chunk_mib, fb_ms=ms, peak_mib=peak)
                if chunk_mib == 192:
                    row["kernels_ms"] = _kernel_buckets(fn)
            except Exception as e:
                row = dict(hidden=H_, vocab=V_, chunk_mib=chunk_mib, error=H.short_error(e))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del fn
    return {"flce": rows}


def _kernel_buckets(fn):
    """GPU time of one call of fn by kernel, in ms, the 12 largest kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:80]] = tot.get(e.name[:80], 0.0) + e.device_time / 1e3
    return dict(sorted(tot.items(), key=lambda kv: -kv[1])[:12])


def host_profile(ctx):
    """Host time per fwd+bwd at a tiny shape (GPU time negligible): the dispatcher path vs the eager path."""
    from tigon import ops
    m = importlib.import_module("tigon.ops.rms_norm")

    x = torch.randn(8, 4096, device="cuda", dtype=BF16, requires_grad=True)
    w = torch.ones(4096, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    args = lambda: (x, None, w, 1e-6, 0.0, 0, BF16)
    paths = {
        "tigon.ops.rms_norm (autograd.Function)": lambda: torch.autograd.grad(ops.rms_norm(x, w), (x, w), dy),
        "custom op + register_autograd": lambda: torch.autograd.grad(
            torch.ops.tigon.rms_norm_fwd(*args())[0], (x, w), dy),
        "launchers only (no autograd)": lambda: m._bwd_launch(
            dy, None, x, w, m._fwd_launch(*args())[2], 0.0, 0, True, False),
    }
    out = {}
    for name, fn in paths.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(200):
            fn()
        out[name + " us"] = (time.perf_counter() - t) / 200 * 1e6
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        paths["tigon.ops.rms_norm (autograd.Function)"]()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    out["profile"] = s.getvalue()[-6000:]
    print(json.dumps({k: v for k, v in out.items() if k != "profile"}), flush=True)
    print(out["profile"], flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="host,ce,flce,rms_norm,rope,glu")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    ctx = H.Context("cuda")
    fns = {"host": host_profile, "rms_norm": tune_rms_norm, "rms_norm_heads": tune_rms_norm_heads,
           "rms_norm_hidden": tune_rms_norm_hidden,
           "qk_norm_rope": tune_qk_norm_rope, "rope": tune_rope, "glu": tune_glu, "ce": tune_ce, "flce": tune_flce}
    results = {}
    for name in a.ops.split(","):
        t = time.time()
        results[name] = fns[name](ctx)
        print(f"## {name} took {time.time() - t:.0f} s", flush=True)
        torch.cuda.empty_cache()
        with open(os.path.join(a.out, "tune.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
