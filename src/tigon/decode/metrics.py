"""Prometheus metrics of `tigon.generate(..., return_stats=True)` statistics, one vocabulary for every surface.

    from tigon.decode.metrics import GenerationMetrics, serve
    metrics = GenerationMetrics(labelnames=("model",))   # on prometheus_client.REGISTRY
    server = serve(9464)                                 # http://127.0.0.1:9464/metrics
    seqs, stats = tigon.generate(model, ids, max_new_tokens=128, return_stats=True)
    metrics.observe(stats, labels={"model": "llama-8b"})

    print(prometheus_text(stats))                        # the same metrics after this one call, text format 0.0.4

`METRICS` is the one table of what is exposed (names, types, help, what each reads from the stats):
`GenerationMetrics` (running totals), `StatsCollector` (the given calls only, replaced by `update`) and
`prometheus_text` (StatsCollector rendered) all render it, so prometheus_text(stats) is exactly what a fresh
GenerationMetrics exposes after observe(stats). Everything here needs prometheus_client (`tigon[metrics]`);
the module's own code imports neither it nor transformers: it reads the stats dict only (its package, tigon.decode,
needs the `hf` extra). This module is the one door to the metrics (`tigon.decode` does not re-export them).
"""

import bisect
import itertools
import math
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .. import _log

PREFIX = "tigon_generate_"
LATENCY_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1,
                   0.25, 1.0)
# A 1.5B model's TTFT at prompt 512 is tens of ms on an H200 (docs/generation.md); a long prompt's prefill at 8B
# takes longer (unmeasured): the buckets reach 30 s.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class Metric:
    """One exposed metric: `name` after PREFIX (base units; counters end in _total), `kind` counter, gauge or
    histogram, `help`, `read(stats)` the call's value (a histogram: a list of observations; a gauge: None leaves
    the series out). Over several calls counters add up, histograms observe every value, a gauge keeps the
    last value (`combine="last"`) or the largest (`combine="max"`)."""

    name: str
    kind: str
    help: str
    read: Callable[[dict], object]
    combine: str = ""
    buckets: tuple = ()


METRICS = (
    Metric("calls_total", "counter", "tigon.generate calls observed", lambda s: 1),
    Metric("tokens_total", "counter", "New tokens generated: batch_size x new_tokens of each call",
           lambda s: s["batch_size"] * s["new_tokens"]),
    Metric("seconds_total", "counter", "Seconds in the observed calls: time to first token plus every decode step",
           lambda s: s["ttft_s"] + sum(s["step_s"])),
    Metric("cuda_graph_calls_total", "counter", "Observed calls whose decode steps replayed a CUDA graph",
           lambda s: int(bool(s.get("cuda_graph")))),
    Metric("time_to_first_token_seconds", "histogram", "Time from the generate call to the first token",
           lambda s: [s["ttft_s"]], buckets=TTFT_BUCKETS),
    Metric("decode_step_seconds", "histogram",
           "Decode step latency, every step after the first token: the time between a row's consecutive tokens",
           lambda s: s["step_s"], buckets=LATENCY_BUCKETS),
    Metric("last_tokens_per_second", "gauge",
           "Tokens per second of the last observed call: batch_size x new_tokens over its whole time",
           lambda s: s.get("tokens_per_s"), combine="last"),
    Metric("last_decode_tokens_per_second", "gauge",
           "Tokens per second over the decode steps of the last observed call",
           lambda s: s.get("decode_tokens_per_s"), combine="last"),
    Metric("peak_memory_bytes", "gauge",
           "Largest peak CUDA memory allocated during an observed call (absent until a call on CUDA reports one)",
           lambda s: s.get("peak_memory_bytes"), combine="max"),
)
_NEEDED = ("ttft_s", "step_s", "batch_size", "new_tokens")
_OPTIONAL = ("tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _client(who):
    """prometheus_client, or an ImportError naming the `metrics` extra."""
    return _log.import_optional("prometheus_client", who)


def _label_names(lab, who):
    if not isinstance(lab, dict):
        raise TypeError(f"{who}: labels must be a dict {{name: value}}, got {type(lab).__name__}")
    for name in lab:
        # the exposition format's label names; "__" is reserved, "le" is the histogram's bucket label
        if not isinstance(name, str) or not _LABEL_NAME.fullmatch(name) or name.startswith("__") or name == "le":
            raise ValueError(f"{who}: {name!r} is not a usable label name ([a-zA-Z_][a-zA-Z0-9_]*, "
                             "not __-prefixed, not le)")
    return dict(lab)


def _number(value, what, who, finite=True):
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0
            or (finite and math.isinf(value))):
        raise ValueError(f"{who}: {what} must be a {'finite ' if finite else ''}number >= 0, got {value!r}")
    return value


