"""Prometheus exposition of `tigon.generate(..., return_stats=True)` statistics.

    from tigon.decode.metrics import StatsCollector, prometheus_text
    print(prometheus_text(stats))                                   # one run, text format 0.0.4
    print(prometheus_text([({"variant": "a"}, s1), ({"variant": "b"}, s2)]))   # one series per run

    collector = StatsCollector(stats, labels={"model": "llama-1b"})  # a server: register once ...
    prometheus_client.REGISTRY.register(collector)
    collector.update(new_stats, labels={"model": "llama-1b"})       # ... and give it each call's stats

`StatsCollector` is a prometheus_client collector (`collect()` yields the metric families). `prometheus_text`
renders it through `prometheus_client.generate_latest` on a fresh `CollectorRegistry` when prometheus_client is
installed, and writes the same bytes by hand when it is not (tests/decode/test_metrics.py compares the two).
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


class StatsCollector:
    """A prometheus_client collector of generate's stats: `stats` is one stats dict (with optional `labels`
    {name: value}) or a list of `(labels, stats)` pairs, one series per run. Metrics (prefix
    `tigon_generate_`): gauges time_to_first_token_seconds, step_latency_p50_seconds, step_latency_p99_seconds,
    tokens_per_second, decode_tokens_per_second, peak_memory_bytes (absent on a CPU), new_tokens, batch_size,
    cuda_graph; histogram step_latency_seconds (buckets LATENCY_BUCKETS) of every decode step."""

    def __init__(self, stats, labels=None):
        self.update(stats, labels)

    def update(self, stats, labels=None) -> None:
        """Expose these stats from now on (checked as in the constructor)."""
        self.runs = _runs(stats, labels)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        names = _names(self.runs)
        for name, doc, key in _GAUGES:
            values = _gauge_values(self.runs, key)
            if values:
                family = GaugeMetricFamily(_PREFIX + name, doc, labels=names)
                for lab, v in values:
                    family.add_metric([str(lab[n]) for n in names], float(v))
                yield family
        name, doc, key = _HISTOGRAM
        family = HistogramMetricFamily(_PREFIX + name, doc, labels=names)
        for lab, st in self.runs:
            buckets, total = _histogram(st.get(key))
            family.add_metric([str(lab[n]) for n in names], [(_fmt(le), n) for le, n in buckets], total)
        yield family


def _names(runs):
    return sorted(runs[0][0]) if runs else []


def _gauge_values(runs, key):
    return [(lab, st.get(key)) for lab, st in runs if st.get(key) is not None]


def _histogram(steps):
    """([(upper bound, cumulative count)] ending with +Inf, sum) of a run's step latencies."""
    steps = list(steps or ())
    return [(le, sum(s <= le for s in steps)) for le in (*LATENCY_BUCKETS, math.inf)], sum(steps)


def prometheus_text(stats, labels=None) -> str:
    """The `stats` of `generate(..., return_stats=True)` in the Prometheus text exposition format (0.0.4):
    `StatsCollector(stats, labels)` rendered by prometheus_client's `generate_latest` on a fresh registry,
    or the same text written here when prometheus_client is not installed."""
    collector = StatsCollector(stats, labels)
    try:
        import prometheus_client
    except ImportError:
        return _prometheus_by_hand(collector.runs)
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    return prometheus_client.generate_latest(registry).decode()


def _fmt(v) -> str:
    """A sample value or bucket bound as the exposition writes it (Go's float formatting, as prometheus_client's
    floatToGoString: exponent form once the integer part has more than 6 digits)."""
    v = float(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    s = repr(v)
    dot = s.find(".")
    if v > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _labels(lab, extra=None) -> str:
    items = sorted({**lab, **(extra or {})}.items())  # every name sorted, `le` too: the client's order
    if not items:
        return ""
    esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in items) + "}"


def _prometheus_by_hand(runs) -> str:
    lines = []
    for name, doc, key in _GAUGES:
        values = _gauge_values(runs, key)
        if values:
            lines += [f"# HELP {_PREFIX}{name} {doc}", f"# TYPE {_PREFIX}{name} gauge"]
            lines += [f"{_PREFIX}{name}{_labels(lab)} {_fmt(v)}" for lab, v in values]
    name, doc, key = _HISTOGRAM
    full = _PREFIX + name
    lines += [f"# HELP {full} {doc}", f"# TYPE {full} histogram"]
    for lab, st in runs:
        buckets, total = _histogram(st.get(key))
        lines += [f"{full}_bucket{_labels(lab, {'le': _fmt(le)})} {_fmt(n)}" for le, n in buckets]
        lines += [f"{full}_count{_labels(lab)} {_fmt(buckets[-1][1])}", f"{full}_sum{_labels(lab)} {_fmt(total)}"]
    return "\n".join(lines) + "\n"
