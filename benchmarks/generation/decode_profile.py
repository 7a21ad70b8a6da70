"""Where a tigon.generate call's time goes: torch.profiler traces of its TTFT and decode steps, bucketed.

Used by `python -m benchmarks decode --profile` (benchmarks/generation/bench_decode.py; its module docstring describes
the method: three profiled calls of 1, 3 and 3 + steps new tokens, the longer call's extra kernels being exactly its
last `steps` decode steps).
"""

import re


def sync(device):
    """Wait for the device (CUDA); a no-op on a CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


PROFILE_STEPS = 20


# Kernel-name buckets of the profile, first match wins (lowercased substrings; CPU op names in --quick).
BUCKETS = (
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "cublas", "xmma", "splitkreduce", "aten::mm", "aten::addmm",
              "aten::bmm", "decode_linear")),  # tigon's decode_linear: the projections of a fused decode step
    ("attention", ("decode_attention", "attention", "flash", "fmha", "sdpa")),
    ("rope_kv_write", ("rope",)),
    ("norms", ("rms_norm", "layer_norm", "rmsnorm", "layernorm")),
    ("glu", ("glu",)),
    ("other triton", ()),  # a bare identifier (a Triton kernel's function name), not matched above
    ("other torch", ()),   # ATen's C++ kernels (elementwise, copies, sampling), memcpy/memset, CPU ops
)


def _bucket(name):
    low = name.lower()
    for bucket, keys in BUCKETS[:-2]:
        if any(k in low for k in keys):
            return bucket
    return "other triton" if re.fullmatch(r"[A-Za-z_]\w*", name) else "other torch"


def _on_the_chain(events):
    """events [(start, end, name, duration)] of one stream, sorted by start -> [(start, end, name, busy, duration)]
    where busy is the part of the event's interval no earlier event covers. With programmatic dependent launch a
    kernel's programs start while its predecessor still runs and wait (ops/_pdl.py): the profiler's duration counts
    that wait, so durations overlap and their sum passes the span; busy times sum to the time some kernel ran, each
    instant given to the kernel that was running first (the one being waited on)."""
    out, frontier = [], float("-inf")
    for start, end, name, duration in events:
        out.append((start, end, name, max(0.0, end - max(start, frontier)), duration))
        frontier = max(frontier, end)
    return out


def _trace_events(prof, cuda):
    """[(start_us, end_us, name, busy_us, duration_us)] by start: the CUDA kernels / memcpys / memsets on CUDA
    (busy: `_on_the_chain`), the CPU ops on a CPU (busy = duration = self CPU time)."""
    from torch.autograd import DeviceType

    events = []
    for e in prof.events():
        if cuda and e.device_type == DeviceType.CUDA:
            busy = e.time_range.end - e.time_range.start
        elif not cuda and e.device_type == DeviceType.CPU and not e.is_async:
            busy = e.self_cpu_time_total
        else:
            continue
        events.append((e.time_range.start, e.time_range.end, e.name, busy))
    events.sort(key=lambda ev: (ev[0], ev[1]))
    return _on_the_chain(events) if cuda else [ev + (ev[3],) for ev in events]


def _summary(events, steps, top=8):
    """Per-step kernel count, kernel time (busy: overlaps counted once), the kernels' summed durations, traced span
    and bucket times (ms, busy), and the top kernels by busy time."""
    buckets = {name: 0.0 for name, _ in BUCKETS}
    by_name = {}
    for _, _, name, busy, *_ in events:
        buckets[_bucket(name)] += busy
        n, t = by_name.get(name, (0, 0.0))
        by_name[name] = (n + 1, t + busy)
    span = (max(ev[1] for ev in events) - events[0][0]) if events else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(kernels=len(events) / steps, kernel_ms=sum(ev[3] for ev in events) / 1e3 / steps,
                launched_ms=sum(ev[-1] for ev in events) / 1e3 / steps,
                span_ms=span / 1e3 / steps, buckets_ms={k: v / 1e3 / steps for k, v in buckets.items()},
                top=[dict(name=name[:120], bucket=_bucket(name), per_step=n / steps, ms=t / 1e3 / steps)
                     for name, (n, t) in ranked])


def _by_name_difference(big, small):
    """The events of `big` beyond `small`'s count of their name: `big`'s first occurrences of each name are
    matched to `small`'s (the calls start alike), the rest are the extra steps."""
    count = {}
    for ev in small:
        count[ev[2]] = count.get(ev[2], 0) + 1
    extra = []
    for ev in big:
        if count.get(ev[2], 0) > 0:
            count[ev[2]] -= 1
        else:
            extra.append(ev)
    return extra


