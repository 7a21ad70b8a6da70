"""Decode-step kernels at a model's shapes: `ops.decode_linear` (fused norm / q,k,v / GLU / residual) against
cuBLAS doing the same work unfused, with a sweep of its launch configs, and `ops.decode_attention` launch
settings. GPU only; weights are replicated so L2 stays cold, and the timing is CUDA-graph replays (a decode
step is a graph: host time would hide the kernels). Each setting is a config passed to the op
(`tigon.ops.config`), never a module attribute.

    PYTHONPATH=src python -m benchmarks decode-ops --out benchmarks/results [--model 1.5b|llama3-8b]
        [--quick] [--emit-picks FILE] [--norm-cost]

Models (MODELS): "1.5b" (the default: H 2048, 32 q / 8 kv heads of 64, I 8192, V 128256) and "llama3-8b"
(H 4096, 32 q / 8 kv heads of 128, I 14336). Writes decode_ops.json / .md ("1.5b") or decode_ops_<model>.json /
.md: per projection and batch the cuBLAS time, the library's default launch, the best config found and its time,
GB/s of weight bytes and the fraction of the copy ceiling measured in the same run.

The sweep: the 1.5B grid is timed whole at the first batch; the 8B grid in stages, each around the best so far:
(block_n, split_k) at BLOCK_K 256, 4 warps; then BLOCK_K for the best two; then warps x stages for the best two.
Configs the byte model rules out are not timed (a shared-memory model past the limit, fewer programs than half
the SMs, under two K steps a program, a split that does not tile K). Later batches time the first batch's best
four and the default. Configs are compiled ahead in --jobs worker processes (Triton's on-disk cache is shared),
and past --budget-s no more refinement stages run (each row says which ran).

--norm-cost times only norm+q/k/v and norm+gate_up+GLU at the default launch with and without their fused
RMSNorm (decode_norm_cost_<model>.json): what the norm adds to a launch.

--emit-picks FILE writes the winners that beat the default by --min-gain as a dict literal keyed like
`tigon.ops.decode_linear_picks.MEASURED_PICKS[gpu]`: (K, N, batch bucket, kind) -> config ints.
"""

import argparse
import concurrent.futures as cf
import dataclasses
import importlib
import itertools
import json
import multiprocessing
import os
import sys
import time

import torch

from benchmarks.tools import checkout
from tigon.ops.config import DecodeAttentionConfig, DecodeLinearConfig


@dataclasses.dataclass(frozen=True)
class Grid:
    block_n: tuple
    block_k: tuple
    warps: tuple
    stages: tuple
    split: tuple
    staged: bool  # False: every config of the product; True: the staged search of the module docstring


@dataclasses.dataclass(frozen=True)
class Model:
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    layers: int
    grid: Grid


MODELS = {
    "1.5b": Model(2048, 32, 8, 64, 8192, 128256, 16,
                  Grid((16, 32, 64), (256, 512), (4, 8), (3, 4), (1, 2, 4), staged=False)),
    "llama3-8b": Model(4096, 32, 8, 128, 14336, 128256, 32,
                       Grid((32, 64, 128), (128, 256, 512), (4, 8), (3, 4, 5), (1, 2, 4, 8), staged=True)),
}
ALIASES = {"llama-1.5b": "1.5b"}  # bench_decode.py's name for the 1.5B
REPLICA_BYTES = 256 << 20  # each timed graph streams >= 256 MiB of distinct weights: L2 (50 MiB) stays cold
EPS = 1e-5


def projections(s: Model) -> dict:
    """name -> (K, output widths of the fused weights, decode_linear_picks kind) of one decoder layer's launches:
    with the norm fused (batch 1) and without it (2-16 rows, after `rms_norm_rows`: decode/layer_step.py)."""
    q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    return {"norm+qkv": (s.hidden, (q, kv, kv), "norm"), "qkv": (s.hidden, (q, kv, kv), "plain"),
            "o+residual": (q, (s.hidden,), "residual"),
            "norm+gate_up+glu": (s.hidden, (s.inter, s.inter), "norm+glu"),
            "gate_up+glu": (s.hidden, (s.inter, s.inter), "glu"),
            "down+residual": (s.inter, (s.hidden,), "residual"), "lm_head": (s.hidden, (s.vocab,), "plain")}


