"""Prometheus metrics of `tigon.generate` (re-exported from `tigon.decode.metrics`): `GenerationMetrics` for
running totals, `serve` for a /metrics endpoint, `StatsCollector` and `prometheus_text` for given calls' stats,
`METRICS` the table of what they expose."""

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
