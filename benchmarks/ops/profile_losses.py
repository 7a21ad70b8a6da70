"""Where a fused-linear loss spends its step: host time to enqueue one forward + backward, GPU kernel time by
kernel, the GPU's idle time inside the call, and whether anything synchronizes the host.

For each loss at bench_losses.py's shapes (DPO on Llama-3-8B's head with a reference head, GRPO on Qwen-2.5-7B's
head, JSD distillation): one warm-up call, then one call under torch.profiler (CPU + CUDA), and one call under
`torch.cuda.set_sync_debug_mode("warn")` counting the synchronizing calls it warns about. Prints a markdown table
per loss: wall, host enqueue, GPU busy (the union of kernel intervals), GPU kernel sum by bucket, the top kernels
and the top host-side ops by self CPU time.

    PYTHONPATH=src python -m benchmarks profile-losses [--only dpo,grpo,jsd] [--out FILE.md]
"""

import argparse
import sys
import time
import warnings

import torch

from benchmarks.ops import bench_losses as B


class _Ctx:
    device = torch.device("cuda")
    cuda = True
    quick = False


def tigon_call(name):
    """The tigon provider's Call of bench_losses' section `name`, captured from its H.measure call."""
    got = {}

    def grab(ctx, op, case, providers, **kw):
        got.update(dict(providers))

    real = B.H.measure
    B.H.measure = grab
    try:
        B.SECTIONS[name](_Ctx())
    finally:
        B.H.measure = real
    return got["tigon"]()


def run_call(call):
    out = call.fn()
    loss = out[0] if isinstance(out, tuple) else out
    torch.autograd.grad(loss, list(call.inputs))


def _busy_us(events):
    """Union of the kernels' [start, end) intervals, in us."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy


def profile_one(name):
    from torch.profiler import ProfilerActivity, profile

    call = tigon_call(name)
    run_call(call)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run_call(call)
    enqueue = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_call(call)
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message)[:160] for w in caught if "synchroniz" in str(w.message).lower()]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_call(call)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    first = min(e.time_range.start for e in kernels)
    last = max(e.time_range.end for e in kernels)
    by_kernel = {}
    for e in kernels:
        by_kernel[e.name] = by_kernel.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    host = sorted(((ev.self_cpu_time_total, ev.key, ev.count) for ev in prof.key_averages()), reverse=True)[:15]
    lines = [f"## {name}", "",
             f"- wall {wall * 1e3:.1f} ms; host enqueue {enqueue * 1e3:.1f} ms; kernels {len(kernels)}",
             f"- GPU span {(last - first) / 1e3:.1f} ms, busy {_busy_us(kernels) / 1e3:.1f} ms "
             f"(idle {(last - first - _busy_us(kernels)) / 1e3:.1f} ms inside the span)",
             f"- synchronizing calls warned about: {len(syncs)}" + (f" (first: {syncs[0]})" if syncs else ""),
             "", "| kernel | ms |", "|---|---|"]
    for k, us in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:12]:
        lines.append(f"| {k[:100]} | {us / 1e3:.2f} |")
    lines += ["", "| host op (self CPU) | ms | calls |", "|---|---|---|"]
    for us, key, count in host:
        lines.append(f"| {key[:90]} | {us / 1e3:.2f} | {count} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="dpo,grpo,jsd")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_losses: needs a CUDA device", file=sys.stderr)
        return 2
    text = f"# Fused-linear losses: host vs GPU ({torch.cuda.get_device_name()})\n\n"
    for name in a.only.split(","):
        text += profile_one(name) + "\n"
        torch.cuda.empty_cache()
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
