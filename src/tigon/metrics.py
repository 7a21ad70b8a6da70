"""Prometheus metrics of `tigon.generate` (docs/generation.md): `GenerationMetrics` for running totals, `serve` for
a /metrics endpoint, `StatsCollector` and `prometheus_text` for given calls' stats, `METRICS` the table of what
they expose.

The documented public name of `tigon.decode.metrics`, which defines them: these two modules are the only doors
(`tigon.decode` does not re-export the metrics), and each name here is that module's own object."""

from . import _log

# tigon.decode, which holds the metrics, imports the Hugging Face stack: without it, name the extra
with _log.requires_extra("tigon.metrics"):
    from .decode.metrics import (  # noqa: F401
        LATENCY_BUCKETS,
        METRICS,
        PREFIX,
        TTFT_BUCKETS,
        GenerationMetrics,
        Metric,
        MetricsServer,
        StatsCollector,
        prometheus_text,
        serve,
    )
