"""Prometheus metrics of generate's stats (tigon.decode.metrics): one table (METRICS) behind prometheus_text,
StatsCollector and GenerationMetrics; several GenerationMetrics in one process; the extras named when
prometheus_client or transformers is missing."""

import importlib.util
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.hf._tiny import tiny_model
from tigon.decode import loop, metrics

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

A = dict(ttft_s=0.01, step_s=[0.001, 0.002, 0.0011], p50_step_s=0.0011, p99_step_s=0.002, tokens_per_s=500.0,
         decode_tokens_per_s=700.0, peak_memory_bytes=3 * 2**30, new_tokens=4, batch_size=1, cuda_graph=True)
B = dict(A, ttft_s=0.02, step_s=[0.05] * 3, peak_memory_bytes=None, cuda_graph=False, batch_size=8,
         tokens_per_s=90.0)
P = metrics.PREFIX


def _families(text):
    """{(family name, type, help)} of an exposition."""
    return {(f.name, f.type, f.documentation) for f in text_string_to_metric_families(text)}


def _samples(text):
    """{(sample name, sorted labels): value} of an exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _latest(registry):
    return prometheus_client.generate_latest(registry).decode()


def _le(bound):
    return prometheus_client.utils.floatToGoString(bound)


def _check(got, runs, labels=()):
    """Every sample of one label set against the stats of the calls observed under it."""
    lab = tuple(sorted(labels))
    assert got[(P + "calls_total", lab)] == len(runs)
    assert got[(P + "tokens_total", lab)] == sum(s["batch_size"] * s["new_tokens"] for s in runs)
    assert got[(P + "seconds_total", lab)] == pytest.approx(sum(s["ttft_s"] + sum(s["step_s"]) for s in runs))
    assert got[(P + "cuda_graph_calls_total", lab)] == sum(bool(s["cuda_graph"]) for s in runs)
    for name, key, bounds in (("time_to_first_token_seconds", "ttft_s", metrics.TTFT_BUCKETS),
                              ("decode_step_seconds", "step_s", metrics.LATENCY_BUCKETS)):
        values = [v for s in runs for v in (s[key] if key == "step_s" else [s[key]])]
        assert got[(P + name + "_count", lab)] == len(values)
        assert got[(P + name + "_sum", lab)] == pytest.approx(sum(values))
        for le in (*bounds, math.inf):
            assert got[(P + name + "_bucket", tuple(sorted(lab + (("le", _le(le)),))))] == sum(v <= le for v in values)
    assert got[(P + "last_tokens_per_second", lab)] == runs[-1]["tokens_per_s"]
    assert got[(P + "last_decode_tokens_per_second", lab)] == pytest.approx(runs[-1]["decode_tokens_per_s"])
    peaks = [s["peak_memory_bytes"] for s in runs if s["peak_memory_bytes"] is not None]
    if peaks:
        assert got[(P + "peak_memory_bytes", lab)] == max(peaks)
    else:  # on a CPU: left out, not a fake 0
        assert (P + "peak_memory_bytes", lab) not in got


def test_one_table_names_every_surface_the_same():
    expected = {(P + m.name.removesuffix("_total") if m.kind == "counter" else P + m.name, m.kind, m.help)
                for m in metrics.METRICS}
    for m in metrics.METRICS:  # Prometheus conventions: base units, _total on counters only
        assert m.name.endswith(("_total",) if m.kind == "counter" else ("_seconds", "_bytes", "_per_second")), m
    text = metrics.prometheus_text(A, labels={"model": "m"})
    registry = prometheus_client.CollectorRegistry()
    gm = metrics.GenerationMetrics(registry=registry, labelnames=("model",))
    collector_registry = prometheus_client.CollectorRegistry()
    collector = metrics.StatsCollector(B)
    collector_registry.register(collector)
    assert _families(text) == _families(_latest(collector_registry)) == expected
    assert _families(_latest(registry)) == expected  # before any call: the families, no samples
    gm.observe(A, labels={"model": "m"})
    assert _latest(registry) == text  # prometheus_text(stats) is what GenerationMetrics shows after that call
    collector.update(A, labels={"model": "m"})
    assert _latest(collector_registry) == text
    with pytest.raises(ValueError, match=r"GenerationMetrics: the registry already holds these names .*"
                                         r"registry=prometheus_client.CollectorRegistry\(\)"):
        metrics.GenerationMetrics(registry=collector_registry)  # the same names: one registry holds one of them


def test_prometheus_text_of_several_runs_and_bad_input():
    text = metrics.prometheus_text([({"variant": "tigon", "batch": "1"}, A), ({"variant": 'x"y\n', "batch": "8"}, B),
                                    ({"variant": "tigon", "batch": "1"}, B)])
    got = _samples(text)
    _check(got, [A, B], (("variant", "tigon"), ("batch", "1")))  # equal label values add up, in order
    _check(got, [B], (("variant", 'x"y\n'), ("batch", "8")))
    assert _samples(metrics.prometheus_text([])) == {}
    with pytest.raises(ValueError, match="prometheus_text: every run needs the same label names"):
        metrics.prometheus_text([({"a": "1"}, A), ({"b": "1"}, B)])
    with pytest.raises(ValueError, match="prometheus_text: labels= goes with one stats dict"):
        metrics.prometheus_text([({"a": "1"}, A)], labels={"a": "2"})
    for bad in ("bad-name", "le", "__x", "1st"):
        with pytest.raises(ValueError, match=f"prometheus_text: '{bad}' is not a usable label name"):
            metrics.prometheus_text(A, labels={bad: "1"})
    for bad in (None, "stats", [A], [({"a": "1"}, A, 3)]):
        with pytest.raises(TypeError, match="prometheus_text: stats must be generate's stats dict or a list"):
            metrics.prometheus_text(bad)
    with pytest.raises(TypeError, match="prometheus_text: labels must be a dict"):
        metrics.prometheus_text([(["a"], A)])
    with pytest.raises(ValueError, match=r"prometheus_text: stats lack \['step_s'\]"):
        metrics.prometheus_text({k: v for k, v in A.items() if k != "step_s"})
    with pytest.raises(ValueError, match=r"prometheus_text: stats\['tokens_per_s'\] must be a number >= 0"):
        metrics.prometheus_text(dict(A, tokens_per_s=float("nan")))
    assert _samples(metrics.prometheus_text(dict(A, tokens_per_s=math.inf)))[
        (P + "last_tokens_per_second", ())] == math.inf  # generate's value when its clock did not move


def test_collector_follows_updates():
    registry = prometheus_client.CollectorRegistry()
    collector = metrics.StatsCollector(A, labels={"model": "m"})
    registry.register(collector)
    _check(_samples(_latest(registry)), [A], (("model", "m"),))
    collector.update(B, labels={"model": "m"})
    _check(_samples(_latest(registry)), [B], (("model", "m"),))  # B alone: update replaces
    with pytest.raises(ValueError, match="StatsCollector.update: 'le' is not a usable label name"):
        collector.update(A, labels={"le": "1"})
    _check(_samples(_latest(registry)), [B], (("model", "m"),))  # a refused update changes nothing


def test_two_generation_metrics_in_one_process(monkeypatch):
    default = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", default)  # the process registry, fresh for this test
    first = metrics.GenerationMetrics(labelnames=("model",))
    second = metrics.GenerationMetrics(labelnames=["model"])  # on the same registry: adds to the same totals
    first.observe(A, labels={"model": "m"})
    second.observe(B, labels={"model": "m"})
    assert first.registry is second.registry is default
    _check(_samples(_latest(default)), [A, B], (("model", "m"),))
    with pytest.raises(ValueError, match=r"GenerationMetrics: this registry's GenerationMetrics use labelnames "
                                         r"\['model'\], not \[\].*registry=prometheus_client.CollectorRegistry\(\)"):
        metrics.GenerationMetrics()
    own = metrics.GenerationMetrics(registry=prometheus_client.CollectorRegistry())  # separate totals
    own.observe(B)
    _check(_samples(_latest(own.registry)), [B])
    _check(_samples(_latest(default)), [A, B], (("model", "m"),))


def test_without_prometheus_client_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    extra = "needs the 'prometheus_client' package, which is not installed: " + re.escape(
        'pip install "tigon[metrics]"')
    for who, call in (("prometheus_text", lambda: metrics.prometheus_text(A)),
                      ("StatsCollector", lambda: metrics.StatsCollector(A)),
                      ("GenerationMetrics", metrics.GenerationMetrics), ("serve", lambda: metrics.serve(0))):
        with pytest.raises(ImportError, match=f"{who} {extra}"):
            call()
    # the module itself imports without it
    spec = importlib.util.spec_from_file_location("tigon.decode._metrics_without_client", metrics.__file__)
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fresh)
    spec.loader.exec_module(fresh)
    assert [m.name for m in fresh.METRICS] == [m.name for m in metrics.METRICS]


def test_its_file_runs_without_transformers():
    """The metrics module reads the stats dict only: a process without transformers runs its file (its package,
    tigon.decode, is what needs transformers)."""
    code = textwrap.dedent("""
        import sys
        class Absent:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "transformers":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Absent())
        import importlib.util
        spec = importlib.util.spec_from_file_location("tigon.decode._metrics_without_transformers", sys.argv[1])
        metrics = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(metrics)
        print("imported", metrics.METRICS[0].name, "transformers" in sys.modules)
    """)
    src = str(Path(__file__).resolve().parents[2] / "src")  # this checkout's tigon, installed or not
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, "-c", code, metrics.__file__], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0 and "imported calls_total False" in run.stdout, run.stderr


def _scrape(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def test_served_endpoint_shows_a_real_generate_call():
    # The documented server: GenerationMetrics on a registry, serve() on the loopback, a tiny generate's stats.
    import socket
    import urllib.error

    registry = prometheus_client.CollectorRegistry(auto_describe=True)
    gm = metrics.GenerationMetrics(registry=registry, labelnames=("model",))
    model = tiny_model("llama", num_hidden_layers=1, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 131, (2, 4), generator=torch.Generator().manual_seed(2))
    _, real = loop.generate(model, ids, max_new_tokens=4, return_stats=True, attention="hf")
    assert len(real["step_s"]) == 3 and real["peak_memory_bytes"] is None  # on a CPU
    _check(_samples(metrics.prometheus_text(real)), [real])
    server = metrics.serve(0, registry=registry)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        gm.observe(real, labels={"model": "tiny"})
        gm.observe(A, labels={"model": "tiny"})
        gm.observe(B, labels={"model": "other"})
        got = _samples(_scrape(server.url))
    finally:
        server.close()
    _check(got, [real, A], (("model", "tiny"),))
    _check(got, [B], (("model", "other"),))
    assert got[(P + "tokens_total", (("model", "tiny"),))] == 2 * 4 + 4
    with pytest.raises(urllib.error.URLError):
        _scrape(server.url)
    server.close()  # idempotent
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))


def test_generation_metrics_and_serve_refuse_bad_arguments():
    registry = prometheus_client.CollectorRegistry()
    gm = metrics.GenerationMetrics(registry=registry, labelnames=["model"])
    with pytest.raises(ValueError, match=r"observe: labels must name exactly \['model'\], got \[\]"):
        gm.observe(A)
    with pytest.raises(TypeError, match="observe: stats must be the dict of tigon.generate"):
        gm.observe([A], labels={"model": "m"})
    with pytest.raises(ValueError, match=r"observe: stats lack \['step_s'\]"):
        gm.observe({k: v for k, v in A.items() if k != "step_s"}, labels={"model": "m"})
    with pytest.raises(ValueError, match=r"observe: stats\['step_s'\] must be a finite number >= 0"):
        gm.observe(dict(A, step_s=[0.1, -1.0]), labels={"model": "m"})
    with pytest.raises(TypeError, match=r"observe: stats\['step_s'\] must be a list of seconds"):
        gm.observe(dict(A, step_s=0.1), labels={"model": "m"})
    with pytest.raises(ValueError, match=r"observe: stats\['ttft_s'\] must be a finite number"):
        gm.observe(dict(A, ttft_s=float("nan")), labels={"model": "m"})
    with pytest.raises(TypeError, match="observe: labels must be a dict"):
        gm.observe(A, labels=["m"])
    assert all(not family.samples for family in gm.collect())  # the refused calls counted nothing
    fresh = prometheus_client.CollectorRegistry
    with pytest.raises(TypeError, match="GenerationMetrics: labelnames must be a tuple"):
        metrics.GenerationMetrics(registry=fresh(), labelnames="model")
    with pytest.raises(ValueError, match="GenerationMetrics: 'le' is not a usable label name"):
        metrics.GenerationMetrics(registry=fresh(), labelnames=("le",))
    with pytest.raises(ValueError, match="labelnames repeat a name"):
        metrics.GenerationMetrics(registry=fresh(), labelnames=("a", "a"))
    with pytest.raises(TypeError, match="GenerationMetrics: registry must be a prometheus_client"):
        metrics.GenerationMetrics(registry="default")
    for port, err in ((True, TypeError), ("9000", TypeError), (-1, ValueError), (70000, ValueError)):
        what = "port must be an int" if err is TypeError else r"port must be in 0\.\.65535"
        with pytest.raises(err, match=f"serve: {what}"):
            metrics.serve(port, registry=registry)
    with pytest.raises(TypeError, match="serve: addr must be a host address string"):
        metrics.serve(0, addr="", registry=registry)
    with pytest.raises(TypeError, match="serve: registry must be a prometheus_client"):
        metrics.serve(0, registry=object())
    with metrics.serve(0, registry=registry) as busy:  # a port in use: the address in the message
        with pytest.raises(OSError, match=f"serve: cannot listen on 127.0.0.1:{busy.port}"):
            metrics.serve(busy.port, registry=registry)


def test_metrics_have_one_door():
    """tigon.decode.metrics defines the metrics; tigon.decode neither defines nor re-exports them, and tigon has no
    metrics module of its own."""
    import tigon
    from tigon import decode

    assert decode.metrics is metrics and importlib.util.find_spec("tigon.metrics") is None
    assert "metrics" not in tigon.__all__ and "metrics" not in decode.__all__ and not hasattr(tigon, "metrics")
    for name in ("GenerationMetrics", "StatsCollector", "prometheus_text", "serve", "MetricsServer", "METRICS",
                 "Metric", "PREFIX", "LATENCY_BUCKETS", "TTFT_BUCKETS"):
        assert getattr(metrics, name).__module__ == "tigon.decode.metrics" if callable(getattr(metrics, name)) else True
        assert not hasattr(decode, name) and name not in decode.__all__, name
