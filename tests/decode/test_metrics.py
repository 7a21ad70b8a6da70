"""The Prometheus exposition of generate's stats (tigon.decode.metrics): prometheus_client's collector and the
hand-written fallback give the same bytes, and both parse back to the stats."""

import re
import sys

import pytest
import torch

from tests.hf._tiny import tiny_model
from tigon.decode import loop, metrics


def _stats():
    model = tiny_model("llama", attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 131, (2, 5), generator=torch.Generator().manual_seed(1))
    _, stats = loop.generate(model, ids, max_new_tokens=6, return_stats=True, attention="hf")
    return stats


A = dict(ttft_s=0.01, step_s=[0.001, 0.002, 0.0011], p50_step_s=0.0011, p99_step_s=0.002, tokens_per_s=500.0,
         decode_tokens_per_s=700.0, peak_memory_bytes=3 * 2**30, new_tokens=4, batch_size=1, cuda_graph=True)
B = dict(A, ttft_s=0.02, step_s=[0.05] * 3, peak_memory_bytes=None, cuda_graph=False, batch_size=8)


def _samples(text):
    """{(sample name, sorted labels): value} from an exposition, with prometheus_client's parser when installed,
    else a line reader of the same format."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            head, value = line.rsplit(" ", 1)
            name, _, rest = head.partition("{")
            unescape = lambda v: re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)
            labels = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest)
            out[(name, tuple(sorted((k, unescape(v)) for k, v in labels)))] = float(value)
        return out
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _check_exposition(text, stats, labels=()):
    got = _samples(text)
    p = "tigon_generate_"
    lab = tuple(sorted(labels))
    assert got[(p + "time_to_first_token_seconds", lab)] == pytest.approx(stats["ttft_s"])
    assert got[(p + "step_latency_p50_seconds", lab)] == pytest.approx(stats["p50_step_s"])
    assert got[(p + "step_latency_p99_seconds", lab)] == pytest.approx(stats["p99_step_s"])
    assert got[(p + "tokens_per_second", lab)] == pytest.approx(stats["tokens_per_s"])
    assert got[(p + "new_tokens", lab)] == stats["new_tokens"]
    assert got[(p + "batch_size", lab)] == stats["batch_size"]
    assert got[(p + "cuda_graph", lab)] == float(stats["cuda_graph"])
    if stats["peak_memory_bytes"] is None:  # on a CPU: left out, not a fake 0
        assert (p + "peak_memory_bytes", lab) not in got
    else:
        assert got[(p + "peak_memory_bytes", lab)] == stats["peak_memory_bytes"]
    steps = stats["step_s"]
    assert got[(p + "step_latency_seconds_count", lab)] == len(steps)
    assert got[(p + "step_latency_seconds_sum", lab)] == pytest.approx(sum(steps))
    for le in (*metrics.LATENCY_BUCKETS, float("inf")):
        key = (p + "step_latency_seconds_bucket", tuple(sorted(labels + (("le", metrics._fmt(le)),))))
        assert got[key] == sum(s <= le for s in steps)


@pytest.mark.parametrize("client", [True, False])
def test_prometheus_exposition_parses_and_matches_stats(monkeypatch, client):
    stats = _stats()
    if client:
        pytest.importorskip("prometheus_client")
    else:  # the fallback writes the same metrics by hand (parsed below by the real parser when installed)
        monkeypatch.setitem(sys.modules, "prometheus_client", None)
    text = metrics.prometheus_text(stats)
    monkeypatch.undo()
    assert "# TYPE tigon_generate_step_latency_seconds histogram" in text
    _check_exposition(text, stats)


def test_prometheus_several_runs_with_labels_and_bad_labels():
    a, b = A, B
    text = metrics.prometheus_text([({"variant": "tigon", "batch": "1"}, a), ({"variant": 'x"y', "batch": "8"}, b)])
    _check_exposition(text, a, (("variant", "tigon"), ("batch", "1")))
    _check_exposition(text, b, (("variant", 'x"y'), ("batch", "8")))
    got = _samples(text)
    assert got[("tigon_generate_batch_size", (("batch", "8"), ("variant", 'x"y')))] == 8
    one = metrics.prometheus_text(a, labels={"run": "r1"})
    assert 'tigon_generate_cuda_graph{run="r1"} 1.0' in one
    with pytest.raises(ValueError, match="same label names"):
        metrics.prometheus_text([({"a": "1"}, a), ({"b": "1"}, b)])
    with pytest.raises(ValueError, match="labels= goes with one stats dict"):
        metrics.prometheus_text([({"a": "1"}, a)], labels={"a": "2"})
    for bad in ("bad-name", "le", "__x", "1st"):
        with pytest.raises(ValueError, match=f"prometheus_text: '{bad}' is not a usable label name"):
            metrics.prometheus_text(a, labels={bad: "1"})
    for bad in (None, "stats", [a], [({"a": "1"}, a, 3)]):
        with pytest.raises(TypeError, match="prometheus_text: stats must be generate's stats dict or a list"):
            metrics.prometheus_text(bad)
    with pytest.raises(TypeError, match="prometheus_text: labels must be a dict"):
        metrics.prometheus_text([(["a"], a)])


@pytest.mark.parametrize("runs", [
    (A, None), (A, {"run": "r1"}), (B, {"model": 'x"y\\z\nw'}),
    ([({"variant": "tigon", "batch": "1"}, A), ({"variant": "hf", "batch": "8"}, B)], None), ([], None),
], ids=["one", "labelled", "escaped", "two-runs", "none"])
def test_client_and_fallback_write_the_same_bytes(monkeypatch, runs):
    pytest.importorskip("prometheus_client")
    stats, labels = runs
    client = metrics.prometheus_text(stats, labels)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    by_hand = metrics.prometheus_text(stats, labels)
    monkeypatch.undo()
    assert by_hand == client
    assert ("tigon_generate_peak_memory_bytes" in client) == any(
        s is A for s in ([stats] if isinstance(stats, dict) else [st for _, st in stats]))


def test_collector_registers_and_follows_updates():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    collector = metrics.StatsCollector(A, labels={"model": "m"})
    registry.register(collector)
    first = _samples(prometheus_client.generate_latest(registry).decode())
    assert first[("tigon_generate_batch_size", (("model", "m"),))] == 1
    assert first[("tigon_generate_step_latency_seconds_count", (("model", "m"),))] == 3
    collector.update(B, labels={"model": "m"})
    second = _samples(prometheus_client.generate_latest(registry).decode())
    assert second[("tigon_generate_batch_size", (("model", "m"),))] == 8
    assert ("tigon_generate_peak_memory_bytes", (("model", "m"),)) not in second
    with pytest.raises(ValueError, match="prometheus_text: 'le' is not a usable label name"):
        collector.update(A, labels={"le": "1"})


def test_value_format_is_the_clients():
    # Go's float format, as prometheus_client writes samples: exponent form past 6 integer digits.
    assert [metrics._fmt(v) for v in (3 * 2**30, 123456.0, 1234567.0, 0.00025, 1, float("inf"), True)] == [
        "3.221225472e+09", "123456.0", "1.234567e+06", "0.00025", "1.0", "+Inf", "1.0"]


def _scrape(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def test_served_endpoint_accumulates_observed_stats():
    # The documented server: GenerationMetrics on a registry, serve() on the loopback, a real generate's stats.
    prometheus_client = pytest.importorskip("prometheus_client")
    import socket
    import urllib.error

    registry = prometheus_client.CollectorRegistry(auto_describe=True)  # checks names against every collector
    gm = metrics.GenerationMetrics(registry=registry, labelnames=("model",))
    registry.register(metrics.StatsCollector(A))  # the last-call collector's names do not clash with these
    model = tiny_model("llama", num_hidden_layers=1, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 131, (2, 4), generator=torch.Generator().manual_seed(2))
    _, real = loop.generate(model, ids, max_new_tokens=4, return_stats=True, attention="hf")
    assert len(real["step_s"]) == 3 and real["peak_memory_bytes"] is None  # on a CPU
    server = metrics.serve(0, registry=registry)
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        gm.observe(real, labels={"model": "tiny"})
        gm.observe(A, labels={"model": "tiny"})
        gm.observe(B, labels={"model": "other"})
        got = _samples(_scrape(server.url))
    finally:
        server.close()
    p, tiny, other = "tigon_generate_", (("model", "tiny"),), (("model", "other"),)
    runs = (real, A)
    steps = real["step_s"] + A["step_s"]
    assert got[(p + "calls_total", tiny)] == 2 and got[(p + "calls_total", other)] == 1
    assert got[(p + "tokens_total", tiny)] == sum(s["batch_size"] * s["new_tokens"] for s in runs) == 2 * 4 + 4
    assert got[(p + "seconds_total", tiny)] == pytest.approx(sum(s["ttft_s"] + sum(s["step_s"]) for s in runs))
    assert got[(p + "ttft_seconds_count", tiny)] == 2
    assert got[(p + "ttft_seconds_sum", tiny)] == pytest.approx(real["ttft_s"] + A["ttft_s"])
    assert got[(p + "token_latency_seconds_count", tiny)] == len(steps) == 6
    assert got[(p + "token_latency_seconds_sum", tiny)] == pytest.approx(sum(steps))
    assert got[(p + "token_latency_seconds_count", other)] == len(B["step_s"])
    for le in (*metrics.LATENCY_BUCKETS, float("inf")):
        assert got[(p + "token_latency_seconds_bucket", (("le", metrics._fmt(le)),) + tiny)] == sum(
            s <= le for s in steps)
    for le in (*metrics.TTFT_BUCKETS, float("inf")):
        assert got[(p + "ttft_seconds_bucket", (("le", metrics._fmt(le)),) + tiny)] == sum(
            s["ttft_s"] <= le for s in runs)
    assert got[(p + "last_tokens_per_second", tiny)] == A["tokens_per_s"]  # the last call's
    assert got[(p + "max_peak_memory_bytes", tiny)] == A["peak_memory_bytes"]  # the CPU run reported none
    assert (p + "max_peak_memory_bytes", other) not in got  # B has none: absent, not 0
    assert got[(p + "batch_size", ())] == A["batch_size"]  # the StatsCollector beside it
    with pytest.raises(urllib.error.URLError):
        _scrape(server.url)
    server.close()  # idempotent
    with socket.socket() as s:  # the port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", server.port))


def test_generation_metrics_and_serve_refuse_bad_arguments():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    gm = metrics.GenerationMetrics(registry=registry, labelnames=["model"])
    with pytest.raises(ValueError, match="Duplicated timeseries"):  # describe() names the families
        metrics.GenerationMetrics(registry=registry)
    with pytest.raises(ValueError, match=r"observe: labels must name exactly \['model'\], got \[\]"):
        gm.observe(A)
    with pytest.raises(TypeError, match="observe: stats must be the dict of tigon.generate"):
        gm.observe([A], labels={"model": "m"})
    with pytest.raises(ValueError, match=r"observe: stats lack \['step_s'\]"):
        gm.observe({k: v for k, v in A.items() if k != "step_s"}, labels={"model": "m"})
    with pytest.raises(ValueError, match=r"observe: stats\['step_s'\] must be a finite number >= 0"):
        gm.observe(dict(A, step_s=[0.1, -1.0]), labels={"model": "m"})
    with pytest.raises(ValueError, match=r"observe: stats\['ttft_s'\] must be a finite number"):
        gm.observe(dict(A, ttft_s=float("nan")), labels={"model": "m"})
    with pytest.raises(TypeError, match="observe: labels must be a dict"):
        gm.observe(A, labels=["m"])
    assert gm.collect()[0].samples == []  # nothing was counted by the refused calls
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


def test_without_the_client_the_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"GenerationMetrics needs prometheus_client: pip install 'tigon\[metrics\]'"):
        metrics.GenerationMetrics()
    with pytest.raises(ImportError, match=r"serve needs prometheus_client: pip install 'tigon\[metrics\]'"):
        metrics.serve(0)


def test_metrics_names_are_reexported():
    from tigon import metrics as public

    assert public.GenerationMetrics is metrics.GenerationMetrics and public.serve is metrics.serve
    assert public.TTFT_BUCKETS == metrics.TTFT_BUCKETS and public.MetricsServer is metrics.MetricsServer
