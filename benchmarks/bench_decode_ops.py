"""Decode-step kernels at the 1.5B Llama shapes (H2048, 32 q / 8 kv heads of 64, I8192, V128256):
`ops.decode_linear` (fused norm / q,k,v / GLU / residual) against cuBLAS doing the same work unfused, and
`ops.decode_attention` launch settings. GPU only; weights are replicated so L2 stays cold, and the
timing below is CUDA-graph replays (a decode step is a graph: host time would hide the kernels). Each
setting is a config passed to the op (`tigon.ops._config`), never a module attribute.

    PYTHONPATH=src python benchmarks/bench_decode_ops.py --out benchmarks/results [--quick]

Writes decode_ops.json / decode_ops.md: per shape and batch the cuBLAS time, the library's default launch,
the best decode_linear launch config and its time, GB/s of weight bytes and the fraction of the copy ceiling
measured in the same run. A winner that beats the default is a new default in `decode_linear._pick_config`.
"""

import argparse
import itertools
import json
import os
import sys
import time

import torch

from tigon.ops._config import DecodeAttentionConfig, DecodeLinearConfig

H, HQ, HKV, D, INTER, VOCAB = 2048, 32, 8, 64, 8192, 128256
CONFIGS = [DecodeLinearConfig(*c) for c in  # (BN, BK, warps, stages, split)
           itertools.product((16, 32, 64), (256, 512), (4, 8), (3, 4), (1, 2, 4))]
REPLICA_BYTES = 256 << 20  # each timed graph streams >= 256 MiB of distinct weights: L2 (50 MiB) stays cold


