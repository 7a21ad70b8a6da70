"""Prometheus metrics of `tigon.generate` (re-exported from `tigon.decode.metrics`): `StatsCollector` and
`prometheus_text` for one call's stats, `GenerationMetrics` for running totals, `serve` for a /metrics endpoint."""

from .decode.metrics import (  # noqa: F401
    LATENCY_BUCKETS,
    TTFT_BUCKETS,
    GenerationMetrics,
    MetricsServer,
    StatsCollector,
    prometheus_text,
    serve,
)
