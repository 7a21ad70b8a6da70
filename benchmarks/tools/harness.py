"""The one benchmark harness: timing, peak memory, errors, ceilings and the markdown report.

Every provider (Tigon, eager, torch.compile, Liger-Kernel, cut-cross-entropy) is timed the same way, the method
of the published peer reference timings, so the numbers compare with theirs:
- CUDA events around each call, median of >= 10 calls over two passes (the spread between the two pass
  medians is kept as a noise figure);
- before each call, outside the timed interval: the L2 is flushed (256 MB memset) and every input that
  some implementation overwrites in place is restored from a backup;
- "run-ahead": a GPU spin (torch.cuda._sleep, >= 2.5 ms, longer when the host needs longer to enqueue
  the call) is queued before the start event, so the host has enqueued the whole call before the GPU
  reaches it and the interval is GPU time, as in a training step whose CPU runs ahead;
- a second timing without the spin ("host-incl"): the launch latency the GPU waits for is inside it;
  the host time to enqueue one call ("host enqueue") is kept too.
fwd is the training forward (inputs require grad); fwd+bwd is forward + torch.autograd.grad(outputs,
inputs, grad_outputs), which returns grads without accumulating into .grad. Peak memory is
max_memory_allocated during one call minus what was allocated just before it (inputs excluded, outputs
and grads included). Errors are relative L2 errors against an fp64 (fp32 for the GLUs and FLCE) reference.

Every provider runs in its own try/except: an OOM or a missing package becomes a note in its cell.
On a CPU (the --quick smoke run) there are no events, flushes or spins: wall time of the call.

`bench` is hand-written, not triton.testing.do_bench: do_bench flushes the L2 and takes a median too, but it does not
restore overwritten inputs, queue the run-ahead spin, time the host's enqueue or give the two-pass noise figure. The
device ceilings (one long kernel, no inputs to restore) are do_bench medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

SPIN_MS = 2.5  # the reference method's run-ahead: ~5M cycles at 1.98 GHz
MAX_SPIN_MS = 25.0
FLUSH_BYTES = 256 * 1024 * 1024  # > the H200's 60 MB L2, as in triton.testing.do_bench
EPS = 1e-6


class Skip(Exception):
    """A provider that cannot run here (not installed, needs CUDA, kwarg not supported): the message
    becomes the cell's note."""


class CudaBroken(RuntimeError):
    """The CUDA context is unusable (a sticky error such as an illegal address): the process must end."""


@dataclass
class Call:
    """One provider's call on prepared inputs.

    fn: the forward with grad enabled, returning a tensor or a tuple of tensors.
    inputs: what fwd+bwd differentiates with respect to.
    grad_outputs: one per output of fn, or None when fn returns a scalar loss.
    restore: (dst, backup) pairs copied before every call, untimed (inputs some provider overwrites).
    """

    fn: Callable
    inputs: Sequence[torch.Tensor]
    grad_outputs: Sequence[torch.Tensor] | None = None
    restore: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()


class Context:
    """Device, time budget, measured ceilings and the rows of one run; `dump` rewrites the JSON part file
    after every row so a killed process keeps what it had measured."""

    def __init__(self, device=None, quick=False, deadline=None, ceilings=None, part_path=None, verbose=False):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.quick = quick
        self.deadline = deadline if deadline is not None else time.time() + 1e9
        self.ceilings = dict(ceilings or {})
        self.rows: list[dict] = []
        self.extras: dict = {}
        self.notes: list[str] = []
        self.done: list[str] = []
        self.current: dict | None = None
        self.part_path = part_path
        self.verbose = verbose

    def remaining(self) -> float:
        return self.deadline - time.time()

    def add(self, row: dict) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self.rows.append(row)
        if self.verbose:
            print("ROW " + json.dumps(row, default=str), flush=True)
        self.dump()

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        print("NOTE " + msg, flush=True)
        self.dump()

    def state(self) -> dict:
        return {"ceilings": self.ceilings, "rows": self.rows, "extras": self.extras, "notes": self.notes,
                "done": self.done, "current": self.current}

    def dump(self) -> None:
        if self.part_path:
            write_json(self.part_path, self.state())


