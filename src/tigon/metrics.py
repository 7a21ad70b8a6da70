"""Compatibility name: the Prometheus exposition lives in `tigon.decode.metrics` (this module re-exports it)."""

from .decode.metrics import LATENCY_BUCKETS, StatsCollector, prometheus_text  # noqa: F401
