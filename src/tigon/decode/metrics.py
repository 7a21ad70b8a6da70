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

A process that generates over and over keeps running totals instead, and serves them:

    from tigon.metrics import GenerationMetrics, serve
    metrics = GenerationMetrics(labelnames=("model",))              # registers on prometheus_client.REGISTRY
    server = serve(9464)                                            # http://127.0.0.1:9464/metrics
    seqs, stats = tigon.generate(model, ids, max_new_tokens=128, return_stats=True)
    metrics.observe(stats, labels={"model": "llama-8b"})
    server.close()

`StatsCollector` shows the last call's stats (gauges, and a histogram of that call's steps); `GenerationMetrics`
accumulates every observed call (counters and histograms, which Prometheus' rate() and histogram_quantile()
read). Their metric names differ, so one registry can hold both. Both need prometheus_client (`tigon[metrics]`).
"""

import bisect
import itertools
import math
import re
import threading

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


def _label_names(lab, who="prometheus_text"):
    if not isinstance(lab, dict):
        raise TypeError(f"{who}: labels must be a dict {{name: value}}, got {type(lab).__name__}")
    for name in lab:
        # the exposition format's label names; "__" is reserved, "le" is the histogram's bucket label
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__") or name == "le":
            raise ValueError(f"{who}: {name!r} is not a usable label name ([a-zA-Z_][a-zA-Z0-9_]*, "
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


# A 1.5B model's TTFT at prompt 512 is tens of ms on an H200 (docs/generation.md); a long prompt's prefill at 8B
# takes longer (unmeasured): the buckets reach 30 s.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_METRICS_NEED = ("ttft_s", "step_s", "batch_size", "new_tokens")


def _client(who):
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(f"{who} needs prometheus_client: pip install 'tigon[metrics]'") from None
    return prometheus_client


class _Totals:
    """One label set's running totals: per-bucket (not cumulative) counts, the last bucket +Inf."""

    def __init__(self):
        self.calls, self.tokens, self.seconds = 0, 0, 0.0
        self.ttft, self.ttft_sum = [0] * (len(TTFT_BUCKETS) + 1), 0.0
        self.steps, self.steps_sum = [0] * (len(LATENCY_BUCKETS) + 1), 0.0
        self.tokens_per_s, self.max_peak = None, None


def _number(stats, key):
    v = stats[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"GenerationMetrics.observe: stats[{key!r}] must be a finite number >= 0, got {v!r}")
    return v


