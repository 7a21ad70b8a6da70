"""Compatibility name: the decode loop lives in `tigon.decode` (loop.py; this module re-exports its names)."""

from .decode import LATENCY_BUCKETS, TTFT_PHASES, DecodeSettings, generate, prometheus_text  # noqa: F401
