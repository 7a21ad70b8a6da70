"""decode/capture.py on the CPU: the capture's begin/end around the block (also when it raises) and the pool passed
through; no device synchronize and no cache release. The GPU test in test_generate.py captures for real."""

import pytest
import torch

from tigon.decode.capture import capture


class _Graph:
    def __init__(self):
        self.calls = []

    def capture_begin(self, **kw):
        self.calls.append(("begin", kw))

    def capture_end(self):
        self.calls.append(("end", {}))


def _no_sync_or_release(monkeypatch):
    calls = []
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name, **k: calls.append(_n))
    return calls


def test_capture_brackets_the_block_and_passes_the_pool(monkeypatch):
    synced = _no_sync_or_release(monkeypatch)
    graph, pool = _Graph(), object()
    with capture(graph, None) as g:  # stream None: torch.cuda.stream's no-op, as on a CPU-only machine
        assert g is graph and graph.calls == [("begin", {})]
    with capture(graph, None, pool):
        pass
    assert graph.calls == [("begin", {}), ("end", {}), ("begin", {"pool": pool}), ("end", {})]
    assert synced == []


def test_capture_ends_when_the_block_raises():
    graph = _Graph()
    with pytest.raises(RuntimeError, match="not capturable"):
        with capture(graph, None):
            raise RuntimeError("an op that is not capturable")
    assert [c for c, _ in graph.calls] == ["begin", "end"]