def _inputs(s: Model, m: int, fill: bool = True):
    """x [m, H], the attention output xa [m, Hq D], the MLP's xi [m, I] (x 0.1), the norm weight nw [H] (about 1);
    fill=False: uninitialized (no kernel runs: a compile-only worker)."""
    def make(scale, shift, *shape):
        t = torch.empty(*shape, dtype=torch.bfloat16, device="cuda")
        return t.normal_(shift, scale) if fill else t

    return dict(x=make(1, 0, m, s.hidden), xa=make(1, 0, m, s.q_heads * s.head_dim), xi=make(0.1, 0, m, s.inter),
                nw=make(0.2, 1, s.hidden))


def _calls(name, kind, ws, inp):
    """(cuBLAS unfused callable, decode_linear callable of a config) for one replica of weights `ws`."""
    from tigon import ops

    F = torch.nn.functional
    x, nw = inp["x"], inp["nw"]
    if name == "norm+qkv":
        return (lambda: [F.linear(h, w) for h in [ops.rms_norm(x, nw, EPS)] for w in ws],
                lambda cfg: ops.decode_linear(x, list(ws), norm_weight=nw, eps=EPS, config=cfg))
    if name == "qkv":
        return (lambda: [F.linear(x, w) for w in ws], lambda cfg: ops.decode_linear(x, list(ws), config=cfg))
    if kind == "norm+glu":
        def cublas():
            h = ops.rms_norm(x, nw, EPS)
            return ops.swiglu(F.linear(h, ws[0]), F.linear(h, ws[1]))
        return cublas, lambda cfg: ops.decode_linear(x, list(ws), norm_weight=nw, eps=EPS, activation="silu",
                                                     config=cfg)
    if kind == "glu":
        return (lambda: ops.swiglu(F.linear(x, ws[0]), F.linear(x, ws[1])),
                lambda cfg: ops.decode_linear(x, list(ws), activation="silu", config=cfg))
    if kind == "residual":
        a = inp["xa"] if name == "o+residual" else inp["xi"]
        return (lambda: x + F.linear(a, ws[0]), lambda cfg: ops.decode_linear(a, ws[0], residual=x, config=cfg))
    return lambda: F.linear(x, ws[0]), lambda cfg: ops.decode_linear(x, ws[0], config=cfg)