def _readings(stats, who):
    """{metric name: value} of one call's stats, every value checked."""
    if not isinstance(stats, dict):
        raise TypeError(f"{who}: stats must be the dict of tigon.generate(..., return_stats=True), "
                        f"got {type(stats).__name__}")
    missing = [k for k in _NEEDED if k not in stats]
    if missing:
        raise ValueError(f"{who}: stats lack {missing} (the dict of generate's return_stats=True)")
    for key in ("ttft_s", "batch_size", "new_tokens"):
        _number(stats[key], f"stats[{key!r}]", who)
    if not isinstance(stats["step_s"], (list, tuple)):
        raise TypeError(f"{who}: stats['step_s'] must be a list of seconds, got {type(stats['step_s']).__name__}")
    for s in stats["step_s"]:
        _number(s, "stats['step_s']", who)
    for key in _OPTIONAL:  # tokens_per_s is inf when the clock did not move: a valid gauge value
        if stats.get(key) is not None:
            _number(stats[key], f"stats[{key!r}]", who, finite=False)
    return {m.name: m.read(stats) for m in METRICS}


class _Series:
    """One label set's state: counter and gauge values, histograms as per-bucket counts (last one +Inf) and sum."""

    def __init__(self):
        self.values = {m.name: 0 if m.kind == "counter" else None for m in METRICS if m.kind != "histogram"}
        self.counts = {m.name: [0] * (len(m.buckets) + 1) for m in METRICS if m.kind == "histogram"}
        self.sums = dict.fromkeys(self.counts, 0.0)

    def add(self, readings):
        for m in METRICS:
            v = readings[m.name]
            if m.kind == "counter":
                self.values[m.name] += v
            elif m.kind == "histogram":
                for x in v:
                    self.counts[m.name][bisect.bisect_left(m.buckets, x)] += 1  # the first bound >= x: `le`
                self.sums[m.name] += sum(v)
            elif v is not None:
                old = self.values[m.name]
                self.values[m.name] = v if old is None or m.combine == "last" else max(old, v)


class _Collector:
    """A prometheus_client collector of METRICS over `_series` {label values: _Series}."""

    def __init__(self, labelnames):
        self.labelnames = tuple(labelnames)
        self._series = {}
        self._lock = threading.Lock()

    def collect(self):
        with self._lock:
            return self._families(list(self._series.items()))

    def describe(self):
        """The families without samples: a registry refuses a second collector of the same names."""
        return self._families([])

    def _families(self, series):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
        out = []
        for m in METRICS:
            family = kinds[m.kind](PREFIX + m.name, m.help, labels=self.labelnames)
            for key, s in series:
                if m.kind == "histogram":
                    cumulative = itertools.accumulate(s.counts[m.name])
                    bounds = (floatToGoString(le) for le in (*m.buckets, math.inf))
                    family.add_metric(key, list(zip(bounds, cumulative)), s.sums[m.name])
                elif s.values[m.name] is not None:
                    family.add_metric(key, float(s.values[m.name]))
            out.append(family)
        return out


def _runs(stats, labels, who):
    if isinstance(stats, dict):
        return [(_label_names({} if labels is None else labels, who), stats)]
    if labels is not None:
        raise ValueError(f"{who}: labels= goes with one stats dict; a list carries (labels, stats) pairs")
    if not isinstance(stats, (list, tuple)) or not all(
            isinstance(run, (list, tuple)) and len(run) == 2 and isinstance(run[1], dict) for run in stats):
        raise TypeError(f"{who}: stats must be generate's stats dict or a list of (labels, stats) pairs, "
                        f"got {type(stats).__name__}")
    runs = [(_label_names(lab or {}, who), st) for lab, st in stats]
    keys = {tuple(sorted(lab)) for lab, _ in runs}
    if len(keys) > 1:
        raise ValueError(f"{who}: every run needs the same label names, got {sorted(keys)}")
    return runs