def _graph_time(fns, reps=8):
    """Milliseconds per call of a CUDA graph that runs each of `fns` once (back to back, as in a decode step:
    no host time in the measure); median over `reps` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(fns))
    del graph
    return sorted(times)[len(times) // 2]


def copy_ceiling_gbps():
    from triton.testing import do_bench

    x = torch.empty(1 << 29, dtype=torch.uint8, device="cuda").random_()
    y = torch.empty_like(x)
    return 2 * x.numel() / do_bench(lambda: y.copy_(x), return_mode="median") / 1e6


def linear_cases(m):
    """(name, weight bytes, glu, [cuBLAS callables], [decode_linear callables of a config (None: the default
    launch)]) at batch m, one per replica."""
    from tigon import ops

    dt, dev = torch.bfloat16, "cuda"
    F = torch.nn.functional

    def w(n, k):
        return torch.randn(n, k, dtype=dt, device=dev) * k ** -0.5

    x = torch.randn(m, H, dtype=dt, device=dev)
    xi = torch.randn(m, INTER, dtype=dt, device=dev) * 0.1
    nw = torch.rand(H, dtype=dt, device=dev) + 0.5
    specs = [("qkv+norm", [(H, H), (HKV * D, H), (HKV * D, H)], False), ("o+residual", [(H, H)], False),
             ("gate_up+norm+swiglu", [(INTER, H), (INTER, H)], True), ("down+residual", [(H, INTER)], False),
             ("lm_head", [(VOCAB, H)], False)]
    out = []
    for name, shapes, glu in specs:
        nbytes = sum(n * k for n, k in shapes) * 2
        reps = max(2, -(-REPLICA_BYTES // nbytes))
        cub, fused = [], []
        for _ in range(reps):
            ws = [w(n, k) for n, k in shapes]
            if name == "qkv+norm":
                cub.append(lambda ws=ws: [F.linear(ops.rms_norm(x, nw, 1e-5), wi) for wi in ws])
                fused.append(lambda cfg, ws=ws: ops.decode_linear(x, ws, norm_weight=nw, eps=1e-5, config=cfg))
            elif name == "o+residual":
                cub.append(lambda ws=ws: x + F.linear(x, ws[0]))
                fused.append(lambda cfg, ws=ws: ops.decode_linear(x, ws[0], residual=x, config=cfg))
            elif glu:
                cub.append(lambda ws=ws: ops.swiglu(F.linear(ops.rms_norm(x, nw, 1e-5), ws[0]),
                                                    F.linear(ops.rms_norm(x, nw, 1e-5), ws[1])))
                fused.append(lambda cfg, ws=ws: ops.decode_linear(x, ws, norm_weight=nw, eps=1e-5, activation="silu",
                                                                  config=cfg))
            elif name == "down+residual":
                cub.append(lambda ws=ws: x + F.linear(xi, ws[0]))
                fused.append(lambda cfg, ws=ws: ops.decode_linear(xi, ws[0], residual=x, config=cfg))
            else:
                cub.append(lambda ws=ws: F.linear(x, ws[0]))
                fused.append(lambda cfg, ws=ws: ops.decode_linear(x, ws[0], config=cfg))
        out.append((name, nbytes, glu, cub, fused))
    return out


def _with(fns, cfg):
    return [lambda f=f: f(cfg) for f in fns]


def sweep_linear(batches, quick, ceiling):
    rows, ranked = [], {}
    for m in batches:
        for name, nbytes, glu, cub, fused in linear_cases(m):
            t_cublas = _graph_time(cub)
            t_default = _graph_time(_with(fused, None))  # the library's launch for the shapes
            if name == "lm_head" or quick:
                configs = []
            elif m == batches[0]:
                configs = [c for c in CONFIGS if not (glu and c.split_k > 1)]
            else:  # later batches: the first batch's five best
                configs = ranked.get(name, [])[:5]
            results = []
            for cfg in configs:
                try:
                    results.append((cfg, _graph_time(_with(fused, cfg))))
                except Exception as e:  # a config the compiler refuses (shared memory): skip it
                    print(f"  {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            results.sort(key=lambda r: r[1])
            # The winner must also be right: its output against cuBLAS's unfused one (bf16: a few ulps).
            got, want = fused[0](results[0][0] if results else None), cub[0]()
            if isinstance(want, list):
                want = torch.cat(want, dim=-1)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if m == batches[0]:
                ranked[name] = [c for c, _ in results]
            best = results[0] if results else (None, t_default)
            gbps = nbytes / best[1] / 1e6
            row = dict(op=name, batch=m, weight_MB=round(nbytes / 1e6, 1), cublas_us=round(1e3 * t_cublas, 2),
                       default_us=round(1e3 * t_default, 2), best_us=round(1e3 * best[1], 2),
                       best_config=best[0].ints() if best[0] else None,
                       best_GBps=round(gbps), best_frac_copy=round(gbps / ceiling, 3),
                       cublas_GBps=round(nbytes / t_cublas / 1e6), max_rel_err_vs_cublas=round(err, 5),
                       top=[(c.ints(), round(1e3 * t, 2)) for c, t in results[:8]])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def sweep_attention(batches, capacity, quick):
    from tigon import ops

    rows = []
    dt = torch.bfloat16
    for b in batches:
        calls = []
        for _ in range(16):  # one per layer of the 1.5B model: 16 distinct caches
            q = torch.randn(b, HQ, 1, D, dtype=dt, device="cuda")
            kc = torch.randn(b, HKV, capacity, D, dtype=dt, device="cuda")
            vc = torch.randn_like(kc)
            pos = torch.arange(capacity, device="cuda")
            qpos = torch.full((b,), capacity, device="cuda")
            calls.append((q, kc, vc, pos, qpos))

        def fns(cfg, calls=calls):
            return [lambda a=a: ops.decode_attention(*a, config=cfg) for a in calls]

        results = []
        for min_slots, block_n, warps in itertools.product((32, 64, 128, 256), (16, 32, 64), (2, 4)):
            if quick and (warps == 2 or block_n == 16):
                continue
            cfg = DecodeAttentionConfig(min_split_slots=min_slots, block_n=block_n, num_warps=warps)
            results.append(((min_slots, block_n, warps), _graph_time(fns(cfg))))
        t_default = _graph_time(fns(None))  # the library's settings
        best = min(results, key=lambda r: r[1])
        row = dict(op="decode_attention", batch=b, capacity=capacity, default_us=round(1e3 * t_default, 2),
                   best_us=round(1e3 * best[1], 2), best_config=dict(min_split_slots=best[0][0],
                                                                     block_n=best[0][1], num_warps=best[0][2]),
                   all={f"{c[0]}/{c[1]}/{c[2]}": round(1e3 * t, 2) for c, t in results})
        print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
        rows.append(row)
    return rows


def write(out, meta, lin, att):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "decode_ops.json"), "w") as f:
        json.dump(dict(meta=meta, linear=lin, attention=att), f, indent=1)
    lines = ["## Decode-step kernels (1.5B Llama shapes, bf16)", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}; copy ceiling "
             f"{meta['copy_GBps']:.0f} GB/s measured in this run. Times: CUDA-graph replays of back-to-back calls "
             "over >= 256 MiB of distinct weights (cold L2, no host time), median of 8.", "",
             "| op | batch | weight MB | cuBLAS (unfused) us | tigon default us | tigon best us | "
             "best (BN, BK, warps, stages, split-K) | best GB/s | of copy ceiling | speedup vs cuBLAS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in lin:
        lines.append(f"| {r['op']} | {r['batch']} | {r['weight_MB']} | {r['cublas_us']} | {r['default_us']} | "
                     f"{r['best_us']} | {tuple(r['best_config'] or ('default',))} | {r['best_GBps']} | "
                     f"{r['best_frac_copy']:.1%} | "
                     f"x{r['cublas_us'] / r['best_us']:.2f} |")
    lines += ["", "| decode_attention batch | capacity | default us | best us | best settings |",
              "|---|---|---|---|---|"]
    for r in att:
        lines.append(f"| {r['batch']} | {r['capacity']} | {r['default_us']} | {r['best_us']} | "
                     f"{r['best_config']} |")
    with open(os.path.join(out, "decode_ops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--capacity", type=int, default=768)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_ops: needs a CUDA GPU")
    import triton

    torch.manual_seed(0)
    t0 = time.time()
    batches = [int(b) for b in args.batches.split(",")]
    ceiling = copy_ceiling_gbps()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_GBps=ceiling)
    with torch.no_grad():
        lin = sweep_linear(batches, args.quick, ceiling)
        att = sweep_attention(batches, args.capacity, args.quick)
    meta["seconds"] = round(time.time() - t0, 1)
    write(args.out, meta, lin, att)


if __name__ == "__main__":
    main()
