"""One optimizer step over the parameters of bench_e2e's 1.5B Llama: torch's fused and foreach AdamW against
tigon.optim.AdamW, without and with gradient clipping (torch: clip_grad_norm_ then step; tigon: max_grad_norm in
the step), bf16 parameters, gradients and moments; and the mixed-precision pair: torch's fused AdamW over fp32
parameters (what autocast training steps) against tigon's over bf16 parameters with fp32 masters and moments. With
clipping, also tigon's step behind the Trainer's own norm pass (`fused_adamw(args)`: transformers 5.17 still takes
`clip_grad_norm_(params, inf)` every step to log grad_norm), against tigon's alone (`use_fused_adamw(trainer)`: the
logged norm is the step's), to measure that pass.

Byte model, N parameters of b = 2 bytes: the step reads param, grad and both moments and writes param and both
moments, 7 N b; clip_grad_norm_ reads the grads for the norm and reads + writes them to scale (+3 N b), the fused
clip reads them once for the norm (+1 N b). GB/s is that model over the time, beside the copy ceiling measured in
the same run. Timing: benchmarks/tools/harness.py's bench (GPU time with host run-ahead, L2 flushed before each step).

    PYTHONPATH=src python -m benchmarks optim [--quick] [--sweep] [--only tigon] [--json PATH]
"""

import argparse
import json
import os
import sys
import time

import torch

from benchmarks.tools import harness as H

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 2048, 8192, 16, 32, 8, 128256
QUICK = dict(hidden=32, inter=96, layers=2, kv=8, vocab=300)


def llama_shapes(quick=False):
    """The 1.5B Llama's parameter shapes (untied lm_head), in model.parameters() order."""
    h, i, n, kv, v = ((QUICK["hidden"], QUICK["inter"], QUICK["layers"], QUICK["kv"], QUICK["vocab"]) if quick
                      else (HIDDEN, INTER, LAYERS, HIDDEN * KV_HEADS // HEADS, VOCAB))
    layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
    return [(v, h)] + layer * n + [(h,), (v, h)]


def make_params(ctx, shapes, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(0.02 * torch.randn(s, device=ctx.device, generator=g).to(dtype))
        p.grad = (1e-3 * torch.randn(s, device=ctx.device, generator=g)).to(dtype)
        params.append(p)
    return params


def providers(max_grad_norm):
    """name -> (build(params) -> step, the params' dtype, bytes moved per parameter)."""
    import tigon

    def torch_opt(**kw):
        def build(params):
            opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, **kw)

            def step():
                if max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
                opt.step()
            return step
        return build

    def tigon_opt(trainer_norm=False, **kw):
        def build(params):
            opt = tigon.optim.AdamW(params, lr=1e-5, weight_decay=0.01, max_grad_norm=max_grad_norm, **kw)
            if not trainer_norm:
                return opt.step

            def step():  # the Trainer's logging-only norm (accelerate's clip_grad_norm_ at max_norm=inf), then ours
                torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=True)
                opt.step()
            return step
        return build

    clip = 1 if max_grad_norm else 0
    bf16, fp32 = torch.bfloat16, torch.float32
    # bf16: 7 tensors of 2 bytes (+3 for torch's clipping, +1 for the fused one); the mixed-precision pair: fp32
    # params and grads stepped by torch (7 x 4, +3 x 4 to clip), or bf16 params and grads with fp32 masters and
    # moments stepped by tigon (masters, moments 6 x 4, grads read, params written 2 x 2, +1 x 2 to clip)
    trainer_pass = {"tigon + the Trainer's norm pass": (tigon_opt(trainer_norm=True), bf16, 18)} if clip else {}
    return {"torch fused": (torch_opt(fused=True), bf16, 14 + 6 * clip),
            "torch foreach": (torch_opt(foreach=True), bf16, 14 + 6 * clip),
            "tigon": (tigon_opt(), bf16, 14 + 2 * clip),
            "torch fused, fp32 params": (torch_opt(fused=True), fp32, 28 + 12 * clip),
            "tigon, fp32 masters + moments": (tigon_opt(master_weights=True, state_dtype=fp32), bf16, 28 + 2 * clip),
            **trainer_pass}


def run(ctx, sweep=False, sweep_clip=False, only=None):
    shapes = llama_shapes(ctx.quick)
    n = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    for clip in (None, 1.0):
        for name, (build, dtype, per_param) in providers(clip).items():
            if only and not name.startswith(only):
                continue
            params = make_params(ctx, shapes, dtype=dtype)  # fresh: no state left from the last provider
            rows.append(_one(ctx, name, build, params, clip, per_param * n, n))
            del params
            H.free(ctx)
        if sweep and ctx.cuda and (clip is None or sweep_clip):
            import tigon
            from tigon.ops.config import AdamWConfig
            params = make_params(ctx, shapes)
            for block in (512, 1024, 2048):
                for chunk_blocks in (1, 4, 8, 16):
                    for warps in (2, 4, 8):
                        cfg = AdamWConfig(block=block, chunk_blocks=chunk_blocks, num_warps=warps)

                        def build(ps, cfg=cfg, clip=clip):
                            return tigon.optim.AdamW(ps, lr=1e-5, weight_decay=0.01, max_grad_norm=clip,
                                                     config=cfg).step
                        rows.append(_one(ctx, f"tigon {block}x{chunk_blocks} w{warps}", build, params, clip,
                                         (14 + (2 if clip else 0)) * n, n))
    return rows


def _one(ctx, name, build, params, clip, bytes_, n):
    step = build(params)
    # --quick is a smoke run: 3 timed steps (the CPU's interpreter takes ~0.3 s a step)
    r = H.bench(ctx, step, min_rep=3, max_rep=3, rep_ms=200.0) if ctx.quick else H.bench(ctx, step, rep_ms=200.0)
    host = []
    for _ in range(2 if ctx.quick else 5):  # the host's enqueue time of one step, the GPU busy meanwhile
        if ctx.cuda:
            H._spin(30.0)
        t0 = time.perf_counter()
        step()
        host.append(1e6 * (time.perf_counter() - t0))
    if ctx.cuda:
        torch.cuda.synchronize()
    row = dict(provider=name, clip=clip, params=n, ms=r["ms"], spread_pct=r["spread_pct"], bytes=bytes_,
               GBps=bytes_ / (r["ms"] * 1e-3) / 1e9, host_us=sorted(host)[len(host) // 2])
    if ctx.ceilings.get("copy_GBps"):
        row["pct_copy"] = 100 * row["GBps"] / ctx.ceilings["copy_GBps"]
    print("ROW " + json.dumps(row), flush=True)
    return row


def table(rows, ceilings):
    out = [f"copy ceiling {ceilings.get('copy_GBps', float('nan')):.0f} GB/s", "",
           "| step | clip | ms | GB/s (model) | % of copy | host us |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['provider']} | {r['clip'] or 'no'} | {r['ms']:.3f} | {r['GBps']:.0f} | "
                   f"{r.get('pct_copy', float('nan')):.1f} | {r['host_us']:.0f} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--sweep", action="store_true", help="also sweep tigon's AdamWConfig (GPU)")
    p.add_argument("--sweep-clip", action="store_true", help="sweep with clipping too")
    p.add_argument("--only", default=None, help="the providers whose name starts with this (e.g. tigon)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ctx = H.Context(quick=a.quick)
    H.run_ceilings(ctx)
    rows = run(ctx, a.sweep, a.sweep_clip, a.only)
    print(table(rows, ctx.ceilings))
    if a.json:
        H.write_json(a.json, {"ceilings": ctx.ceilings, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