def _fill(collector, stats, labels, who):
    """Replace `collector`'s series with those of these runs (checked first, so a refused call changes nothing)."""
    runs = _runs(stats, labels, who)
    names = tuple(sorted(runs[0][0])) if runs else ()
    series = {}
    for lab, st in runs:
        readings = _readings(st, who)
        series.setdefault(tuple(str(lab[n]) for n in names), _Series()).add(readings)
    with collector._lock:
        collector.labelnames, collector._series = names, series


class StatsCollector(_Collector):
    """A prometheus_client collector of METRICS over the given calls only: `stats` is one stats dict (with
    optional `labels` {name: value}) or a list of `(labels, stats)` pairs, one series per label values (runs
    with equal label values add up, as observed by one GenerationMetrics). `update` replaces them."""

    def __init__(self, stats, labels=None):
        _client("StatsCollector")
        super().__init__(())
        _fill(self, stats, labels, "StatsCollector")

    def update(self, stats, labels=None) -> None:
        """Expose these stats from now on (checked as in the constructor)."""
        _fill(self, stats, labels, "StatsCollector.update")


def prometheus_text(stats, labels=None) -> str:
    """The `stats` of `generate(..., return_stats=True)` in the Prometheus text exposition format (0.0.4):
    METRICS after these calls (`stats` and `labels` as StatsCollector's), by prometheus_client's
    generate_latest."""
    client = _client("prometheus_text")
    collector = _Collector(())
    _fill(collector, stats, labels, "prometheus_text")
    registry = client.CollectorRegistry()
    registry.register(collector)
    return client.generate_latest(registry).decode()


# The collector of every GenerationMetrics on a registry: instances on one registry share its series.
_SHARED = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


class GenerationMetrics:
    """Running totals of METRICS over every observed `tigon.generate(..., return_stats=True)` call, on
    `registry` (default prometheus_client.REGISTRY, what `serve` exposes). `labelnames`: the label names every
    `observe(stats, labels={name: value})` gives. Every GenerationMetrics on one registry feeds one set of
    series (a second `GenerationMetrics()` in a process adds to the first's totals; it must use the same
    labelnames); pass `registry=prometheus_client.CollectorRegistry()` for separate totals. Thread-safe."""

    def __init__(self, registry=None, labelnames=()):
        client = _client("GenerationMetrics")
        if isinstance(labelnames, str) or not isinstance(labelnames, (list, tuple)):
            raise TypeError("GenerationMetrics: labelnames must be a tuple of label names, got "
                            f"{type(labelnames).__name__}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"GenerationMetrics: labelnames repeat a name: {list(labelnames)}")
        labelnames = tuple(sorted(_label_names(dict.fromkeys(labelnames), "GenerationMetrics")))
        registry = client.REGISTRY if registry is None else registry
        if not isinstance(registry, client.CollectorRegistry):
            raise TypeError("GenerationMetrics: registry must be a prometheus_client CollectorRegistry, got "
                            f"{type(registry).__name__}")
        with _SHARED_LOCK:
            collector = _SHARED.get(registry)
            if collector is None:
                collector = _Collector(labelnames)
                try:
                    registry.register(collector)
                except ValueError as e:  # a StatsCollector or other tigon_generate_* metrics are there
                    raise ValueError(f"GenerationMetrics: the registry already holds these names ({e}); pass "
                                     "registry=prometheus_client.CollectorRegistry() for one of its own") from None
                _SHARED[registry] = collector
            elif collector.labelnames != labelnames:
                raise ValueError(f"GenerationMetrics: this registry's GenerationMetrics use labelnames "
                                 f"{list(collector.labelnames)}, not {list(labelnames)}; give the same labelnames "
                                 "to add to its totals, or registry=prometheus_client.CollectorRegistry() for "
                                 "separate ones")
        self.registry, self.labelnames, self._collector = registry, labelnames, collector

    def observe(self, stats, labels=None) -> None:
        """Add one call's stats (the dict of generate's return_stats=True) under `labels` ({name: value} of every
        labelname; None when there are none)."""
        readings = _readings(stats, "GenerationMetrics.observe")
        labels = _label_names({} if labels is None else labels, "GenerationMetrics.observe")
        if sorted(labels) != list(self.labelnames):
            raise ValueError(f"GenerationMetrics.observe: labels must name exactly {list(self.labelnames)}, got "
                             f"{sorted(labels)}")
        key = tuple(str(labels[n]) for n in self.labelnames)
        c = self._collector
        with c._lock:
            c._series.setdefault(key, _Series()).add(readings)

    def collect(self):
        """The metric families of this registry's totals (what a scrape of it shows of tigon)."""
        return self._collector.collect()


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