def linear_cases(s: Model, m: int, only=()):
    """(name, K, widths, kind, weight bytes, [cuBLAS callables], [decode_linear callables of a config]) at batch
    m, one callable per replica; `only`: those projections alone (default all)."""
    out = []
    inp = _inputs(s, m)
    for name, (K, ns, kind) in projections(s).items():
        if only and name not in only:
            continue
        nbytes = sum(ns) * K * 2
        cub, fused = [], []
        for _ in range(max(2, -(-REPLICA_BYTES // nbytes))):
            c, f = _calls(name, kind, [torch.randn(n, K, dtype=torch.bfloat16, device="cuda") * K ** -0.5
                                       for n in ns], inp)
            cub.append(c)
            fused.append(f)
        out.append((name, K, ns, kind, nbytes, cub, fused))
    return out


def _graph_time(fns, reps=8):
    """Milliseconds per call of a CUDA graph that runs each of `fns` once (back to back, as in a decode step:
    no host time in the measure); median over `reps` replays, each timed right behind an untimed one."""
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
        graph.replay()  # the GPU is busy while the host enqueues the timed replay: no launch gap in the measure
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


def _dl():
    return importlib.import_module("tigon.ops.decode_linear")  # the module (tigon.ops.decode_linear is the op)


def feasible(cfg: DecodeLinearConfig, K: int, ns, kind: str, sms: int) -> bool:
    """The byte model's filter: shared memory within the limit as the launch would use it, the split tiling K in
    whole BLOCK_K steps (the kernel's EVEN_K path), >= 2 K steps a program to pipeline, >= SMs / 2 programs."""
    import triton

    dl = _dl()
    glu, norm = "glu" in kind, "norm" in kind
    if glu and cfg.split_k > 1 or dl._smem_bytes(cfg, 2, glu, norm) > dl.SMEM_LIMIT or K % cfg.block_k:
        return False
    k_split, split = dl._split_of(K, cfg.block_k, cfg.split_k)
    blocks = triton.cdiv(ns[0], cfg.block_n) if glu else sum(triton.cdiv(n, cfg.block_n) for n in ns)
    return split == cfg.split_k and k_split * split == K and k_split >= 2 * cfg.block_k and 2 * blocks * split >= sms


def default_config(K, ns, kind, m) -> DecodeLinearConfig:
    """The launch the library picks for this projection (config=None), bf16."""
    dl = _dl()
    n_out = ns[0] if "glu" in kind else sum(ns)
    return dl._pick_config(m, K, n_out, "glu" in kind, "norm" in kind, 2, torch.device("cuda", 0),
                           residual="residual" in kind)


def stage_configs(grid: Grid, stage: int, ranked, kind: str):
    """The configs of search stage `stage` (0, 1, 2), given `ranked`, the configs timed so far, fastest first."""
    base_stages = 3 if "glu" in kind else 4
    if not grid.staged:
        return [DecodeLinearConfig(*c) for c in itertools.product(grid.block_n, grid.block_k, grid.warps,
                                                                  grid.stages, grid.split)] if stage == 0 else []
    if stage == 0:  # wide column blocks drop stages until the shared-memory model fits (2 at least: a pipeline)
        glu, norm = "glu" in kind, "norm" in kind
        out = []
        for bn, sk in itertools.product(grid.block_n, grid.split):
            st = base_stages
            while st > 2 and _dl()._smem_bytes(DecodeLinearConfig(bn, 256, 4, st, sk), 2, glu, norm) > _dl().SMEM_LIMIT:
                st -= 1
            out.append(DecodeLinearConfig(bn, 256, 4, st, sk))
        return out
    if stage == 1:
        return [dataclasses.replace(c, block_k=bk) for c in ranked[:2] for bk in grid.block_k]
    return [dataclasses.replace(c, num_warps=w, num_stages=st) for c in ranked[:2]
            for w in grid.warps for st in grid.stages]


class _CompileOnly:
    """Stands in for decode_linear's kernel in a worker process: `kernel[grid](...)` compiles for those arguments
    (JITFunction.warmup) and launches nothing, so the workers put no work on the GPU the timing process measures."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel.warmup(*args, grid=grid, **kwargs)


_WORKER_CASES = {}


def _compile_one(model: str, name: str, m: int, ints) -> str:
    """Worker process: compiles the kernel of `name` at batch m with config `ints` through the op's own launcher,
    which leaves it in Triton's on-disk cache for the timing process. Returns "" or the error."""
    try:
        dl = _dl()
        if not isinstance(dl._decode_linear_kernel, _CompileOnly):  # this worker process only
            dl._decode_linear_kernel = _CompileOnly(dl._decode_linear_kernel)
        key = (model, name, m)
        if key not in _WORKER_CASES:
            s = MODELS[model]
            K, ns, kind = projections(s)[name]
            ws = [torch.empty(n, K, dtype=torch.bfloat16, device="cuda") for n in ns]
            _WORKER_CASES[key] = _calls(name, kind, ws, _inputs(s, m, fill=False))[1]
        with torch.no_grad():
            _WORKER_CASES[key](DecodeLinearConfig(*ints))
        return ""
    except Exception as e:  # a config the compiler refuses: the timing process reports it when it gets there
        return f"{type(e).__name__}: {str(e)[:200]}"


class Precompiler:
    """Compiles configs ahead in `jobs` spawned processes (none: the timing process compiles as it goes)."""

    def __init__(self, model: str, jobs: int):
        self.model, self.futures = model, {}
        self.pool = cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) if jobs else None

    def submit(self, name, m, cfgs):
        for c in cfgs if self.pool else ():
            if (name, m, c) not in self.futures:
                self.futures[name, m, c] = self.pool.submit(_compile_one, self.model, name, m, c.ints())

    def wait(self, name, m, cfgs):
        for c in cfgs:
            f = self.futures.get((name, m, c))
            if f is not None:
                try:
                    f.result(timeout=300)
                except Exception:  # a dead worker: the timing process compiles this one itself
                    pass

    def close(self):
        if self.pool:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _with(fns, cfg):
    return [lambda f=f: f(cfg) for f in fns]


def _time_configs(name, m, cfgs, fused, timed):
    for cfg in cfgs:
        if cfg in timed:
            continue
        try:
            timed[cfg] = _graph_time(_with(fused, cfg))
        except Exception as e:  # a config the compiler refuses (shared memory): skip it
            timed[cfg] = float("inf")
            print(f"  {name} m={m} {cfg.ints()}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)


def sweep_linear(model, batches, quick, ceiling, jobs, budget_s, only=()):
    from tigon.ops import _launch

    s = MODELS[model]
    sms = _launch.sm_count(0)
    pre = Precompiler(model, 0 if quick else jobs)
    t0 = time.time()
    rows, ranked_first = [], {}
    specs = {name: spec for name, spec in projections(s).items() if name != "lm_head" and (not only or name in only)}
    if not quick:
        for name, (K, ns, kind) in specs.items():  # the first batch's first stage: known before any timing
            pre.submit(name, batches[0], [c for c in stage_configs(s.grid, 0, [], kind)
                                          if feasible(c, K, ns, kind, sms)])
    try:
        for m in batches:
            for name, K, ns, kind, nbytes, cub, fused in linear_cases(s, m, only):
                rows.append(_sweep_one(s, name, K, ns, kind, nbytes, cub, fused, m, m == batches[0], quick, ceiling,
                                       pre, ranked_first, sms, t0 + budget_s, batches))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "top"}), flush=True)
            torch.cuda.empty_cache()
    finally:
        pre.close()
    return rows