def _clean(v):
    if isinstance(v, float):
        return float(f"{v:.5g}") if math.isfinite(v) else str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return str(v)  # dtypes, devices, ...


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def free(ctx: Context | None = None) -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a broken context is reported by check_cuda, not here
            pass


def check_cuda(ctx: Context) -> None:
    """Raise CudaBroken when a previous error left the CUDA context unusable."""
    if not ctx.cuda:
        return
    try:
        torch.cuda.synchronize()
        (torch.ones(8, device=ctx.device) + 1).sum().item()
    except Exception as e:  # noqa: BLE001
        raise CudaBroken(f"CUDA context unusable after an error: {short_error(e)}") from e


def short_error(e: BaseException, n: int = 220) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    return f"{type(e).__name__}: {msg}"[:n]


# ----------------------------------------------------------------------------- timing

_FLUSH: torch.Tensor | None = None
_CYCLES_PER_MS: float | None = None


def _flush_l2() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.zeros(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    _FLUSH.zero_()


def _spin(ms: float) -> None:
    """Queue ~ms of GPU busy-wait, so the host enqueues what follows before the GPU gets there."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        s.record()
        torch.cuda._sleep(4_000_000)
        e.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS = 4_000_000 / max(s.elapsed_time(e), 1e-3)
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS))


def _restore(pairs) -> None:
    if pairs:
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def bench(ctx: Context, fn: Callable, restore=(), *, runahead=True, min_rep=10, max_rep=25, rep_ms=250.0,
          passes=2, warmup=1) -> dict:
    """Median time of fn() in ms over `passes` passes of min_rep/passes..max_rep calls (about rep_ms each).
    Returns ms, min_ms, n, spread_pct (pass medians), cpu_us (host enqueue, median), spin_ms. See the
    module docstring for the method."""
    if not ctx.cuda:
        return _bench_cpu(fn, restore, min_rep=min_rep, max_rep=max_rep, rep_ms=rep_ms, warmup=warmup)
    for _ in range(warmup):
        _restore(restore)
        fn()
    torch.cuda.synchronize()
    est, est_cpu = [], []
    for _ in range(2):
        _restore(restore)
        _flush_l2()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        est_cpu.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
        est.append(s.elapsed_time(e))
    est_ms = min(est)
    # A fixed 2.5 ms spin only hides a host that enqueues faster than that; slow eager chains need more.
    spin_ms = min(max(SPIN_MS, 1.25 * min(est_cpu)), MAX_SPIN_MS) if runahead else 0.0
    per_pass = max(math.ceil(min_rep / passes), min(max_rep, round(rep_ms / max(est_ms, 1e-3) / passes)))
    times, meds, cpu = [], [], []
    for _ in range(passes):
        st = [torch.cuda.Event(enable_timing=True) for _ in range(per_pass)]
        en = [torch.cuda.Event(enable_timing=True) for _ in range(per_pass)]
        for i in range(per_pass):
            _restore(restore)
            _flush_l2()
            if runahead:
                _spin(spin_ms)
            t0 = time.perf_counter()
            st[i].record()
            fn()
            en[i].record()
            cpu.append(time.perf_counter() - t0)
            if not runahead:
                torch.cuda.synchronize()  # no queue build-up: each call starts from an idle host and GPU
        torch.cuda.synchronize()
        ts = [a.elapsed_time(b) for a, b in zip(st, en)]
        times += ts
        meds.append(_median(ts))
    spread = 100 * (max(meds) - min(meds)) / min(meds) if len(meds) > 1 and min(meds) > 0 else 0.0
    return {"ms": _median(times), "min_ms": min(times), "n": len(times), "spread_pct": spread,
            "cpu_us": 1e6 * _median(cpu), "spin_ms": spin_ms}


def _bench_cpu(fn, restore, *, min_rep, max_rep, rep_ms, warmup) -> dict:
    for _ in range(warmup):
        _restore(restore)
        fn()
    _restore(restore)
    t0 = time.perf_counter()
    fn()
    est_ms = 1e3 * (time.perf_counter() - t0)
    n = max(min_rep, min(max_rep, round(rep_ms / max(est_ms, 1e-3))))
    ts = []
    for _ in range(n):
        _restore(restore)
        t0 = time.perf_counter()
        fn()
        ts.append(1e3 * (time.perf_counter() - t0))
    ms = _median(ts)
    return {"ms": ms, "min_ms": min(ts), "n": n, "spread_pct": 0.0, "cpu_us": 1e3 * ms, "spin_ms": 0.0}


def peak_mib(ctx: Context, fn: Callable, restore=()) -> float | None:
    """Peak allocated memory above the pre-call baseline during one call (MiB); None on a CPU. Tigon's workspace
    arena is released first, so the scratch its kernels borrow during the call counts (it persists between calls,
    and left in place it would sit in the baseline)."""
    if not ctx.cuda:
        return None
    _restore(restore)
    torch.cuda.synchronize()
    _release_workspace(ctx.device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def _release_workspace(device) -> None:
    try:
        from tigon.memory import workspace
    except ImportError:  # a baseline tree without the arena
        return
    workspace(device).release()
    torch.cuda.empty_cache()


def relerr(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| computed in ref's precision (fp64 or fp32)."""
    a = a.detach().to(ref.dtype)
    ref = ref.detach()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def errors(names: Sequence[str], values: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> dict:
    return {n: relerr(v, r) for n, v, r in zip(names, values, refs)}


# ----------------------------------------------------------------------------- one op, all providers


def _as_tuple(o):
    return tuple(o) if isinstance(o, (tuple, list)) else (o,)


def measure(ctx: Context, op: str, case: str, providers, *, bytes_fwd=None, bytes_fb=None, flops_fb=None,
            floor_us=None, check=None, do_fwd=True, host_column=True, min_rep=10, host_min_rep=None,
            rep_ms=250.0, need_s=8.0, group=None, x=None, extra=None) -> None:
    """Time every provider on one case and add one row each.

    providers: [(name, factory)], factory() -> Call (or raises Skip).
    check(outs, grads) -> {name: rel err}: outputs and grads of one fwd+bwd, compared with a reference.
    bytes_*: the op's minimal traffic (GB/s, % of the copy ceiling); flops_fb / floor_us: for matmul ops.
    need_s: do not start a provider with less than this left in the budget.
    """
    if ctx.quick:
        min_rep, rep_ms = min(min_rep, 3), min(rep_ms, 30.0)
        host_min_rep = min(host_min_rep or min_rep, 3)
    for name, factory in providers:
        row = {"op": op, "case": case, "provider": name, "device": ctx.device.type}
        if group is not None:
            row.update(group=group, x=x)
        if extra:
            row.update(extra)
        if ctx.remaining() < need_s:
            row["note"] = "skipped: time budget"
            ctx.add(row)
            continue
        try:
            _measure_one(ctx, row, factory, bytes_fwd=bytes_fwd, bytes_fb=bytes_fb, flops_fb=flops_fb,
                         floor_us=floor_us, check=check, do_fwd=do_fwd, host_column=host_column,
                         min_rep=min_rep, host_min_rep=host_min_rep or min_rep, rep_ms=rep_ms)
        except Skip as e:
            row["note"] = str(e)
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
            print(f"ERROR {op}/{case}/{name}: {short_error(e, 2000)}", flush=True)
            traceback.print_exc()
        ctx.add(row)
        free(ctx)
        check_cuda(ctx)


def _measure_one(ctx, row, factory, *, bytes_fwd, bytes_fb, flops_fb, floor_us, check, do_fwd, host_column,
                 min_rep, host_min_rep, rep_ms) -> None:
    call = factory()
    rs = call.restore

    def fwd():
        return call.fn()

    def fb():
        return torch.autograd.grad(_as_tuple(call.fn()), call.inputs, call.grad_outputs)

    t0 = time.time()
    _restore(rs)
    fb()  # compiles / autotunes / JITs, forward and backward
    if ctx.cuda:
        torch.cuda.synchronize()
    row["first_call_s"] = time.time() - t0
    if check is not None:
        try:
            _restore(rs)
            outs = _as_tuple(call.fn())
            o_copy = [o.detach().clone() for o in outs]
            g = torch.autograd.grad(outs, call.inputs, call.grad_outputs)
            g_copy = [t.detach().clone() for t in g]
            del outs, g
            row["err"] = check(o_copy, g_copy)
            del o_copy, g_copy
        except Exception as e:  # noqa: BLE001
            row["err_note"] = short_error(e)
            check_cuda(ctx)
    stages = []
    if do_fwd:
        stages.append(("fwd", fwd, True, min_rep, 2))
    stages.append(("fb", fb, True, min_rep, 2))
    if host_column:
        stages.append(("fb_host", fb, False, host_min_rep, 1))
    for key, fn, runahead, reps, passes in stages:
        if ctx.remaining() < 0:
            row["note"] = "partial: time budget"
            return
        r = bench(ctx, fn, rs, runahead=runahead, min_rep=reps, rep_ms=rep_ms, passes=passes)
        row[f"{key}_us"] = 1e3 * r["ms"]
        if key == "fb_host":
            row["fb_host_enqueue_us"] = r["cpu_us"]
        else:
            row[f"{key}_n"] = r["n"]
            row[f"{key}_spread_pct"] = r["spread_pct"]
            row[f"{key}_enqueue_us"] = r["cpu_us"]
            row[f"{key}_spin_ms"] = r["spin_ms"]
    copy = ctx.ceilings.get("copy_GBps")
    if bytes_fwd and row.get("fwd_us"):
        row["fwd_GBps"] = bytes_fwd / (row["fwd_us"] * 1e-6) / 1e9
    if bytes_fb and row.get("fb_us"):
        row["fb_GBps"] = bytes_fb / (row["fb_us"] * 1e-6) / 1e9
        if copy:
            row["fb_pct_ceiling"] = 100 * row["fb_GBps"] / copy
        if copy and row.get("fwd_GBps"):
            row["fwd_pct_ceiling"] = 100 * row["fwd_GBps"] / copy
    if flops_fb and row.get("fb_us"):
        row["fb_TFLOPs"] = flops_fb / (row["fb_us"] * 1e-6) / 1e12
    if floor_us and row.get("fb_us"):
        row["fb_pct_floor"] = 100 * floor_us / row["fb_us"]
    if ctx.cuda and ctx.remaining() > 0:
        if do_fwd:
            row["fwd_peak_MiB"] = peak_mib(ctx, fwd, rs)
        row["fb_peak_MiB"] = peak_mib(ctx, fb, rs)


def record_floor(ctx: Context, op: str, case: str, gemms: dict, flops_fb: float, group=None, x=None,
                 min_rep=10, label="3-GEMM floor") -> float | None:
    """Time named GEMM callables (the matmul floor of an op) and add a `label` row; returns the floor in us."""
    row = {"op": op, "case": case, "provider": label, "device": ctx.device.type}
    if group is not None:
        row.update(group=group, x=x)
    try:
        total = 0.0
        for k, fn in gemms.items():
            ms = bench(ctx, fn, min_rep=min_rep, rep_ms=150.0)["ms"]
            row[f"{k}_us"] = 1e3 * ms
            total += ms
        row["fb_us"] = 1e3 * total
        row["fb_TFLOPs"] = flops_fb / (total * 1e-3) / 1e12
        row["fb_pct_floor"] = 100.0
    except Exception as e:  # noqa: BLE001
        row["error"] = short_error(e)
    ctx.add(row)
    free(ctx)
    check_cuda(ctx)
    return row.get("fb_us")


# ----------------------------------------------------------------------------- providers' plumbing


def need_cuda(ctx: Context, what: str) -> None:
    if not ctx.cuda:
        raise Skip(f"{what}: needs CUDA")


def import_first(*candidates: str):
    """The first importable 'module:attr' of the candidates; Skip with the reason when none imports."""
    import importlib

    reasons = []
    for c in candidates:
        mod, attr = c.split(":")
        try:
            return getattr(importlib.import_module(mod), attr)
        except Exception as e:  # noqa: BLE001
            reasons.append(short_error(e, 120))
    raise Skip(f"not importable ({reasons[0]})")


def compiled(ctx: Context, fn: Callable, **kw) -> Callable:
    """torch.compile of the eager formula (default mode, as in the peer reference timings); not on CPU (compile time).
    The recompile limits are raised: past them dynamo would silently run the eager code instead."""
    if not ctx.cuda:
        raise Skip("torch.compile: not benchmarked on CPU")
    import torch._dynamo

    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 256))
    return torch.compile(fn, **kw)