def weight_bytes(model):
    """Bytes of the weights one decode step's GEMMs read: every parameter once (a tied lm_head once), the input
    embedding left out unless it is the lm_head (a lookup reads B rows of it); and all parameters' bytes."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == emb.data_ptr()
    seen, gemm, total = set(), 0, 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        n = p.numel() * p.element_size()
        total += n
        if tied or p.data_ptr() != emb.data_ptr():
            gemm += n
    return gemm, total


def profile_tigon(model, ids, kw, spec, stats, steps=PROFILE_STEPS):
    """torch.profiler over one TTFT (max_new_tokens=1) and `steps` decode steps (the last steps of a call with 3 +
    steps new tokens, located by the kernel count of a 3-token call); see the module docstring. On the graph
    path the decode traces start right after the capture (the profiler never runs over a capturing stream) and
    the TTFT trace comes first (the profiler is initialized before the graphs it sees are made)."""
    from torch.profiler import ProfilerActivity, profile

    import tigon

    device = ids.device
    cuda = device.type == "cuda"
    p = ids.shape[1]
    kw = dict(kw, return_stats=True, capacity=max(p + spec["new"], p + 3 + steps))  # the timed call's ring

    def trace(new, after_capture=False):
        sync(device)
        prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        started = []

        def start():
            sync(device)
            prof.start()
            started.append(True)

        # After the CUDA-graph capture (the profiler never runs over a capturing stream): the loop's hook.
        settings = tigon.DecodeSettings(on_capture=start) if after_capture else tigon.DecodeSettings()
        if not after_capture:
            start()
        try:
            _, st = tigon.generate(model, ids, **dict(kw, max_new_tokens=new), settings=settings)
            sync(device)
        finally:
            if started:
                prof.stop()
        if not started:
            raise RuntimeError("the profiled call did not capture a CUDA graph (the timed call did)")
        return _trace_events(prof, cuda), st

    first, first_stats = trace(1)
    small, _ = trace(3, after_capture=stats["cuda_graph"])
    big, big_stats = trace(3 + steps, after_capture=stats["cuda_graph"])
    extra = len(big) - len(small)
    if extra > 0 and extra % steps == 0:
        window, located = big[-extra:], "last kernels"
    else:  # a kernel count that is not the same every step: the per-name difference (no span)
        window, located = _by_name_difference(big, small), "per-name difference"
    decode = _summary(window, steps)
    if located != "last kernels":
        decode["span_ms"] = None
    gemm_bytes, param_bytes = weight_bytes(model)
    p50_ms = 1e3 * stats["p50_step_s"] if stats["p50_step_s"] else None
    gemm_ms = decode["buckets_ms"]["gemm"]
    decode.update(steps=steps, located=located, measured_p50_ms=p50_ms,
                  gap_ms=p50_ms - decode["kernel_ms"] if p50_ms is not None else None,
                  gemm_weight_bytes=gemm_bytes, param_bytes=param_bytes,
                  gemm_GBps=gemm_bytes / gemm_ms / 1e6 if gemm_ms > 0 else None,
                  cuda_graph=big_stats["cuda_graph"], traced_from="after the capture" if stats["cuda_graph"]
                  else "the call's start")
    prefill = _summary(first, 1)
    prefill.update(measured_ttft_ms=1e3 * stats["ttft_s"], traced_ttft_ms=1e3 * first_stats["ttft_s"])
    return dict(activity="cuda kernels" if cuda else "cpu ops (no CUDA kernels)", decode=decode, prefill=prefill)
