"""Prometheus text exposition of `tigon.generate(..., return_stats=True)` statistics.

    from tigon.metrics import prometheus_text
    print(prometheus_text(stats))                                   # one run
    print(prometheus_text([({"variant": "a"}, s1), ({"variant": "b"}, s2)]))   # one series per run
"""

import math
import re

LATENCY_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1,
                   0.25, 1.0)
_PREFIX = "tigon_generate_"
# (name, help, stats key); gauges whose stats value is None (peak memory on a CPU) are left out.
_GAUGES = (
    ("time_to_first_token_seconds", "Time from the generate call to the first token", "ttft_s"),
    ("step_latency_p50_seconds", "Median decode step latency", "p50_step_s"),
    ("step_latency_p99_seconds", "99th percentile decode step latency", "p99_step_s"),
    ("tokens_per_second", "Generated tokens per second over the whole call (batch * new tokens / time)",
     "tokens_per_s"),
    ("decode_tokens_per_second", "Generated tokens per second over the decode steps", "decode_tokens_per_s"),
    ("peak_memory_bytes", "Peak CUDA memory allocated during the call", "peak_memory_bytes"),
    ("new_tokens", "New tokens per row", "new_tokens"),
    ("batch_size", "Rows generated", "batch_size"),
    ("cuda_graph", "1 when the decode steps replayed a CUDA graph", "cuda_graph"),
)
_HISTOGRAM = ("step_latency_seconds", "Decode step latency (every step after the first token)", "step_s")


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _label_names(lab):
    if not isinstance(lab, dict):
        raise TypeError(f"prometheus_text: labels must be a dict {{name: value}}, got {type(lab).__name__}")
    for name in lab:
        # the exposition format's label names; "__" is reserved, "le" is the histogram's bucket label
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__") or name == "le":
            raise ValueError(f"prometheus_text: {name!r} is not a usable label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                             "not __-prefixed, not le)")
    return dict(lab)


def _runs(stats, labels):
    if isinstance(stats, dict):
        return [(_label_names(labels or {}), stats)]
    if labels is not None:
        raise ValueError("prometheus_text: labels= goes with one stats dict; a list carries (labels, stats) pairs")
    if not isinstance(stats, (list, tuple)) or not all(
            isinstance(run, (list, tuple)) and len(run) == 2 and isinstance(run[1], dict) for run in stats):
        raise TypeError("prometheus_text: stats must be generate's stats dict or a list of (labels, stats) pairs, "
                        f"got {type(stats).__name__}")
    runs = [(_label_names(lab or {}), st) for lab, st in stats]
    keys = {tuple(sorted(lab)) for lab, _ in runs}
    if len(keys) > 1:
        raise ValueError(f"prometheus_text: every run needs the same label names, got {sorted(keys)}")
    return runs


def prometheus_text(stats, labels=None) -> str:
    """The `stats` of `generate(..., return_stats=True)` in the Prometheus text exposition format (0.0.4).

    `stats` is one stats dict (with optional `labels` {name: value}) or a list of `(labels, stats)` pairs, one
    series per run. Metrics (prefix `tigon_generate_`): gauges time_to_first_token_seconds,
    step_latency_p50_seconds, step_latency_p99_seconds, tokens_per_second, decode_tokens_per_second,
    peak_memory_bytes (absent on a CPU), new_tokens, batch_size, cuda_graph; histogram step_latency_seconds
    (buckets LATENCY_BUCKETS) of every decode step. Uses prometheus_client when it is installed (its registry
    and generate_latest, which adds the histogram's `_created` sample); without it the same metrics are
    written by hand, so the function never needs the package."""
    runs = _runs(stats, labels)
    names = sorted(runs[0][0]) if runs else []
    try:
        import prometheus_client
    except ImportError:
        return _prometheus_by_hand(runs)
    registry = prometheus_client.CollectorRegistry()
    for name, doc, key in _GAUGES:
        values = [(lab, st.get(key)) for lab, st in runs if st.get(key) is not None]
        if values:
            gauge = prometheus_client.Gauge(_PREFIX + name, doc, names, registry=registry)
            for lab, v in values:
                (gauge.labels(**lab) if names else gauge).set(float(v))
    name, doc, key = _HISTOGRAM
    hist = prometheus_client.Histogram(_PREFIX + name, doc, names, buckets=LATENCY_BUCKETS, registry=registry)
    for lab, st in runs:
        child = hist.labels(**lab) if names else hist
        for s in st.get(key) or ():
            child.observe(s)
    return prometheus_client.generate_latest(registry).decode()


def _fmt(v) -> str:
    v = float(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(v)


def _labels(lab, extra=None) -> str:
    items = sorted(lab.items()) + list((extra or {}).items())  # sorted names, as the client's label order
    if not items:
        return ""
    esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in items) + "}"


def _prometheus_by_hand(runs) -> str:
    lines = []
    for name, doc, key in _GAUGES:
        values = [(lab, st.get(key)) for lab, st in runs if st.get(key) is not None]
        if values:
            lines += [f"# HELP {_PREFIX}{name} {doc}", f"# TYPE {_PREFIX}{name} gauge"]
            lines += [f"{_PREFIX}{name}{_labels(lab)} {_fmt(v)}" for lab, v in values]
    name, doc, key = _HISTOGRAM
    full = _PREFIX + name
    lines += [f"# HELP {full} {doc}", f"# TYPE {full} histogram"]
    for lab, st in runs:
        steps = list(st.get(key) or ())
        for le in (*LATENCY_BUCKETS, math.inf):
            lines.append(f"{full}_bucket{_labels(lab, {'le': _fmt(le)})} {_fmt(sum(s <= le for s in steps))}")
        lines += [f"{full}_count{_labels(lab)} {_fmt(len(steps))}", f"{full}_sum{_labels(lab)} {_fmt(sum(steps))}"]
    return "\n".join(lines) + "\n"