def with_kwargs(fn: Callable, what: str, **kwargs) -> Callable:
    """fn with extra keyword arguments, or Skip when this version of fn does not take them."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in kwargs if k not in params]
    if missing and not takes_any:
        raise Skip(f"{what}: no {', '.join(missing)} argument in this version")
    return lambda *a, **k: fn(*a, **k, **kwargs)


def randn(shape, ctx: Context, dtype=torch.bfloat16, std=1.0, requires_grad=False, gen=None) -> torch.Tensor:
    t = torch.randn(shape, device=ctx.device, generator=gen) * std
    return t.to(dtype).requires_grad_(requires_grad)


# ----------------------------------------------------------------------------- ceilings


def _ceiling_ms(ctx: Context, fn: Callable) -> float:
    """Median ms of one long kernel: triton.testing.do_bench on a GPU (L2 flushed before each call, ~300 ms of
    calls), `bench`'s host wall time on a CPU."""
    if not ctx.cuda:
        return bench(ctx, fn, min_rep=10, rep_ms=300.0)["ms"]
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=300, return_mode="median")


def _copy_GBps(ctx: Context, n: int) -> float:
    src = torch.randn(n, device=ctx.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * n * 2 / (_ceiling_ms(ctx, lambda: dst.copy_(src)) * 1e-3) / 1e9  # read + write


def _mm_TFLOPs(ctx: Context, m: int) -> float:
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(m, m, device=ctx.device).to(torch.bfloat16)
    b = torch.randn(m, m, device=ctx.device).to(torch.bfloat16)
    return 2 * m**3 / (_ceiling_ms(ctx, lambda: torch.mm(a, b)) * 1e-3) / 1e12


def run_ceilings(ctx: Context) -> None:
    """D2D copy of 2 GiB -> GB/s ((read + write) / time) and bf16 torch.mm 8192^3 -> TFLOP/s."""
    full = ctx.cuda and not ctx.quick
    n, m = ((1 << 30) if full else (1 << 24)), (8192 if full else 512)
    try:
        ctx.ceilings.update(copy_GBps=_copy_GBps(ctx, n), copy_bytes=2 * n * 2)
    except Exception as e:  # noqa: BLE001
        ctx.note(f"ceilings: copy failed: {short_error(e)}")
    free(ctx)
    try:
        ctx.ceilings.update(mm_TFLOPs=_mm_TFLOPs(ctx, m), mm_shape=m)
    except Exception as e:  # noqa: BLE001
        ctx.note(f"ceilings: mm failed: {short_error(e)}")
    free(ctx)
    ctx.dump()


def run_rolling_buffer(ctx: Context) -> None:
    """benchmarks/ops/bench_rolling_buffer.py's run(device, steps) -> dict, kept as an extra."""
    try:
        from benchmarks.ops import bench_rolling_buffer
    except Exception as e:  # noqa: BLE001
        ctx.note(f"rolling_buffer: bench_rolling_buffer not importable: {short_error(e)}")
        return
    steps = 5 if ctx.quick else 50
    try:
        res = bench_rolling_buffer.run(ctx.device, steps)
        ctx.extras["rolling_buffer"] = _clean(res if isinstance(res, dict) else {"result": repr(res)})
    except Exception as e:  # noqa: BLE001
        ctx.note(f"rolling_buffer: {short_error(e)}")
        traceback.print_exc()
    ctx.dump()


# ----------------------------------------------------------------------------- report

def num(v) -> str:
    """About 3 significant digits: 12,345 / 861 / 70.1 / 7.01 / 0.0123; '-' for missing."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "-" if v in (None, "") else str(v)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1e4:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return "0" if a == 0 else f"{v:.3g}"


def _err_cell(row) -> str:
    errs = row.get("err") or {}
    parts = [f"{k} {v:.1e}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in errs.items()]
    if row.get("err_note"):
        parts.append(row["err_note"])
    return ", ".join(parts) or "-"


def _tigon_fb(rows) -> float | None:
    for r in rows:
        if r.get("provider") == "tigon" and isinstance(r.get("fb_us"), (int, float)):
            return r["fb_us"]
    return None


CPU_NOTE = ("CPU run: each time is the median host wall time of one call on the CPU (Triton kernels through "
            "the interpreter, or the PyTorch reference). These timings check that the harness runs; they are not "
            "representative of Tigon on a GPU, and no GB/s, TFLOP/s or % of a ceiling is given.")


def on_cpu(rows: list[dict]) -> bool:
    """Whether these rows were measured on a CPU (rows of older runs carry no device: counted as GPU rows)."""
    return bool(rows) and all(r.get("device") == "cpu" for r in rows)


def timing_note(cpu: bool) -> str:
    """The paragraph above the results: how the times were taken."""
    if cpu:
        return CPU_NOTE
    return ("Times are medians of CUDA-event intervals with the L2 flushed and in-place inputs restored "
            "before each call. fwd / fwd+bwd: GPU time with host run-ahead (a GPU spin queued first); "
            "host-incl: fwd+bwd without the spin, from an idle GPU (launch latency included); host "
            "enqueue: host time to enqueue one fwd+bwd. GB/s from the byte model over the fwd+bwd time, "
            "% of the D2D copy ceiling (or, for FLCE, % of the 3-GEMM floor timed here). Peak: "
            "max_memory_allocated during one call minus the allocation before it. vs tigon: this "
            "provider's fwd+bwd time / tigon's (> 1: tigon is faster).")


def op_table(rows: list[dict], ceilings: dict, unit: str = "us") -> list[str]:
    """The markdown table of one (op, case): one line per provider. Memory-bound ops get GB/s and % of
    the copy ceiling; matmul-bound ones (rows with TFLOP/s and no byte model) TFLOP/s and % of the floor.
    On a CPU those rate cells say "n/a (CPU)": an interpreter's wall time says nothing about bandwidth."""
    scale = 1e-3 if unit == "ms" else 1.0
    cpu = on_cpu(rows)
    flops = any(r.get("fb_TFLOPs") is not None for r in rows) and not any(r.get("fb_GBps") for r in rows)
    t_fb = _tigon_fb(rows)

    def t(key):
        return lambda r: num(r[key] * scale if isinstance(r.get(key), (int, float)) else r.get(key))

    def vs(r):
        if t_fb and isinstance(r.get("fb_us"), (int, float)) and r["provider"] != "tigon":
            return f"{r['fb_us'] / t_fb:.2f}x"
        return "-"

    cols = [("provider", lambda r: r["provider"]), (f"fwd {unit}", t("fwd_us")), (f"fwd+bwd {unit}", t("fb_us")),
            (f"host-incl {unit}", t("fb_host_us")), (f"host enqueue {unit}", t("fb_enqueue_us"))]
    if flops:
        cols += [("fwd+bwd TFLOP/s", lambda r: num(r.get("fb_TFLOPs"))),
                 ("% of GEMM floor", lambda r: f"{num(r['fb_pct_floor'])}%" if r.get("fb_pct_floor") else "-")]
    else:
        cols += [("fwd GB/s", lambda r: num(r.get("fwd_GBps"))), ("fwd+bwd GB/s", lambda r: num(r.get("fb_GBps"))),
                 ("% of copy ceiling", lambda r: f"{num(r['fb_pct_ceiling'])}%" if r.get("fb_pct_ceiling") else "-")]
    if cpu:
        cols[5:] = [(head, lambda r: "n/a (CPU)") for head, _ in cols[5:]]
    cols += [("fwd peak MiB", lambda r: num(r.get("fwd_peak_MiB"))),
             ("fwd+bwd peak MiB", lambda r: num(r.get("fb_peak_MiB"))), ("errors (rel L2)", _err_cell),
             ("vs tigon", vs)]
    lines = ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if r.get("error") or (r.get("note") and r.get("fb_us") is None):
            msg = (r.get("error") or r.get("note")).replace("|", "/")
            lines.append(f"| {r['provider']} | {msg} |" + " |" * (len(cols) - 2))
            continue
        cells = [f(r) for _, f in cols]
        if r.get("note"):
            cells[-1] += f" ({r['note']})"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def sweep_table(rows: list[dict], xlabel: str) -> list[str]:
    """A pivot: one line per x, one column per provider with fwd+bwd time and peak memory."""
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    xs = list(dict.fromkeys(r["x"] for r in rows))
    by = {(r["x"], r["provider"]): r for r in rows}
    lines = ["| " + xlabel + " | " + " | ".join(provs) + " |", "|" + "---|" * (len(provs) + 1)]
    for x in xs:
        cells = [str(x)]
        for p in provs:
            r = by.get((x, p))
            if r is None:
                cells.append("-")
            elif r.get("fb_us") is None:
                cells.append((r.get("error") or r.get("note") or "-")[:60])
            else:
                us = r["fb_us"]
                s = f"{num(us / 1e3)} ms" if us >= 1e4 else f"{num(us)} us"
                if r.get("fb_GBps") is not None and r.get("device") != "cpu":
                    s += f", {num(r['fb_GBps'])} GB/s"
                if r.get("fb_peak_MiB") is not None:
                    s += f", {num(r['fb_peak_MiB'])} MiB"
                cells.append(s)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def group_rows(rows: list[dict]):
    """(title, rows, kind) in first-seen order: one per (op, case), and one per sweep group."""
    out: dict = {}
    for r in rows:
        key = ("sweep", r["group"]) if r.get("group") else ("op", r["op"], r["case"])
        out.setdefault(key, []).append(r)
    return out


def markdown_tables(rows: list[dict], ceilings: dict) -> list[str]:
    lines = [CPU_NOTE, ""] if on_cpu(rows) else []
    for key, rs in group_rows(rows).items():
        if key[0] == "op":
            unit = "ms" if any((r.get("fb_us") or 0) > 2e4 for r in rs) else "us"
            lines += [f"### {key[1]}: {key[2]}", ""]
            model = next((r["model"] for r in rs if r.get("model")), None)
            if model:
                lines += [f"Byte/FLOP model: {model}", ""]
            lines += op_table(rs, ceilings, unit) + [""]
        else:
            lines += [f"### {key[1]}", ""] + sweep_table(rs, rs[0].get("xlabel", "x")) + [""]
    return lines


def standalone(sections: dict, argv=None) -> int:
    """`python -m benchmarks X [--quick] [--budget S] [--only NAME] [--json FILE]` for an op module's SECTIONS: run
    in this process, print the tables."""
    p = argparse.ArgumentParser(description="Run these benchmarks in this process and print the tables.")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
    p.add_argument("--budget", type=float, default=300.0, help="seconds")
    p.add_argument("--only", default=None, help="comma-separated section names (default: all)")
    p.add_argument("--json", default=None, help="write the raw rows here")
    a = p.parse_args(argv)
    if a.quick and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    ctx = Context(quick=a.quick, deadline=time.time() + a.budget, part_path=a.json)
    run_ceilings(ctx)
    for name, fn in sections.items():
        if a.only and name not in a.only.split(","):
            continue
        fn(ctx)
    print("\n".join(markdown_tables(ctx.rows, ctx.ceilings)))
    return 0
