"""Where tigon.generate's time to first token goes on the host: cProfile of warm calls with max_new_tokens=1
(a model of bench_decode, prompt 512), top functions by own time and by cumulative time, then the kernels one
call launches (torch.profiler: count, GPU time, the host time it spans).

    PYTHONPATH=src python -m benchmarks profile-ttft [--model llama-1.5b|llama3-8b] [--batch 1] [--calls 5] [--top 35]
"""

import argparse
import cProfile
import io
import pstats
import time

import torch

import tigon
from benchmarks.generation.bench_decode import MODELS, build
from benchmarks.generation.decode_report import DEFAULT_MODEL


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = dict(quick=device == "cpu", prompt=args.prompt, new=1, device=device, family="llama", batch=args.batch,
                window=None, model=args.model)
    model, ids = build(spec)
    tigon.patch(model)
    for _ in range(3):  # JIT, autotune, allocator warm-up
        tigon.generate(model, ids, max_new_tokens=1)
    torch.cuda.synchronize() if device == "cuda" else None
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.calls):
        _, stats = tigon.generate(model, ids, max_new_tokens=1, return_stats=True)
    prof.disable()
    wall = (time.perf_counter() - t0) / args.calls
    print(f"{args.calls} calls, {1e3 * wall:.1f} ms each (profiled); last TTFT {1e3 * stats['ttft_s']:.1f} ms; "
          f"host phases ms: { {k: round(1e3 * v, 2) for k, v in stats['ttft_host_phases_s'].items()} }")
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue())
    if device == "cuda":
        kernels_of_one_call(model, ids)


def kernels_of_one_call(model, ids):
    """The kernels of one warm max_new_tokens=1 call: how many, their GPU time, and the call's host time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        tigon.generate(model, ids, max_new_tokens=1)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in kernels) / 1e3
    print(f"one call under the profiler: {len(kernels)} kernels, {busy:.2f} ms of kernel time, "
          f"{1e3 * wall:.1f} ms wall")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
