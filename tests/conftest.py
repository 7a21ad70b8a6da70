"""Test setup: run the Triton kernels through the interpreter when there is no GPU, and poison every
buffer the kernels allocate with NaN, so a masked-out or forgotten store shows up as a failure."""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

_empty, _empty_like = torch.empty, torch.empty_like


def _nan_fill(t):
    if t.is_floating_point() and t.numel():
        with torch.no_grad():  # inductor allocates leaves that require grad through torch.empty
            t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _nan_fill(_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _nan_fill(_empty_like(*a, **k)))
    yield


@pytest.fixture(params=["cuda"] if torch.cuda.is_available() else ["cpu"])
def device(request):
    return torch.device(request.param)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