def _sweep_one(s, name, K, ns, kind, nbytes, cub, fused, m, first, quick, ceiling, pre, ranked_first, sms,
               deadline, batches):
    t_cublas = _graph_time(cub)
    t_default = _graph_time(_with(fused, None))  # the library's launch for the shapes
    default = default_config(K, ns, kind, m)
    timed, stages_run = {}, []
    if name != "lm_head" and not quick:
        ok = [default] if feasible(default, K, ns, kind, sms) else []
        for stage in range(3) if first else ():
            if stage and time.time() > deadline:
                break
            ranking = sorted(timed, key=timed.get)
            cfgs = [c for c in dict.fromkeys(stage_configs(s.grid, stage, ranking, kind) + (ok if not stage else []))
                    if feasible(c, K, ns, kind, sms) and c not in timed]
            if cfgs:
                pre.submit(name, m, cfgs)
                pre.wait(name, m, cfgs)
                _time_configs(name, m, cfgs, fused, timed)
                stages_run.append(len(cfgs))
        if not first:
            cfgs = list(dict.fromkeys(ranked_first.get(name, [])[:2 if time.time() > deadline else 4] + ok))
            pre.wait(name, m, cfgs)
            _time_configs(name, m, cfgs, fused, timed)
            stages_run.append(len(cfgs))
    results = sorted(((c, t) for c, t in timed.items() if t != float("inf")), key=lambda r: r[1])
    if first:
        ranked_first[name] = [c for c, _ in results]
        for later in batches[1:]:  # compile the later batches' candidates while this batch's other rows time
            pre.submit(name, later, ranked_first[name][:4] + [default_config(K, ns, kind, later)])
    # The winner must also be right: its output against cuBLAS's unfused one (bf16: a few ulps).
    got, want = fused[0](results[0][0] if results else None), cub[0]()
    if isinstance(want, list):
        want = torch.cat(want, dim=-1)
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    best_cfg, best_t = results[0] if results and results[0][1] < t_default else (None, t_default)

    def gbps(t):
        return nbytes / t / 1e6

    return dict(op=name, batch=m, K=K, N=ns[0] if "glu" in kind else sum(ns), kind=kind,
                weight_MB=round(nbytes / 1e6, 1), bound_us=round(nbytes / ceiling / 1e3, 2),
                cublas_us=round(1e3 * t_cublas, 2), cublas_GBps=round(gbps(t_cublas)),
                default_us=round(1e3 * t_default, 2), default_config=default.ints(),
                default_GBps=round(gbps(t_default)), default_frac_copy=round(gbps(t_default) / ceiling, 3),
                best_us=round(1e3 * best_t, 2), best_config=best_cfg.ints() if best_cfg else None,
                best_GBps=round(gbps(best_t)), best_frac_copy=round(gbps(best_t) / ceiling, 3),
                configs_timed=len(timed), stages=stages_run, max_rel_err_vs_cublas=round(err, 5),
                top=[(c.ints(), round(1e3 * t, 2)) for c, t in results[:8]])