class GenerationMetrics:
    """Running totals of `tigon.generate(..., return_stats=True)` calls, a prometheus_client collector registered
    on `registry` (default prometheus_client.REGISTRY, which `serve` and start_http_server expose). `labelnames`:
    the label names every `observe(stats, labels={name: value})` gives (one set of series per label values).

    Metrics (prefix `tigon_generate_`): counters calls_total, tokens_total (batch x new tokens), seconds_total
    (TTFT + decode steps); histograms ttft_seconds (TTFT_BUCKETS) and token_latency_seconds (LATENCY_BUCKETS: every
    decode step, the time between a row's consecutive tokens); gauges last_tokens_per_second (the last call's
    stats["tokens_per_s"]) and max_peak_memory_bytes (the largest stats["peak_memory_bytes"]; absent until a call
    on CUDA reports one). Thread-safe: observe and a scrape may run at once."""

    def __init__(self, registry=None, labelnames=()):
        client = _client("GenerationMetrics")
        if isinstance(labelnames, str) or not isinstance(labelnames, (list, tuple)):
            raise TypeError("GenerationMetrics: labelnames must be a tuple of label names, got "
                            f"{type(labelnames).__name__}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"GenerationMetrics: labelnames repeat a name: {list(labelnames)}")
        self.labelnames = tuple(sorted(_label_names(dict.fromkeys(labelnames), "GenerationMetrics")))
        registry = client.REGISTRY if registry is None else registry
        if not callable(getattr(registry, "register", None)):
            raise TypeError("GenerationMetrics: registry must be a prometheus_client CollectorRegistry, got "
                            f"{type(registry).__name__}")
        self._lock = threading.Lock()
        self._series = {}
        registry.register(self)
        self.registry = registry

    def observe(self, stats, labels=None) -> None:
        """Add one call's stats (the dict of generate's return_stats=True) under `labels` ({name: value} of every
        labelname; None when there are none)."""
        if not isinstance(stats, dict):
            raise TypeError("GenerationMetrics.observe: stats must be the dict of tigon.generate(..., "
                            f"return_stats=True), got {type(stats).__name__}")
        missing = [k for k in _METRICS_NEED if k not in stats]
        if missing:
            raise ValueError(f"GenerationMetrics.observe: stats lack {missing} (generate's return_stats=True dict)")
        labels = _label_names({} if labels is None else labels, "GenerationMetrics.observe")
        if sorted(labels) != list(self.labelnames):
            raise ValueError(f"GenerationMetrics.observe: labels must name exactly {list(self.labelnames)}, got "
                             f"{sorted(labels)}")
        ttft = _number(stats, "ttft_s")
        steps = stats["step_s"]
        if not isinstance(steps, (list, tuple)):
            raise TypeError(f"GenerationMetrics.observe: stats['step_s'] must be a list of seconds, got "
                            f"{type(steps).__name__}")
        steps = [_number({"step_s": s}, "step_s") for s in steps]
        tokens = _number(stats, "batch_size") * _number(stats, "new_tokens")
        rate, peak = stats.get("tokens_per_s"), stats.get("peak_memory_bytes")
        key = tuple(str(labels[n]) for n in self.labelnames)
        with self._lock:
            t = self._series.setdefault(key, _Totals())
            t.calls += 1
            t.tokens += tokens
            t.seconds += ttft + sum(steps)
            t.ttft[bisect.bisect_left(TTFT_BUCKETS, ttft)] += 1  # the first bound >= the value: `le` buckets
            t.ttft_sum += ttft
            for s in steps:
                t.steps[bisect.bisect_left(LATENCY_BUCKETS, s)] += 1
            t.steps_sum += sum(steps)
            if rate is not None:
                t.tokens_per_s = rate
            if peak is not None:
                t.max_peak = peak if t.max_peak is None else max(t.max_peak, peak)

    def collect(self):
        with self._lock:
            return self._families(list(self._series.items()))

    def describe(self):
        """The families without samples: lets a registry refuse a second collector of the same names."""
        return self._families([])

    def _families(self, series):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        names = list(self.labelnames)
        counters = (("calls", "tigon.generate calls observed", "calls"),
                    ("tokens", "New tokens generated (batch x new tokens per call)", "tokens"),
                    ("seconds", "Seconds in the observed calls (TTFT + decode steps)", "seconds"))
        out = []
        for name, doc, attr in counters:
            family = CounterMetricFamily(_PREFIX + name, doc, labels=names)
            for key, t in series:
                family.add_metric(key, getattr(t, attr))
            out.append(family)
        hists = (("ttft_seconds", "Time to first token of each call", TTFT_BUCKETS, "ttft"),
                 ("token_latency_seconds", "Decode step latency: the time between a row's consecutive tokens",
                  LATENCY_BUCKETS, "steps"))
        for name, doc, bounds, attr in hists:
            family = HistogramMetricFamily(_PREFIX + name, doc, labels=names)
            for key, t in series:
                cumulative = itertools.accumulate(getattr(t, attr))
                family.add_metric(key, [(_fmt(le), n) for le, n in zip((*bounds, math.inf), cumulative)],
                                  getattr(t, attr + "_sum"))
            out.append(family)
        gauges = (("last_tokens_per_second", "Tokens per second of the last call (stats tokens_per_s)",
                   "tokens_per_s"),
                  ("max_peak_memory_bytes", "Largest peak CUDA memory of the observed calls", "max_peak"))
        for name, doc, attr in gauges:
            family = GaugeMetricFamily(_PREFIX + name, doc, labels=names)
            for key, t in series:
                if getattr(t, attr) is not None:
                    family.add_metric(key, float(getattr(t, attr)))
            out.append(family)
        return out


class MetricsServer:
    """A running /metrics endpoint (from `serve`): `url`, `port`, `close()`; a context manager."""

    def __init__(self, httpd, thread, addr):
        self._httpd, self._thread = httpd, thread
        self.addr, self.port = addr, httpd.server_port
        host = f"[{addr}]" if ":" in addr else addr
        self.url = f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()
        self._httpd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(port, addr="127.0.0.1", registry=None) -> MetricsServer:
    """Serve `registry` (default prometheus_client.REGISTRY) in the Prometheus text format over HTTP from a
    daemon thread of this process (prometheus_client.start_http_server), on `addr` (default the loopback
    address; "0.0.0.0" for every interface) and `port` (0 picks a free one: see the handle's `.port`/`.url`)."""
    client = _client("serve")
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"serve: port must be an int (0 picks a free port), got {type(port).__name__}")
    if not 0 <= port <= 65535:
        raise ValueError(f"serve: port must be in 0..65535 (0 picks a free port), got {port}")
    if not isinstance(addr, str) or not addr:
        raise TypeError(f"serve: addr must be a host address string such as '127.0.0.1', got {addr!r}")
    registry = client.REGISTRY if registry is None else registry
    if not callable(getattr(registry, "collect", None)):
        raise TypeError(f"serve: registry must be a prometheus_client CollectorRegistry, got {type(registry).__name__}")
    try:
        httpd, thread = client.start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise OSError(e.errno, f"serve: cannot listen on {addr}:{port}: {e.strerror or e}") from e
    return MetricsServer(httpd, thread, addr)
