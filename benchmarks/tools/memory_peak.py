"""What is on the card at a step's peak: torch's allocator trace (`torch.cuda.memory._record_memory_history`)
replayed to its largest moment, the blocks live there summed by the code that allocated them.

torch's own viewer (pytorch.org/memory_viz) draws a trace; this gives the few numbers a memory plan is checked
against, as text and JSON, on a machine without a browser.

    with recording() as rec:
        step()
    report = peak_report(rec["snapshot"])   # {"peak_bytes", "event", "at", "sites": [(site, bytes)], ...}
"""

import contextlib

# the frames that name an allocation's site: the first of these, innermost first; else the innermost frame
_OURS = ("/tigon/", "/transformers/", "/peft/", "/liger_kernel/", "/benchmarks/")


def site(frames) -> str:
    """'file.py:line function' of the innermost frame inside Tigon, transformers, PEFT, Liger or the benchmarks."""
    pick = next((f for f in frames if any(s in f["filename"] for s in _OURS)), frames[0] if frames else None)
    if pick is None:
        return "(no stack)"
    return f"{pick['filename'].rsplit('/', 1)[-1]}:{pick['line']} {pick['name']}"


def replay(trace):
    """(peak bytes, index of the event that reached it, {addr: event} live there): allocations add, requested
    frees remove, as in the allocator's `allocated_bytes` (what `max_memory_allocated` reads). A block used on a
    second stream (`record_stream`) is reused only at its "free_completed", once that stream is past it; it is
    no longer allocated from its "free_requested" on."""
    live, now, peak, at = {}, 0, -1, -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            now += ev["size"]
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            now -= live.pop(ev["addr"])["size"]
        if now > peak:
            peak, at = now, i
    live = {}
    for ev in trace[: at + 1]:  # the blocks live at the peak
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    return peak, at, live


def peak_report(snapshot, top: int = 20, device: int = 0) -> dict:
    """The peak of the recorded trace of `device` (bytes allocated while recording: add what was allocated
    before it started), where it happened and the `top` allocation sites live at it, largest first."""
    trace = snapshot["device_traces"][device]
    peak, at, live = replay(trace)
    sites = {}
    for ev in live.values():
        key = site(ev.get("frames") or [])
        sites[key] = sites.get(key, 0) + ev["size"]
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])
    return dict(peak_bytes=peak, event=at, events=len(trace),
                at=site(trace[at].get("frames") or []) if at >= 0 else None,
                sites=ranked[:top], other_bytes=sum(b for _, b in ranked[top:]))


@contextlib.contextmanager
def recording(max_entries: int = 2_000_000):
    """Record the CUDA allocator's events (with Python stacks) inside the block; the yielded dict holds the
    snapshot under "snapshot" afterwards and "before", the bytes allocated when recording began."""
    import torch

    out = dict(before=torch.cuda.memory_allocated())
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield out
    finally:
        out["snapshot"] = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)


def text(report, gib=2**30) -> str:
    lines = [f"peak {report['peak_bytes'] / gib:.2f} GiB recorded, at event {report['event']} of {report['events']}"
             f" ({report['at']})", "| allocated at | GiB |", "|---|---|"]
    lines += [f"| {s} | {b / gib:.3f} |" for s, b in report["sites"]]
    lines.append(f"| (the rest) | {report['other_bytes'] / gib:.3f} |")
    return "\n".join(lines)
