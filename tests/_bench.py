"""The benchmarks' scripts as modules for the tests: benchmarks/ goes on sys.path, as when a script runs there."""

import importlib
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def bench_module(name: str):
    """Import benchmarks/<name>.py (and let it import its siblings, as it does when run)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module(name)