def sweep_attention(s: Model, batches, capacity, quick):
    from tigon import ops

    rows = []
    dt = torch.bfloat16
    for b in batches:
        calls = []
        for _ in range(s.layers):  # one per layer of the model: distinct caches
            q = torch.randn(b, s.q_heads, 1, s.head_dim, dtype=dt, device="cuda")
            kc = torch.randn(b, s.kv_heads, capacity, s.head_dim, dtype=dt, device="cuda")
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
        kv_bytes = 2 * b * s.kv_heads * capacity * s.head_dim * 2
        row = dict(op="decode_attention", batch=b, capacity=capacity, head_dim=s.head_dim,
                   kv_MB_per_layer=round(kv_bytes / 1e6, 2), default_us=round(1e3 * t_default, 2),
                   best_us=round(1e3 * best[1], 2), best_config=dict(min_split_slots=best[0][0],
                                                                     block_n=best[0][1], num_warps=best[0][2]),
                   all={f"{c[0]}/{c[1]}/{c[2]}": round(1e3 * t, 2) for c, t in results})
        print(json.dumps({k: v for k, v in row.items() if k != "all"}), flush=True)
        rows.append(row)
        del calls
        torch.cuda.empty_cache()
    return rows


def sweep_attention_splits(s: Model, batches, capacities, ceiling):
    """decode_attention's time against its split count (and 2 or 4 warps) at each batch and capacity, the
    caches full; GB/s of K+V read per layer against the copy ceiling. The library's rule is the `default` row;
    `launches` times the rule's splits and warps at other slot tiles (block_n) and pipeline stages."""
    from tigon import ops
    da = importlib.import_module("tigon.ops.decode_attention")

    rows = []
    dt = torch.bfloat16
    for b, cap in itertools.product(batches, capacities):
        kv_bytes = 2 * b * s.kv_heads * cap * s.head_dim * 2
        layers = max(2, min(s.layers, -(-REPLICA_BYTES // kv_bytes)))  # distinct caches: cold L2
        calls = []
        for _ in range(layers):
            kc = torch.randn(b, s.kv_heads, cap, s.head_dim, dtype=dt, device="cuda")
            calls.append((torch.randn(b, s.q_heads, 1, s.head_dim, dtype=dt, device="cuda"), kc,
                          torch.randn_like(kc), torch.arange(cap, device="cuda"),
                          torch.full((b,), cap, device="cuda")))

        def fns(cfg, calls=calls):
            return [lambda a=a: ops.decode_attention(*a, config=cfg) for a in calls]

        blk = da._block_n(torch.device("cuda"), s.head_dim, DecodeAttentionConfig())
        times = {"default": _graph_time(fns(None))}
        per_wave = {f"D {k[4]}, block_n {k[2]}, {k[3]} stages, {k[-1]} warps": v  # read off the compiled kernels
                    for k, v in da._PER_WAVE.items()}
        key = (s.head_dim, 16, False, False)  # the split kernel's head-dim and group tiles; no window, softcap
        pick = da._launch_shape(*calls[0][:3], cap, b * s.kv_heads, blk, key, DecodeAttentionConfig(), None)  # cached
        for bn, st in itertools.product((32, 64, 128), (2, 3, 4)):  # the rule's splits and warps at each tile
            try:
                times[f"block_n {bn} stages {st}"] = _graph_time(fns(DecodeAttentionConfig(block_n=bn, num_stages=st)))
            except Exception as e:  # out of shared memory: not a launch
                print(f"block_n {bn} stages {st}: {type(e).__name__}", flush=True)
        for n in (1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 16, 17, 22, 24, 32, 33, 44, 47, 48, 64, 66, 96, 99, 128, 132):
            if n > -(-cap // blk):
                continue
            for w in (2, 4):
                cfg = DecodeAttentionConfig(n_splits=n, num_warps=w, max_splits=max(64, n))
                times[f"{n}/{w}"] = _graph_time(fns(cfg))
        best = min((k for k in times if "/" in k), key=times.get)  # of the split counts
        launches = {k: round(1e3 * t, 2) for k, t in times.items() if k.startswith("block_n")}
        row = dict(op="decode_attention_splits", batch=b, capacity=cap, head_dim=s.head_dim,
                   programs_per_split=b * s.kv_heads, per_wave=per_wave, default_warps_splits=pick,
                   kv_MB_per_layer=round(kv_bytes / 1e6, 2), bound_us=round(kv_bytes / ceiling / 1e3, 2),
                   default_us=round(1e3 * times["default"], 2), best=best, best_us=round(1e3 * times[best], 2),
                   default_frac_copy=round(kv_bytes / (1e6 * times["default"]) / ceiling, 3),
                   best_frac_copy=round(kv_bytes / (1e6 * times[best]) / ceiling, 3),
                   launches=launches, us={k: round(1e3 * t, 2) for k, t in times.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
        del calls
        torch.cuda.empty_cache()
    return rows


def picks_literal(rows, meta, min_gain) -> str:
    """The winners that beat the default by `min_gain` (a fraction of its time), as a dict literal for
    MEASURED_PICKS[gpu]; the first batch of a bucket is kept where several share one."""
    from tigon.ops.decode_linear_picks import batch_bucket

    lines = [f"# {meta['gpu']}: python -m benchmarks decode-ops --model {meta['model']} (torch {meta['torch']}, "
             f"triton {meta['triton']}, commit {meta.get('commit')}); the winners {min_gain:.0%} or more faster than",
             f"# the default. Paste into src/tigon/ops/decode_linear_picks.py as MEASURED_PICKS[{meta['gpu']!r}]'s "
             "entries.", "{"]
    seen = set()
    for r in rows:
        key = (r["K"], r["N"], batch_bucket(r["batch"]), r["kind"])
        if r.get("best_config") is None or key[2] is None or key in seen:
            continue
        if r["best_us"] > (1 - min_gain) * r["default_us"]:
            continue
        seen.add(key)
        lines.append(f"    {key!r}: {tuple(r['best_config'])!r},  # {r['op']}, batch {r['batch']}: default "
                     f"{tuple(r['default_config'])} {r['default_us']} us -> {r['best_us']} us")
    return "\n".join(lines + ["}"]) + "\n"


def write(out, stem, meta, lin, att):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(dict(meta=meta, linear=lin, attention=att), f, indent=1)
    lines = [f"## Decode-step kernels, {meta['model']} Llama shapes ({meta['shapes']}), bf16", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta.get('commit')}; copy "
             f"ceiling {meta['copy_GBps']:.0f} GB/s measured in this run; {meta['seconds']} s. Times: CUDA-graph "
             "replays of back-to-back calls over >= 256 MiB of distinct weights (cold L2, no host time), median of 8. "
             "Configs: (BN, BK, warps, stages, split-K).", "",
             "| op | batch | weight MB | bound us | cuBLAS (unfused) us | default | default us | default of ceiling | "
             "best | best us | best GB/s | best of ceiling | vs cuBLAS | configs timed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in lin:
        best = tuple(r["best_config"]) if r["best_config"] else "default"
        lines.append(f"| {r['op']} | {r['batch']} | {r['weight_MB']} | {r['bound_us']} | {r['cublas_us']} | "
                     f"{tuple(r['default_config'])} | {r['default_us']} | {r['default_frac_copy']:.1%} | {best} | "
                     f"{r['best_us']} | {r['best_GBps']} | {r['best_frac_copy']:.1%} | "
                     f"x{r['cublas_us'] / r['best_us']:.2f} | {r['configs_timed']} {r['stages']} |")
    lines += ["", "| decode_attention batch | capacity | head dim | default us | best us | best settings |",
              "|---|---|---|---|---|---|"]
    for r in att:
        lines.append(f"| {r['batch']} | {r['capacity']} | {r['head_dim']} | {r['default_us']} | {r['best_us']} | "
                     f"{r['best_config']} |")
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _shapes(s: Model) -> str:
    return (f"H {s.hidden}, {s.q_heads} q / {s.kv_heads} kv heads of {s.head_dim}, I {s.inter}, V {s.vocab}, "
            f"{s.layers} layers")


def _commit():
    return checkout.git_commit()


def norm_cost(model: str, batches, stats_elems=(0,)) -> dict:
    """What the fused RMSNorm costs decode_linear: norm+q/k/v and norm+gate_up+GLU timed with and without
    norm_weight (the same weights; CUDA-graph replays over >= 256 MiB of them, cold L2), at the default launch
    and, for q/k/v, at 32 columns a program, the norm at each statistics step `stats_elems` (0: STATS_ELEMS), and
    the norm as a launch of its own (`rms_norm_rows`) before the projection without one."""
    from tigon import ops
    from tigon.ops.rms_norm import rms_norm_rows

    s = MODELS[model]
    q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    out = {}
    for m in batches:
        x = torch.randn(m, s.hidden, device="cuda", dtype=torch.bfloat16)
        nw = torch.randn(s.hidden, device="cuda", dtype=torch.bfloat16) * 0.2 + 1
        for name, ns, act in (("norm+qkv", (q, kv, kv), None), ("norm+gate_up+glu", (s.inter, s.inter), "silu")):
            nbytes = sum(ns) * s.hidden * 2
            reps = [[torch.randn(n, s.hidden, device="cuda", dtype=torch.bfloat16) * 0.02 for n in ns]
                    for _ in range(max(2, -(-REPLICA_BYTES // nbytes)))]
            default = _dl()._pick_config(m, s.hidden, sum(ns) if act is None else ns[0], act is not None, True, 2,
                                         torch.device("cuda"))
            bases = [default] + ([dataclasses.replace(default, block_n=32)] if act is None and default.block_n != 32
                                 else [])
            variants = []  # (label, config, norm: True fused, False none, None its own rms_norm_rows launch)
            for base in bases:
                variants += [(f"{base.block_n} columns, stats_elems {se}", dataclasses.replace(base, stats_elems=se),
                              True) for se in stats_elems]
                variants.append((f"{base.block_n} columns, no norm", base, False))
            variants.append(("norm as its own launch", None, None))  # the projection at its default no-norm launch
            for label, cfg, norm in variants:
                kw = dict(norm_weight=nw if norm else None, eps=EPS, activation=act, config=cfg)
                if norm is None:
                    fns = [(lambda ws=ws, x=x, kw=kw, nw=nw:
                            ops.decode_linear(rms_norm_rows(x, nw, EPS)[0], ws, **kw)) for ws in reps]
                else:
                    fns = [(lambda ws=ws, x=x, kw=kw: ops.decode_linear(x, ws, **kw)) for ws in reps]
                us = 1e3 * _graph_time(fns)
                key = f"batch {m} {name} {label}"
                out[key] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1),
                            "config": cfg.ints() if cfg else None}
                print(key, out[key], flush=True)
    return out


def build_parser():
    ap = argparse.ArgumentParser(description="decode_linear against cuBLAS at a model's shapes, its launch-config "
                                 "sweep, decode_attention settings (CUDA-graph timing, cold L2)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--model", default="1.5b", choices=(*MODELS, *ALIASES))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--capacity", type=int, default=768)
    ap.add_argument("--quick", action="store_true", help="defaults against cuBLAS only, no linear sweep")
    ap.add_argument("--jobs", type=int, default=8, help="worker processes compiling configs ahead (0: none)")
    ap.add_argument("--budget-s", type=float, default=100.0,
                    help="seconds of linear sweep after which no more refinement stages run")
    ap.add_argument("--no-attention", action="store_true", help="skip the decode_attention sweep")
    ap.add_argument("--only", default="", help="projections to sweep, comma-separated (norm+qkv, qkv, o+residual, "
                    "norm+gate_up+glu, gate_up+glu, down+residual, lm_head); default all")
    ap.add_argument("--norm-cost", action="store_true",
                    help="only time the fused norm's cost (with / without norm_weight at the default launch)")
    ap.add_argument("--stats-elems", default="0",
                    help="--norm-cost: statistics steps to time, comma-separated (0: the default launch's)")
    ap.add_argument("--attention-splits", default="",
                    help="only time decode_attention against its split count at these capacities (comma-separated)")
    ap.add_argument("--emit-picks", metavar="FILE", help="write the winners as a MEASURED_PICKS dict literal")
    ap.add_argument("--min-gain", type=float, default=0.02,
                    help="--emit-picks keeps a winner this fraction faster than the default (default 0.02)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_decode_ops: needs a CUDA GPU")
    import triton

    model = ALIASES.get(args.model, args.model)
    torch.manual_seed(0)
    t0 = time.time()
    batches = [int(b) for b in args.batches.split(",")]
    ceiling = copy_ceiling_gbps()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_GBps=ceiling, model=model, shapes=_shapes(MODELS[model]), commit=_commit(),
                command=" ".join(sys.argv))
    if args.attention_splits:
        with torch.no_grad():
            rows = sweep_attention_splits(MODELS[model], batches,
                                          [int(c) for c in args.attention_splits.split(",")], ceiling)
        with open(os.path.join(args.out, f"decode_attention_splits_{model}.json"), "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
        return
    if args.norm_cost:
        with torch.no_grad():
            res = dict(meta, rows=norm_cost(model, batches, [int(v) for v in args.stats_elems.split(",")]))
        with open(os.path.join(args.out, f"decode_norm_cost_{model}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    with torch.no_grad():
        lin = sweep_linear(model, batches, args.quick, ceiling, args.jobs, args.budget_s,
                           tuple(o for o in args.only.split(",") if o))
        att = [] if args.no_attention else sweep_attention(MODELS[model], batches, args.capacity, args.quick)
    meta["seconds"] = round(time.time() - t0, 1)
    write(args.out, "decode_ops" if model == "1.5b" else f"decode_ops_{model}", meta, lin, att)
    if args.emit_picks:
        with open(args.emit_picks, "w") as f:
            f.write(picks_literal(lin, meta, args.min_gain))
        print(f"picks: {args.emit_picks}")


if __name__ == "__main__":
    main()
