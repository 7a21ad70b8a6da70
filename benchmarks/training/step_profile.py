"""GPU kernel time of one training step by bucket, the one rule bench_e2e.py and bench_lora.py share.

No torch at import (the benchmarks' parent processes stay light); `profile_step` imports it.
"""

BUCKETS = ("gemm", "attention", "triton kernels", "inductor kernels", "elementwise", "optimizer", "copy/memset",
           "other")
_INDUCTOR = ("triton_poi_", "triton_red_", "triton_per_", "triton_tem_")  # inductor's generated kernels


def kernel_bucket(name: str) -> str:
    """The bucket of a CUDA kernel, from its name."""
    n = name.lower()
    if any(s in n for s in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "matmul", "splitk")):
        return "gemm"
    if any(s in n for s in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if n.startswith(_INDUCTOR):
        return "inductor kernels"
    if any(s in n for s in ("adam", "multi_tensor", "foreach")):
        return "optimizer"
    if any(s in n for s in ("memcpy", "memset", "copy_kernel")):
        return "copy/memset"
    if any(s in n for s in ("at::native", "elementwise", "reduce_kernel", "void at::")):
        return "elementwise"
    if n.startswith("_") or "kernel" in n or n.startswith("triton"):
        return "triton kernels"  # Tigon's and Liger's Triton kernels carry their function's name
    return "other"


def kernel_table(totals, min_ms=0.05):
    """Every kernel of a step that took at least min_ms in all: totals as (name, launches, device us) ->
    [(bucket, name, launches, ms)], longest first. The per-op breakdown behind the buckets."""
    rows = [(kernel_bucket(n), n[:100], c, round(us / 1e3, 3)) for n, c, us in totals if us / 1e3 >= min_ms]
    return sorted(rows, key=lambda r: -r[3])


def profile_step(model, opt, ids, step_begin=None):
    """One step (forward with labels = ids, backward, optimizer step) under torch.profiler: kernel ms by bucket,
    the top 15 kernels, every kernel of at least 0.05 ms (`kernels`) and the timeline. step_begin: called first
    (torch.compiler.cudagraph_mark_step_begin for a model compiled with CUDA graphs, which would otherwise record
    new graphs inside the profiled step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if step_begin is not None:
        step_begin()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    buckets = dict.fromkeys(BUCKETS, 0.0)
    events = prof.key_averages()
    for ev in events:
        buckets[kernel_bucket(ev.key)] += ev.self_device_time_total / 1e3
    top = sorted(((ev.self_device_time_total / 1e3, ev.key) for ev in events), reverse=True)[:15]
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    table = kernel_table([(ev.key, ev.count, ev.self_device_time_total) for ev in events])
    return dict(buckets_ms={k: round(v, 2) for k, v in buckets.items()},
                top=[(k[:90], round(ms, 2)) for ms, k in top], kernels=table, timeline=timeline(kernels))


def timeline(kernels, n_gaps=8):
    """Where the GPU waited inside a step: kernels as (start_us, end_us, name). Returns the span from the first
    kernel's start to the last one's end, the time some kernel ran (the union of the intervals), the rest (idle),
    and the n_gaps longest idle gaps with the kernels on either side. The profiler's own host cost widens gaps
    where the host, not the GPU, is the bottleneck."""
    if not kernels:
        return dict(span_ms=0.0, busy_ms=0.0, idle_ms=0.0, gaps=[])
    kernels = sorted(kernels)
    busy, gaps = 0.0, []
    start, end, last = kernels[0][0], kernels[0][1], kernels[0][2]
    for s, e, name in kernels[1:]:
        if s > end:
            busy += end - start
            gaps.append((s - end, last, name))
            start, end = s, e
        elif e > end:
            end = e
        if e >= end:
            last = name
    busy += end - start
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    top = sorted(gaps, reverse=True)[:n_gaps]
    return dict(span_ms=round(span / 1e3, 3), busy_ms=round(busy / 1e3, 3), idle_ms=round((span - busy) / 1e3, 3),
                gaps=[(round(g / 1e3, 3), a[:60], b[:60]) for g, a, b in top])
